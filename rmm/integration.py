"""The one place where the harness touches the model's internals: the attention function.

The engine streams chunks through an unmodified Hugging Face causal LM. Every attention layer calls
:func:`bounded_attention` (registered in transformers' ``AttentionInterface``), which reads and writes
the layer's slots in the :class:`~rmm.memory.SlotMemory` passed down as the ``kv_memory`` keyword.
Models need rotary position embeddings with the ``rotate_half`` convention (Llama, Mistral, Qwen2,
SmolLM, GPT-NeoX with partial rotary); nothing model-specific is copied.

Attention features the bounded attention reproduces: causal softmax attention with the model's own
``scaling``, multi-head and grouped-query heads, RoPE (full or partial rotary; plain, ``linear``,
``llama3`` and ``yarn`` frequencies; ``dynamic`` and ``longrope`` with original positions only), and a
sliding window as long as no query can reach a key that far back. Anything else a model asks of its
attention function (ALiBi, logit soft-capping, per-layer rotary frequencies, attention sinks, an unknown
keyword) is refused with an error before any token is scored: :func:`check_model`, :func:`check_reach`
and the keyword check in :func:`bounded_attention`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

from rmm.models import UnsupportedModelError, active_sliding_window

if TYPE_CHECKING:
    from rmm.memory import SlotMemory

ATTENTION_NAME = "rmm_bounded"
# keywords transformers passes to attention functions that the bounded attention may ignore: the
# engine supplies positions and masks itself and never uses the model's cache
IGNORED_KWARGS = frozenset({"position_ids", "cache_position", "use_cache", "output_attentions", "is_causal"})
# model types that always use ALiBi (others say so with config.alibi or position_embedding_type)
ALIBI_MODEL_TYPES = frozenset({"bloom", "mpt"})
# rope types whose frequencies change with the sequence length (transformers' dynamic_rope_update)
LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


def bounded_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    kv_memory: SlotMemory | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of a chunk's queries over the layer's retained slots plus the chunk itself.

    Parameters
    ----------
    query : [1, n_heads, Q, head_dim], rotated by the model at the positions the engine passed.
    key, value : [1, n_kv_heads, Q, head_dim] for the chunk's tokens.
    kv_memory : the engine's slot memory; required (the model must be driven by the engine).
    sliding_window : the layer's window, already cleared by :func:`check_reach` before streaming.
    softcap, kwargs : anything else must be None or in ``IGNORED_KWARGS``, else the call is refused.

    Returns
    -------
    attn_output : [1, Q, n_heads, head_dim]
    """
    if kv_memory is None:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' is only usable through rmm.engine.StreamingEngine")
    _check_call(module, sliding_window, softcap, kwargs)
    layer = module.layer_idx
    n_kv = key.shape[1]
    q = query[0].view(n_kv, -1, query.shape[2], query.shape[3])  # [H, G, Q, D]
    keys, values = kv_memory.attend_keys_values(layer, key[0], value[0])  # [H, S, D] each
    allowed = kv_memory.allowed_mask(layer)  # [H or 1, Q, S] bool
    sink_query = kv_memory.sink_query(q)  # [H, G, Q, D] or None (cache positions, sinks)
    if kv_memory.record_queries:
        kv_memory.store_queries(layer, q)

    if not kv_memory.record_attention:
        if sink_query is None:
            out = F.scaled_dot_product_attention(
                q, keys[:, None], values[:, None], attn_mask=allowed[:, None], scale=scaling, enable_gqa=True
            )
        else:
            out = _attention_with_sinks(q, sink_query, keys, values, kv_memory, layer, scaling)
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
        if kv_memory.track_gradient:
            out = kv_memory.track_output(layer, probs, values, out)
    out = out.reshape(1, -1, out.shape[-2], out.shape[-1])  # [1, n_heads, Q, D]
    return out.transpose(1, 2).contiguous(), None


def _attention_with_sinks(
    q: torch.Tensor,
    sink_query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kv_memory: SlotMemory,
    layer: int,
    scaling: float,
) -> torch.Tensor:
    """Attention where the first ``n_sink_slots`` slots see the query re-rotated to its cache rank.

    The sink slots' logits (a few dot products per query) are computed apart; the other slots keep
    PyTorch's fused kernel. On CPU the fused call returns its log-sum-exp, and the two parts are merged
    exactly by their log-sum-exps; elsewhere one fused call takes an additive bias that turns the sink
    slots' logits into the re-rotated ones.

    Parameters
    ----------
    q, sink_query : [H, G, Q, D], the query as the model rotated it and re-rotated to its cache rank.
    keys, values : [H, S, D].

    Returns
    -------
    out : [H, G, Q, D]
    """
    n_sinks = kv_memory.n_sink_slots
    sink_keys = keys[:, None, :n_sinks].transpose(-1, -2)  # [H, 1, D, n]
    blocked = kv_memory.blocked_mask(layer)[:, None, :, :n_sinks]  # [H or 1, 1, Q, n]
    sink_logits = (torch.matmul(sink_query, sink_keys).float() * scaling).masked_fill(blocked, float("-inf"))
    other_bias = kv_memory.other_slots_bias(layer)[:, None]  # [H or 1, 1, Q, S]: sinks and blocked -inf
    if _cpu_kernel_with_lse(q):
        n_heads, group = q.shape[:2]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q,
            keys[:, None].expand(n_heads, group, -1, -1),
            values[:, None].expand(n_heads, group, -1, -1),
            attn_mask=other_bias,
            scale=scaling,
        )  # out [H, G, Q, D], lse [H, G, Q] over the non-sink slots (each query sees itself there)
        total = torch.logaddexp(lse.float(), torch.logsumexp(sink_logits, dim=-1))  # [H, G, Q]
        sink_out = torch.matmul(torch.exp(sink_logits - total[..., None]), values[:, None, :n_sinks].float())
        return (out.float() * torch.exp(lse.float() - total)[..., None] + sink_out).to(values.dtype)
    plain_logits = torch.matmul(q, sink_keys).float() * scaling
    bias = other_bias.expand(q.shape[0], q.shape[1], -1, -1).clone()
    bias[..., :n_sinks] = (sink_logits - plain_logits).to(bias.dtype)
    return F.scaled_dot_product_attention(
        q, keys[:, None], values[:, None], attn_mask=bias, scale=scaling, enable_gqa=True
    )


def _cpu_kernel_with_lse(query: torch.Tensor) -> bool:
    """Whether PyTorch's fused CPU attention, which also returns its log-sum-exp, takes ``query``."""
    return query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16)


def cache_keyword(model: PreTrainedModel) -> str:
    """The forward keyword for a KV cache: ``cache`` in recent transformers 5, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@contextlib.contextmanager
def install(model: PreTrainedModel) -> Iterator[None]:
    """``with install(model):`` register :func:`bounded_attention` and switch ``model`` to it for the
    block; the model's previous attention implementation is restored on leaving it."""
    AttentionInterface.register(ATTENTION_NAME, bounded_attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def check_model(model: PreTrainedModel, positions: str) -> None:
    """Refuse, before streaming, a model whose attention the bounded attention would not reproduce.

    Checks the (text) config and the rotary modules; the sliding window depends on the stream and is
    checked by :func:`check_reach`. Raises :class:`UnsupportedModelError` naming the fix.
    """
    config = model.config.get_text_config()
    name = f"{type(model).__name__} ({config.model_type})"
    alibi = getattr(config, "alibi", False) or getattr(config, "position_embedding_type", None) == "alibi"
    if alibi or config.model_type in ALIBI_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{name} uses ALiBi position biases, which the bounded attention does not add; use a RoPE "
            "model (Llama, Mistral, Qwen2, SmolLM, GPT-NeoX)"
        )
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        raise UnsupportedModelError(
            f"{name} soft-caps its attention logits (attn_logit_softcapping={softcap}), which the bounded "
            "attention does not do; use a model without attention soft-capping (Llama, Mistral, Qwen2)"
        )
    modules = _rotary_modules(model)
    buffers = [m.inv_freq for m in modules if hasattr(m, "inv_freq")]
    if any(b.shape != buffers[0].shape or not torch.equal(b, buffers[0]) for b in buffers[1:]):
        raise UnsupportedModelError(
            f"{name} uses different rotary frequencies in different layers; the bounded attention "
            "re-rotates keys with one set of frequencies, so use a model with a single rotary embedding"
        )
    rope_types = {getattr(m, "rope_type", "default") for m in modules}
    length_dependent = sorted(str(t) for t in rope_types if t in LENGTH_DEPENDENT_ROPE)
    if positions == "cache" and length_dependent:
        raise UnsupportedModelError(
            f"{name} uses {length_dependent[0]} RoPE, whose frequencies change with the sequence length, so "
            "keys re-rotated to their cache rank would not match the model's own rotation; use "
            "positions=original, or a model with static RoPE scaling"
        )


def check_reach(model: PreTrainedModel, reach: int, what: str) -> None:
    """Refuse a stream whose queries may attend keys ``reach`` positions back past the model's window.

    A sliding window of W hides keys W or more positions back; the bounded attention does not apply it,
    so it reproduces the model only while ``reach`` < W. ``what`` describes the stream for the message.
    """
    window = active_sliding_window(model.config)
    if window is None or reach < window:
        return
    raise UnsupportedModelError(
        f"{model.config.get_text_config().model_type} applies a sliding window of {window} positions (keys "
        f"{window} or more positions back are invisible to it), but {what} lets a query attend keys up to "
        f"{reach} positions back, which the bounded attention would not hide. Keep the reach below {window}: "
        f"positions=cache with budget<={window - 1}, policy=window with budget<={window - 1}, or streams of "
        f"at most {window} tokens (dataset.max_tokens<={window}; oracle.context<={window - 1} for a "
        "reference pass)"
    )


def _check_call(
    module: torch.nn.Module, sliding_window: int | None, softcap: float | None, kwargs: dict
) -> None:
    """Refuse attention keywords the bounded attention would otherwise drop silently."""
    unknown = sorted(k for k, v in kwargs.items() if k not in IGNORED_KWARGS and v is not None)
    if unknown or softcap is not None:
        names = ", ".join(unknown + (["softcap"] if softcap is not None else []))
        raise UnsupportedModelError(
            f"{type(module).__name__} passes {names} to its attention function, which the bounded attention "
            "does not implement; use a supported model (Llama, Mistral, Qwen2, SmolLM, GPT-NeoX) "
            "or extend rmm/integration.py:bounded_attention"
        )
    config = getattr(module, "config", None)
    if sliding_window is not None and (config is None or active_sliding_window(config) != sliding_window):
        raise UnsupportedModelError(
            f"{type(module).__name__} applies a sliding window of {sliding_window} that its config does not "
            "declare, so it was not checked before streaming; use a supported model or extend "
            "rmm/models.py:active_sliding_window"
        )


def _rotary_modules(model: PreTrainedModel) -> list[torch.nn.Module]:
    return [m for name, m in model.named_modules() if name.endswith("rotary_emb")]
