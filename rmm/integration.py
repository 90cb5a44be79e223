"""The one place where the harness touches the model's internals: the attention function.

The engine streams chunks through an unmodified Hugging Face causal LM. Every attention layer calls
:func:`bounded_attention` (registered in transformers' ``AttentionInterface``), which reads and writes
the layer's slots in the :class:`~rmm.memory.SlotMemory` passed down as the ``kv_memory`` keyword.
Models need rotary position embeddings with the ``rotate_half`` convention (Llama, Mistral, Qwen2,
SmolLM, GPT-NeoX with partial rotary); nothing model-specific is copied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

if TYPE_CHECKING:
    from rmm.memory import SlotMemory

ATTENTION_NAME = "rmm_bounded"


def bounded_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    kv_memory: SlotMemory | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of a chunk's queries over the layer's retained slots plus the chunk itself.

    Parameters
    ----------
    query : [1, n_heads, Q, head_dim], rotated by the model at the positions the engine passed.
    key, value : [1, n_kv_heads, Q, head_dim] for the chunk's tokens.
    kv_memory : the engine's slot memory; required (the model must be driven by the engine).

    Returns
    -------
    attn_output : [1, Q, n_heads, head_dim]
    """
    if kv_memory is None:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' is only usable through rmm.engine.StreamingEngine")
    layer = module.layer_idx
    n_kv = key.shape[1]
    q = query[0].view(n_kv, -1, query.shape[2], query.shape[3])  # [H, G, Q, D]
    keys, values = kv_memory.attend_keys_values(layer, key[0], value[0])  # [H, S, D] each
    allowed = kv_memory.allowed_mask(layer)  # [H or 1, Q, S] bool
    sink_query = kv_memory.sink_query(q)  # [H, G, Q, D] or None (cache positions, sinks)
    if kv_memory.record_queries:
        kv_memory.store_queries(layer, q)

    if not kv_memory.record_attention and sink_query is None:
        out = F.scaled_dot_product_attention(
            q, keys[:, None], values[:, None], attn_mask=allowed[:, None], scale=scaling, enable_gqa=True
        )
    else:
        logits = torch.matmul(q, keys[:, None].transpose(-1, -2)).float() * scaling  # [H, G, Q, S]
        if sink_query is not None:
            n_sinks = kv_memory.n_sink_slots
            sink_logits = (
                torch.matmul(sink_query, keys[:, None, :n_sinks].transpose(-1, -2)).float() * scaling
            )
            logits[..., :n_sinks] = sink_logits
        logits = logits.masked_fill(kv_memory.blocked_mask(layer)[:, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if kv_memory.record_attention:
            kv_memory.store_attention(layer, probs.sum(dim=1))  # GQA group summed: [H, Q, S]
        out = torch.matmul(probs.to(values.dtype), values[:, None])  # [H, G, Q, D]
    out = out.reshape(1, -1, out.shape[-2], out.shape[-1])  # [1, n_heads, Q, D]
    return out.transpose(1, 2).contiguous(), None


def install(model: PreTrainedModel) -> None:
    """Register :func:`bounded_attention` and switch ``model`` to it (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, bounded_attention)
    model.set_attn_implementation(ATTENTION_NAME)
