"""The one place where the harness touches the model's internals: the attention function.

The engine streams chunks through an unmodified Hugging Face causal LM. Every attention layer calls
:func:`bounded_attention` (registered in transformers' ``AttentionInterface``), which reads and writes
the layer's slots in the :class:`~rmm.memory.SlotMemory` of the pass (one row per stream, one call per
layer for the whole batch): the memory made :func:`active` for the forward pass (no keyword has to
travel through the model's layers). The model's masks reach it unevaluated: :func:`model_mask` is
registered as the attention's ``AttentionMaskInterface``, so each layer hands over the model's own
mask function (causal, sliding window, attention chunks), which the memory evaluates at original
positions. Nothing model-specific is copied.

Attention features the bounded attention reproduces: causal softmax attention with the model's own
``scaling``, multi-head and grouped-query heads (also handed as copies one after the other: JetMoE),
sliding and chunked windows per layer type, attention logit soft-capping, learned attention sinks
(``s_aux``), a learned bias per key with its keep window (Doge: :func:`key_bias_window`), and RoPE of any
per-layer kind that :mod:`rmm.rotary` knows (checked against the model by
:mod:`rmm.selfcheck`). Anything else is refused with :class:`~rmm.errors.UnsupportedModelError` before
any token is scored: :func:`check_model` (the config), :func:`install` (the model must switch to the
attention function), the call check in :func:`bounded_attention` (unknown keywords, masks not built
through the interface, head shapes, a second call of a layer in one pass), a mask that the model
computes with as a tensor (:class:`ModelMask`) and the self-check (:mod:`rmm.selfcheck`).
"""

from __future__ import annotations

import contextlib
import inspect
import typing
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import (
    Cache,
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionLayer,
)
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function

from rmm.errors import UnsupportedModelError
from rmm.masks import additive
from rmm.model_config import key_bias_window

if TYPE_CHECKING:
    from rmm.memory import SlotMemory

ATTENTION_NAME = "rmm_bounded"
# keywords transformers passes to attention functions that do not change what attention computes: the
# engine supplies positions and masks itself and never uses the model's cache; the rest are flags for
# other outputs (mixture-of-experts router logits, hidden states)
IGNORED_KWARGS = frozenset(
    {
        "position_ids",
        "cache_position",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
        "is_causal",
        "layer_idx",
        "layer_type",
        "logits_to_keep",
    }
)
# model types that always use ALiBi (others say so with config.alibi or position_embedding_type)
ALIBI_MODEL_TYPES = frozenset({"bloom", "mpt"})
# rope types whose frequencies change with the sequence length (transformers' dynamic_rope_update)
LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})
PLAIN_ATTENTION_LAYER_TYPES = frozenset(
    {"full_attention", "sliding_attention", "chunked_attention", "attention"}
)
# layer types (config.layer_types) whose layers attend through the attention function (a hybrid layer
# also runs a recurrent or convolutional mixer beside its attention: Falcon-H1, Zamba)
ATTENTION_LAYER_TYPES = PLAIN_ATTENTION_LAYER_TYPES | {"hybrid", "hybrid_sliding"}
# layer types whose sliding window is the config's ``sliding_window``
SLIDING_LAYER_TYPES = frozenset({"sliding_attention", "hybrid_sliding"})
# the model's own cache layers (transformers' DynamicCache built from the config) the harness can carry:
# recurrent or convolutional state (carried across chunks, one row per stream), attention entries
# (never stored: the slot memory holds them), or nothing
CARRIED_CACHE_LAYERS = (
    LinearAttentionLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
)
ATTENTION_CACHE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, DummyLayer)
# layer types without attention that carry no state from token to token (a chunk boundary changes nothing)
STATELESS_LAYER_TYPES = frozenset({"mlp", "moe", "dense", "ffn"})

# the memory of the running pass (one row per stream); the attention function reads it
_ACTIVE: list[SlotMemory] = []


@dataclass(frozen=True)
class Visibility:
    """A layer's own window, as the model defines it: transformers' mask function (``mask_function``
    of the model's causal, sliding or chunked mask) and the ``sliding_window`` keyword, evaluated at
    original positions. Hashable: one per layer type and pass."""

    mask_function: Callable | None
    window: int | None

    def __call__(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """bool [..., Q, S] for query_pos [..., Q] and key_pos [..., S] (original positions, broadcast)."""
        q, k = query_pos[..., :, None], key_pos[..., None, :]
        visible = k <= q
        if self.mask_function is not None:
            visible = visible & torch.as_tensor(self.mask_function(0, 0, q, k), device=k.device)
        if self.window is not None:
            visible = visible & (q - k < self.window)
        return visible


@dataclass(frozen=True)
class ModelMask:
    """What the bounded attention receives as ``attention_mask``: the model's mask function, unevaluated
    (:func:`model_mask` is registered in transformers' ``AttentionMaskInterface``)."""

    mask_function: Callable

    def __getitem__(self, index: object) -> ModelMask:
        """A model may slice its mask to the queries it keeps (Gemma 4, before its KV-shared layers, to
        ``logits_to_keep``); a slice that keeps every query is the same mask, any other is refused."""
        whole = slice(None), slice(0, None)
        if not all(part in whole for part in (index if isinstance(index, tuple) else (index,))):
            raise UnsupportedModelError(
                f"the model slices its attention mask ({index!r}) to fewer queries than the pass has, which "
                "the bounded attention cannot follow; this model is not supported"
            )
        return self

    @classmethod
    def __torch_function__(cls, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None):
        """Refuse a model that computes with its mask as a tensor (GIT adds it to attention scores it
        computes itself): its attention never calls the bounded attention."""
        raise UnsupportedModelError(
            f"the model computes with its attention mask as a tensor ({getattr(func, '__name__', func)}): it "
            "applies the mask itself, to attention scores it computes outside transformers' attention "
            "interface (as GIT's text layers do), so its attention never calls the bounded attention and the "
            "memory would bound nothing; this model is not supported"
        )


def model_mask(
    *, mask_function: Callable = causal_mask_function, config: PretrainedConfig | None = None, **kwargs
) -> ModelMask | None:
    """transformers' mask interface for the bounded attention: hand the mask function over as it is. A
    model that adds a bias per key onto its mask (:func:`key_bias_window`) gets no mask (None), so that
    what it hands the attention function is its bias alone (:func:`_key_bias`); the bounded attention
    masks causally itself, and any other mask function is refused."""
    if config is None or key_bias_window(config) is None:
        return ModelMask(mask_function)
    if mask_function is not causal_mask_function:
        raise UnsupportedModelError(
            f"{type(config).__name__} asks for a {getattr(mask_function, '__name__', 'non-causal')} mask and "
            "adds its learned bias per key onto it; the bounded attention reads that bias from an unmasked "
            "chunk only, so it supports such a model with plain causal masks alone"
        )
    return None


def bounded_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: ModelMask | torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    kv_memory: SlotMemory | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of a pass's queries over the layer's retained slots plus the chunk itself, every row of
    the batch in one call.

    Parameters
    ----------
    query : [N, n_heads, Q, head_dim], rotated by the model at the positions the engine passed; row i is
        the chunk of the memory's i-th stream, which attends over its own slots only.
    key, value : [N, n_kv_heads, Q, head_dim] and [N, n_kv_heads, Q, value_head_dim] for the chunks'
        tokens (the two head dimensions differ under multi-head latent attention).
    attention_mask : the model's mask for this layer type (:class:`ModelMask`; None: plain causal).
    kv_memory : the slot memory to use (default: the memory made :func:`active` for this pass).
    sliding_window : the layer's window W: keys W or more positions back are hidden.
    softcap : attention logit soft-capping, logits -> softcap * tanh(logits / softcap).
    s_aux : learned attention sinks [n_heads], one extra logit per head in the softmax's denominator.
    kwargs : anything else must be None or in ``IGNORED_KWARGS``, else the call is refused.

    KV heads handed as copies of the layer's own, one after the other (JetMoE), are attended once each
    (:func:`_untiled`): the memory holds the layer's own, each shared by the query heads of its copies.

    Returns
    -------
    attn_output : [N, Q, n_heads, value_head_dim]
    """
    memory = kv_memory if kv_memory is not None else (_ACTIVE[-1] if _ACTIVE else None)
    if memory is None:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' is only usable through rmm.engine.StreamingEngine")
    tiles = _check_call(module, query, key, value, memory, attention_mask, kwargs)
    visible = _visibility(attention_mask, sliding_window)
    if isinstance(attention_mask, torch.Tensor):  # a bias per key (checked by _check_call)
        memory.store_key_bias(module.layer_idx, *_key_bias(module, attention_mask, key.shape[1]))
    order, query, key, value, s_aux = _untiled(tiles, query, key, value, s_aux)
    out = _attend(module.layer_idx, query, key, value, memory, visible, scaling, softcap, s_aux)
    if order is not None:  # back to the model's order of query heads
        out = out[:, torch.argsort(order)]
    return out.transpose(1, 2).contiguous(), None


def _key_bias(module: torch.nn.Module, attention_mask: torch.Tensor, n_kv: int) -> tuple[torch.Tensor, int]:
    """The bias per key a model adds to its attention logits (:func:`key_bias_window`), read from the mask
    tensor it hands over for the chunk's own keys, [N, n_heads, Q, Q]: the same for every query and for
    the query heads of one KV head (those of KV head h are h * G .. h * G + G - 1). Returns the bias per
    KV head and key [N, n_kv, Q] and the keep window W; a mask of any other form is refused."""
    name = type(module).__name__
    window = key_bias_window(module.config)
    rows, n_heads, n_q, n_keys = attention_mask.shape
    if n_q > window:
        raise UnsupportedModelError(
            f"{name} keeps, per query, the {window} keys of largest bias, and a chunk of {n_q} tokens would "
            f"have it select keys within the chunk itself; use a chunk of at most {window} tokens"
        )
    group = n_heads // n_kv
    bias = attention_mask[:, ::group, 0]  # [N, n_kv, Q]
    per_key = bias.repeat_interleave(group, dim=1)[:, :, None].expand(rows, n_heads, n_q, n_keys)
    if n_keys != n_q or not torch.equal(attention_mask, per_key):
        raise UnsupportedModelError(
            f"{name} hands attention a mask tensor {tuple(attention_mask.shape)} that is not one bias per "
            "key and KV head for the chunk's own keys; the bounded attention cannot tell what it hides"
        )
    return bias, window


def _visibility(
    attention_mask: ModelMask | torch.Tensor | None, sliding_window: int | None
) -> Visibility | None:
    """What a layer's queries may see beyond plain causality: the model's mask function (unless causal)
    and the sliding window; None when neither applies."""
    mask_function = attention_mask.mask_function if isinstance(attention_mask, ModelMask) else None
    if mask_function is causal_mask_function:
        mask_function = None
    plain = mask_function is None and sliding_window is None
    return None if plain else Visibility(mask_function, sliding_window)


def _attend(
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_memory: SlotMemory,
    visible: Visibility | None,
    scaling: float,
    softcap: float | None,
    s_aux: torch.Tensor | None,
) -> torch.Tensor:
    """The batch's attention: query [N, n_heads, Q, D], key [N, n_kv_heads, Q, D] and value
    [N, n_kv_heads, Q, Dv] over the memory's rows -> [N, n_heads, Q, Dv]. A layer narrower than the
    memory (per-layer shapes) is zero-padded to its head dimensions and attends over its own heads."""
    kv_memory.enter_layer(layer, visible)
    rows, n_kv, n_q, head_dim = key.shape
    group = query.shape[1] // n_kv
    q = query.reshape(rows, n_kv, group, n_q, head_dim)  # [N, H, G, Q, D]
    if kv_memory.capture is not None:
        kv_memory.capture(layer, q, key)
    value_dim = value.shape[-1]
    q, key, value = _padded_to_memory(kv_memory, q, key, value)
    keys, values = kv_memory.attend_keys_values(layer, key, value)  # [N, H, S, D] each
    if keys.shape[1] > n_kv:  # a layer with fewer heads than the memory (no view where it has them all)
        keys, values = keys[:, :n_kv], values[:, :n_kv]
    sink_query = kv_memory.sink_query(layer, q)  # [N, H, G, Q, D] or None (cache positions, sinks)
    if kv_memory.record_queries:
        kv_memory.store_queries(layer, q)
    if attention_path(kv_memory, softcap, s_aux) == "fused":
        out = _fused_attention(layer, q, sink_query, keys, values, kv_memory, scaling)
    else:
        out = _explicit_attention(layer, q, sink_query, keys, values, kv_memory, scaling, softcap, s_aux)
    out = out.reshape(rows, n_kv * group, n_q, values.shape[-1])
    return out if value_dim == out.shape[-1] else out[..., :value_dim]


def _padded_to_memory(
    kv_memory: SlotMemory, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, H, G, Q, D], key [N, H, Q, D] and value [N, H, Q, Dv] zero-padded to the memory's head
    dimensions (and key, value to its heads); unchanged for a layer as wide as the memory."""
    n_kv, head_dim, value_dim = key.shape[1], key.shape[-1], value.shape[-1]
    heads, width, value_width = kv_memory.keys.shape[2], kv_memory.keys.shape[-1], kv_memory.values.shape[-1]
    if (n_kv, head_dim, value_dim) == (heads, width, value_width):
        return q, key, value
    q = F.pad(q, (0, width - head_dim))
    key = F.pad(key, (0, width - head_dim, 0, 0, 0, heads - n_kv))
    value = F.pad(value, (0, value_width - value_dim, 0, 0, 0, heads - n_kv))
    return q, key, value


def _fused_attention(
    layer: int,
    q: torch.Tensor,
    sink_query: torch.Tensor | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    kv_memory: SlotMemory,
    scaling: float,
) -> torch.Tensor:
    """The fused path: q [N, H, G, Q, D] over keys [N, H, S, D] and values [N, H, S, Dv] by
    scaled_dot_product_attention (the group folded into the rows: keys and values are never repeated)
    -> [N, H, G * Q, Dv]; with sink queries through :func:`_attention_with_sinks`."""
    if sink_query is not None:
        return _attention_with_sinks(q, sink_query, keys, values, kv_memory, layer, scaling)
    rows, n_kv, group, n_q, width = q.shape
    return F.scaled_dot_product_attention(
        q.reshape(rows, n_kv, group * n_q, width),
        keys,
        values,
        attn_mask=kv_memory.folded_mask(layer, group),
        scale=scaling,
    )


def _explicit_attention(
    layer: int,
    q: torch.Tensor,
    sink_query: torch.Tensor | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    kv_memory: SlotMemory,
    scaling: float,
    softcap: float | None,
    s_aux: torch.Tensor | None,
) -> torch.Tensor:
    """The explicit path, block of rows by block: q [N, H, G, Q, D] over keys [N, H, S, D] and values
    [N, H, S, Dv] -> [N, H, G, Q, Dv], recording attention and tracking gradients as the memory asks."""
    n_kv, group, n_q = q.shape[1:4]
    key_bias = kv_memory.key_bias_for(layer, keys.shape[1], keys.shape[2])  # [N, H, S] or None
    if key_bias is None:
        mask = kv_memory.eager_bias(layer)  # [N, H or 1, Q, S]
    else:
        hidden = kv_memory.blocked_mask(layer)  # [N, H or 1, Q, S]
        mask = additive(_outside_keep_window(hidden, key_bias, kv_memory.keep_window))
    outs = []
    for part in row_blocks(q, keys.shape[2], kv_memory.track_gradient):
        probs = _probabilities(
            q[part],
            keys[part],
            mask[part],
            None if sink_query is None else sink_query[part],
            kv_memory.n_sink_slots,
            scaling,
            softcap,
            s_aux,
            None if key_bias is None else key_bias[part],
        )
        if kv_memory.record_attention:
            kv_memory.store_attention(layer, probs, part)  # kept GQA group summed: [n, H, Q, S]
        n = probs.shape[0]  # the group as rows again: values are never broadcast
        out = torch.matmul(probs.to(values.dtype).reshape(n, n_kv, group * n_q, -1), values[part])
        out = out.view(n, n_kv, group, n_q, values.shape[-1])  # [n, H, G, Q, Dv]
        if kv_memory.track_gradient:
            out = kv_memory.track_output(layer, probs, values, out)
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs)


# the explicit path on a CPU: rows per computation such that one computation's fp32 probabilities
# [n, n_heads, Q, S] stay within about this many bytes; on other devices every row at once. Chosen by an ad
# hoc measurement with this constant patched (SmolLM2, 2 cores, batch 8, C = 64, 2026-12-05): at B = 256
# the whole batch at once (5.9 MB) ran h2o 1.07x as fast as 1 MB blocks; at B = 1024, 1 MB blocks 1.04x
# the whole batch
CPU_BLOCK_BYTES = 2**23


def _outside_keep_window(hidden: torch.Tensor, key_bias: torch.Tensor, window: int) -> torch.Tensor:
    """``hidden`` [N, H or 1, Q, S] with, for each query, the keys it sees beyond the ``window`` of largest
    ``key_bias`` [N, H, S] hidden too (:func:`key_bias_window`), ties to the more recent key (slots are in
    position order): [N, H, Q, S]; unchanged where no query can see more than ``window`` slots."""
    n_slots = hidden.shape[-1]
    if n_slots <= window:
        return hidden
    scores = key_bias[:, :, None, :].masked_fill(hidden, float("-inf")).flip(-1)  # latest slot first
    top = n_slots - 1 - torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :window]
    return hidden | torch.ones_like(scores, dtype=torch.bool).scatter_(-1, top, False)


def row_blocks(query: torch.Tensor, n_slots: int, whole: bool) -> list[slice]:
    """The blocks of rows the explicit path computes at once for queries [N, H, G, Q, D] over ``n_slots``
    slots: all N off the CPU or when ``whole`` (gradient tracking keeps one graph per layer), else as
    many as keep the fp32 probabilities within :data:`CPU_BLOCK_BYTES`."""
    rows = query.shape[0]
    if whole or query.device.type != "cpu":
        return [slice(0, rows)]
    per_row = query[0, ..., 0].numel() * n_slots * 4
    step = max(1, CPU_BLOCK_BYTES // per_row)
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _probabilities(
    q: torch.Tensor,
    keys: torch.Tensor,
    mask: torch.Tensor,
    sink_query: torch.Tensor | None,
    n_sinks: int,
    scaling: float,
    softcap: float | None,
    s_aux: torch.Tensor | None,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention probabilities [n, H, G, Q, S] in fp32 (fp64 for an fp64 model) of queries q [n, H, G, Q, D]
    over keys [n, H, S, D]; the first ``n_sinks`` slots seen by ``sink_query`` where given; logits soft-capped
    by ``softcap``, then ``key_bias`` [n, H, S] and the additive ``mask`` [n, H or 1, Q, S] (-inf: hidden)
    added; one more logit per query head from ``s_aux`` [n_heads] whose probability is dropped."""
    wide = torch.promote_types(q.dtype, torch.float32)
    rows, n_kv, group, n_q, head_dim = q.shape
    folded = q.reshape(rows, n_kv, group * n_q, head_dim)  # the group as rows: keys are never broadcast
    logits = torch.matmul(folded, keys.transpose(-1, -2)).to(wide)  # a fresh tensor: in place
    logits = logits.view(rows, n_kv, group, n_q, -1)  # [n, H, G, Q, S]
    if sink_query is None and softcap is None and key_bias is None:
        # scaled and masked in one op, mask + scaling * logits: the bits of scaling, then adding 0 or -inf
        out = None if logits.requires_grad else logits  # in place unless autograd tracks it (out= is not
        logits = torch.add(mask[:, :, None], logits, alpha=scaling, out=out)  # differentiable)
    else:
        logits.mul_(scaling)
        if sink_query is not None:
            sink_keys = keys[:, :, None, :n_sinks].transpose(-1, -2)
            logits[..., :n_sinks] = torch.matmul(sink_query, sink_keys).to(wide) * scaling
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        if key_bias is not None:
            logits.add_(key_bias[:, :, None, None].to(wide))
        logits.add_(mask[:, :, None])
    if s_aux is None:
        return torch.softmax(logits, dim=-1, out=None if logits.requires_grad else logits)
    sinks = s_aux.to(wide).view(1, n_kv, group, 1, 1).expand(rows, -1, -1, n_q, 1)
    return torch.softmax(torch.cat([logits, sinks], dim=-1), dim=-1)[..., :-1]


def attention_path(kv_memory: SlotMemory, softcap: float | None, s_aux: torch.Tensor | None) -> str:
    """Which computation a layer's attention takes: ``fused`` (scaled_dot_product_attention over the
    memory, nothing materialised) unless the probabilities are needed, then ``explicit`` (logits and
    probabilities materialised in fp32, fp64 for an fp64 model). They are needed when the memory records
    attention (a policy that reads it, the gradient utility, or an observer:
    ``RecordingPlan.observed``), or when the model asks for a logit softcap or attention-sink logits
    (``s_aux``), or adds a bias per key (:func:`key_bias_window`). The fused call never passes
    ``enable_gqa`` with a mask (which sends CUDA to its unfused math kernel): the query group is folded
    into the rows instead."""
    if kv_memory.record_attention or softcap is not None or s_aux is not None or kv_memory.has_key_bias:
        return "explicit"
    return "fused"


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
    PyTorch's fused kernel, with the query group folded into the rows. On CPU the fused call returns its
    log-sum-exp, and the two parts are merged exactly by their log-sum-exps; elsewhere one fused call
    takes an additive bias that turns the sink slots' logits into the re-rotated ones.

    Parameters
    ----------
    q, sink_query : [N, H, G, Q, D], the query as the model rotated it and re-rotated to its cache rank.
    keys, values : [N, H, S, D] and [N, H, S, Dv].

    Returns
    -------
    out : [N, H, G * Q, Dv]
    """
    rows, n_kv, group, n_q, head_dim = q.shape
    n_sinks = kv_memory.n_sink_slots
    flat = q.reshape(rows, n_kv, group * n_q, head_dim)
    sink_keys = keys[:, :, :n_sinks].transpose(-1, -2)  # [N, H, D, n]
    blocked = kv_memory.blocked_mask(layer)[:, :, None, :, :n_sinks]  # [N, H or 1, 1, Q, n]
    # the sink logits in float32 at least from the start (n columns, cheap): a bfloat16 product would round
    # them before they enter the sum, and their difference from the plain logits below again
    wide = torch.promote_types(q.dtype, torch.float32)
    sink_keys = sink_keys.to(wide)
    sink_logits = torch.matmul(sink_query.to(wide), sink_keys[:, :, None]) * scaling  # [N, H, G, Q, n]
    sink_logits = sink_logits.float()
    sink_logits = sink_logits.masked_fill(blocked, float("-inf")).reshape(rows, n_kv, group * n_q, n_sinks)
    other_bias = kv_memory.folded_mask(layer, group, bias=True)  # [N, H or 1, G * Q, S]
    if _cpu_kernel_with_lse(q) and values.shape[-1] == head_dim:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            flat, keys, values, attn_mask=other_bias, scale=scaling
        )  # out [N, H, G * Q, Dv], lse [N, H, G * Q] over the non-sink slots (each query sees itself there)
        total = torch.logaddexp(lse.float(), torch.logsumexp(sink_logits, dim=-1))  # [N, H, G * Q]
        sink_out = torch.matmul(torch.exp(sink_logits - total[..., None]), values[:, :, :n_sinks].float())
        return (out.float() * torch.exp(lse.float() - total)[..., None] + sink_out).to(values.dtype)
    plain_logits = (torch.matmul(flat.to(wide), sink_keys) * scaling).float()
    bias = other_bias.expand(rows, n_kv, -1, -1).clone()
    bias[..., :n_sinks] = (sink_logits - plain_logits).to(bias.dtype)
    return F.scaled_dot_product_attention(flat, keys, values, attn_mask=bias, scale=scaling)


def _cpu_kernel_with_lse(query: torch.Tensor) -> bool:
    """Whether PyTorch's fused CPU attention, which also returns its log-sum-exp, takes ``query``."""
    return query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16)


# the attribute of an attention module (the module with a ``layer_idx`` that holds one of these linear
# layers) that projects the heads' concatenated outputs back to the hidden size
OUTPUT_PROJECTIONS = ("o_proj", "dense", "out_proj")


def output_projections(model: PreTrainedModel) -> torch.Tensor:
    """[L, H, hidden, G * D] float32: per layer and KV head, the columns of the attention output projection
    W_o [hidden, n_heads * D] that the KV head's query heads h * G .. h * G + G - 1 feed, in that order.

    The attention module of layer l is the module whose ``layer_idx`` is l and which holds a linear
    ``o_proj`` (Llama, Qwen2, Mistral, Gemma), ``dense`` (GPT-NeoX) or ``out_proj``; its input is the
    heads' outputs concatenated head by head. A model without exactly one per layer is refused.
    """
    config = model.config.get_text_config()
    n_layers, n_heads = config.num_hidden_layers, config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    found: dict[int, torch.Tensor] = {}
    for name, module in model.named_modules():
        layer = getattr(module, "layer_idx", None)
        linears = [getattr(module, attr) for attr in OUTPUT_PROJECTIONS if hasattr(module, attr)]
        linears = [linear for linear in linears if isinstance(linear, torch.nn.Linear)]
        if layer is None or not linears:
            continue
        if len(linears) > 1 or layer in found:
            raise UnsupportedModelError(f"{name}: more than one output projection for layer {layer}")
        found[int(layer)] = linears[0].weight
    if sorted(found) != list(range(n_layers)):
        raise UnsupportedModelError(
            f"{type(model).__name__}: found output projections ({', '.join(OUTPUT_PROJECTIONS)}) for layers "
            f"{sorted(found)}, expected one for each of its {n_layers} layers"
        )
    per_layer = []
    for layer in range(n_layers):
        weight = found[layer].detach().float()  # [hidden, n_heads * D]
        hidden, columns = weight.shape
        if columns % n_heads:
            raise UnsupportedModelError(
                f"layer {layer}: output projection input {columns} is not n_heads ({n_heads}) * D"
            )
        per_layer.append(weight.view(hidden, n_kv, columns // n_kv).transpose(0, 1))  # [H, hidden, G * D]
    return torch.stack(per_layer).contiguous()


def cache_keyword(model: PreTrainedModel) -> str:
    """The forward keyword for a KV cache: ``cache`` in recent transformers 5, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@contextlib.contextmanager
def install(model: PreTrainedModel) -> Iterator[None]:
    """``with install(model):`` register :func:`bounded_attention` (and :func:`model_mask` as its mask
    interface) and switch ``model`` to it for the block; the model's previous attention implementation
    is restored on leaving it. A model that refuses the switch is refused."""
    AttentionInterface.register(ATTENTION_NAME, bounded_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, model_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    config = model.config.get_text_config()
    if config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(previous)
        raise UnsupportedModelError(
            f"{name_of(model)} did not switch to the attention function {ATTENTION_NAME!r} (it keeps "
            f"{config._attn_implementation!r}), so the memory would never be read; this model is not "
            "supported"
        )
    try:
        with text_only_masks(model):
            yield
    finally:
        model.set_attn_implementation(previous)


@contextlib.contextmanager
def text_only_masks(model: PreTrainedModel) -> Iterator[None]:
    """``with text_only_masks(model):`` the model builds its masks for text alone. Where image tokens
    attend each other bidirectionally (``use_bidirectional_attention="vision"``: Gemma 4 unified), the
    model ORs its causal masks with a function of a per-pass tensor of image-block ids, which a stream of
    token ids leaves all -1 (that function unmasks nothing), but which cannot be evaluated at a stream's
    original positions; the block builds the model's masks without it (restored on leaving)."""
    config = model.config.get_text_config()
    vision = getattr(config, "use_bidirectional_attention", None) == "vision"
    if vision:
        config.use_bidirectional_attention = None
    try:
        yield
    finally:
        if vision:
            config.use_bidirectional_attention = "vision"


@contextlib.contextmanager
def active(memory: SlotMemory) -> Iterator[None]:
    """``with active(memory):`` the bounded attention reads ``memory`` (row i for batch row i) during the
    block (the engine's forward pass; no keyword has to travel through the model's layers, which some
    drop)."""
    _ACTIVE.append(memory)
    try:
        yield
    finally:
        _ACTIVE.pop()


def name_of(model: PreTrainedModel) -> str:
    """``ClassName (model_type)`` for messages."""
    return f"{type(model).__name__} ({model.config.get_text_config().model_type})"


def attention_layers(model: PreTrainedModel) -> list[int]:
    """The layers that attend through the attention function: every layer, or those whose
    ``config.layer_types`` entry is an attention type."""
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return list(range(config.num_hidden_layers))
    return [i for i, kind in enumerate(layer_types) if kind in ATTENTION_LAYER_TYPES]


def module_shapes(model: PreTrainedModel, stated: tuple[int, int, int]) -> list[tuple[int, int, int]] | None:
    """Per layer, (KV heads, key and value head dimensions) as the attention modules' own projections
    hold them, where some layer differs from the config's ``stated`` shape (MiMo-V2-Flash's sliding layers
    have twice the config's KV heads and values of their own head dimension); None where they all agree
    or a module does not say (no ``k_proj``/``v_proj`` linear and integer ``head_dim``). Layers that do
    not attend keep ``stated``. The bounded attention checks each call against these shapes."""
    config = model.config.get_text_config()
    shapes = [stated] * config.num_hidden_layers
    found = set()
    for module in model.modules():
        layer, head_dim = getattr(module, "layer_idx", None), getattr(module, "head_dim", None)
        k_proj, v_proj = getattr(module, "k_proj", None), getattr(module, "v_proj", None)
        linear = isinstance(k_proj, torch.nn.Linear) and isinstance(v_proj, torch.nn.Linear)
        if not (linear and isinstance(layer, int) and isinstance(head_dim, int)) or layer in found:
            continue
        n_kv = k_proj.out_features // head_dim
        if n_kv < 1 or n_kv * head_dim != k_proj.out_features or v_proj.out_features % n_kv:
            return None
        shapes[layer] = (n_kv, head_dim, v_proj.out_features // n_kv)
        found.add(layer)
    if not set(attention_layers(model)) <= found or all(shape == stated for shape in shapes):
        return None
    return shapes


def layer_windows(model: PreTrainedModel) -> list[int | None]:
    """Per layer, the most past entries it can attend (W - 1 for a sliding window W, chunk - 1 for
    attention chunks), None for a global layer. Read from the config: ``layer_types`` with
    ``sliding_window`` / ``attention_chunk_size``, or one ``sliding_window`` for every layer."""
    config = model.config.get_text_config()
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    chunk = getattr(config, "attention_chunk_size", None)
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return [None if window is None else int(window) - 1] * config.num_hidden_layers
    reach = dict.fromkeys(SLIDING_LAYER_TYPES, window) | {"chunked_attention": chunk}
    return [None if reach.get(kind) is None else int(reach[kind]) - 1 for kind in layer_types]


def check_model(model: PreTrainedModel) -> None:
    """Refuse, before streaming, a model whose attention the bounded attention would not reproduce.

    Reads the (text) config: ALiBi, bidirectional attention, keys selected per query (a sparse attention
    indexer, a learned bias per key on a windowed mask: :func:`_check_key_selection`), layers that
    are not attention whose state the model's own cache cannot carry (:func:`carried_layers`), no
    attention layer at all (length-dependent RoPE under cache positions: :func:`check_positions`).
    Whatever the config does not say is found by :mod:`rmm.selfcheck` before the first scored token.
    Raises :class:`UnsupportedModelError` naming the reason.
    """
    config = model.config.get_text_config()
    name = name_of(model)
    alibi = getattr(config, "alibi", False) or getattr(config, "position_embedding_type", None) == "alibi"
    if alibi or config.model_type in ALIBI_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{name} uses ALiBi position biases, which the bounded attention does not add; use a RoPE "
            "model (Llama, Mistral, Qwen2, SmolLM, GPT-NeoX, Gemma 3)"
        )
    if getattr(config, "is_causal", True) is False:
        raise UnsupportedModelError(f"{name} attends bidirectionally; the harness streams causal LMs only")
    _check_key_selection(config, name)
    layer_types = list(getattr(config, "layer_types", None) or [])
    other = sorted(set(layer_types) - ATTENTION_LAYER_TYPES - STATELESS_LAYER_TYPES)
    if other:
        carried_layers(model)  # the model's own cache must carry them, or the model is refused
    if layer_types and not set(layer_types) & ATTENTION_LAYER_TYPES:
        raise UnsupportedModelError(
            f"{name} has no attention layer (its layer types: {', '.join(sorted(set(layer_types)))}), so "
            "there is no KV memory for a policy to bound; this model is not supported"
        )


def _check_key_selection(config: PretrainedConfig, name: str) -> None:
    """Refuse a model whose queries attend only keys that a learned indexer selects from its own cache of
    indexer keys (``index_topk``), and a model with a bias per key (:func:`key_bias_window`) whose mask is
    windowed (the bias is read from an unmasked chunk: :func:`model_mask`)."""
    if getattr(config, "index_topk", None):
        raise UnsupportedModelError(
            f"{name} attends, per query, only the {config.index_topk} keys that a learned indexer selects "
            "from its own cache of indexer keys (sparse attention), which the bounded attention does not "
            "reproduce; this model is not supported"
        )
    if key_bias_window(config) is not None and getattr(config, "sliding_window", None):
        raise UnsupportedModelError(
            f"{name} adds a learned bias per key onto a sliding-window mask; the bounded attention reads "
            "that bias from an unmasked chunk only, so it supports such a model with plain causal masks "
            "alone (sliding_window=None)"
        )


def check_positions(model: PreTrainedModel, positions: str) -> None:
    """Refuse cache positions on a model whose RoPE frequencies depend on the sequence length."""
    if positions != "cache":
        return
    rope_types = set()
    for module in model.modules():
        kinds = getattr(module, "rope_type", None)
        if isinstance(kinds, dict):
            rope_types |= {str(v) for v in kinds.values()}
        elif kinds is not None:
            rope_types.add(str(kinds))
    length_dependent = sorted(rope_types & LENGTH_DEPENDENT_ROPE)
    if length_dependent:
        raise UnsupportedModelError(
            f"{name_of(model)} uses {length_dependent[0]} RoPE, whose frequencies change with the sequence "
            "length, so "
            "keys re-rotated to their cache rank would not match the model's own rotation; use "
            "positions=original, or a model with static RoPE scaling"
        )


class _AttentionFreeCache(DynamicCache):
    """The model's own cache (``DynamicCache`` built from its config) whose recurrent and convolutional
    layers keep their state as the model defines it, and whose attention layers store nothing: ``update``
    hands the chunk's keys and values back as given, and the bounded attention takes them into the slot
    memory, which alone holds attention entries."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return key_states, value_states


def attention_free_cache(model: PreTrainedModel) -> DynamicCache | None:
    """An empty cache of the model's own (:class:`_AttentionFreeCache`) for the engine's passes of a model
    that carries no state: with position ids and no cache, transformers reads the ids on the host to look
    for packed sequences (``find_packed_sequence_indices``), which waits for the device once per pass;
    with a cache it does not. None where transformers cannot build the model's cache from its config (the
    pass then runs without one, as the model does by default)."""
    try:
        return _AttentionFreeCache(config=model.config)
    except (ValueError, TypeError, AttributeError, KeyError):
        return None


def carried_layers(model: PreTrainedModel) -> list[int]:
    """The layers whose state the model's own cache carries from token to token (recurrent or
    convolutional mixers: ``linear_attention``, ``conv``, ``hybrid`` layer types), [] for a model of
    attention (and stateless) layers only. A model whose own cache the harness cannot carry is refused:
    one that keeps its own cache class, or cache layers other than transformers' linear-attention,
    attention and dummy layers."""
    config = model.config.get_text_config()
    kinds = set(getattr(config, "layer_types", None) or [])
    if kinds <= PLAIN_ATTENTION_LAYER_TYPES | STATELESS_LAYER_TYPES:
        return []
    mixers = ", ".join(sorted(kinds - ATTENTION_LAYER_TYPES - STATELESS_LAYER_TYPES)) or "hybrid"
    own = own_cache_class(model)
    if own is not None:
        raise UnsupportedModelError(
            f"{name_of(model)} keeps the state of its {mixers} layers in a cache class of its own "
            f"({own.__name__}), which its forward requires instead of transformers' DynamicCache; the "
            "harness carries such state only in transformers' cache layers (the model's own DynamicCache), "
            f"so this model is not supported (carrying {own.__name__}'s state per stream in "
            "integration.CarriedState, and in the reference, would extend it)"
        )
    try:
        layers = DynamicCache(config=model.config).layers
    except Exception as err:
        raise UnsupportedModelError(
            f"{name_of(model)} has layers that are not attention ({mixers}) whose state "
            f"transformers' DynamicCache cannot hold ({type(err).__name__}: {err}), so it would restart at "
            "every chunk; this model is not supported"
        ) from err
    unknown = sorted({type(layer).__name__ for layer in layers} - _known_cache_layers())
    if unknown:
        raise UnsupportedModelError(
            f"{name_of(model)} has cache layers {', '.join(unknown)}, which the harness neither carries as "
            "recurrent state nor replaces by its slot memory; this model is not supported"
        )
    return [i for i, layer in enumerate(layers) if isinstance(layer, CARRIED_CACHE_LAYERS)]


def own_cache_class(model: PreTrainedModel) -> type | None:
    """The cache class of its own that the model's forward takes instead of transformers' caches
    (MiniMax's ``MiniMaxCache``, which its forward requires), read from the ``cache`` annotations of its
    (sub)models' forward; None when they take transformers' own (``Cache``, ``DynamicCache``, ...)."""
    keyword = cache_keyword(model)
    for module in model.modules():
        if not isinstance(module, PreTrainedModel):
            continue
        parameter = inspect.signature(module.forward).parameters.get(keyword)
        annotation = None if parameter is None else parameter.annotation
        for kind in typing.get_args(annotation) or (annotation,):
            if isinstance(kind, type) and issubclass(kind, Cache) and kind.__module__ != Cache.__module__:
                return kind
    return None


def _known_cache_layers() -> set[str]:
    return {cls.__name__ for cls in CARRIED_CACHE_LAYERS + ATTENTION_CACHE_LAYERS}


class CarriedState:
    """The recurrent and convolutional state of a model's non-attention mixers for the N streams of a
    slot memory (one row each), held by the model's own cache (:class:`_AttentionFreeCache`): the engine
    passes :attr:`cache` to every forward pass, so each mixer continues from where its row's stream left
    it. Rows follow the memory's: emptied for a new stream (zero state, as at a stream's start), dropped
    and added with it. Its size never depends on the stream length."""

    def __init__(self, model: PreTrainedModel):
        self.cache = _AttentionFreeCache(config=model.config)
        self.layers = [self.cache.layers[i] for i in carried_layers(model)]

    def _states(self) -> Iterator[tuple[dict, int]]:
        """(the layer's dict of conv or recurrent states, state index) of every state already made."""
        for layer in self.layers:
            for states in (layer.conv_states, layer.recurrent_states):
                for index, tensor in states.items():
                    if tensor is not None:
                        yield states, index

    def reset_row(self, row: int) -> None:
        """Zero row ``row``'s state (a new stream starts from no state)."""
        for states, index in self._states():
            states[index][row] = 0

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` [N'] (in that order)."""
        for states, i in self._states():
            states[i] = states[i].index_select(0, index.to(states[i].device))

    def add_rows(self, count: int) -> None:
        """Append ``count`` zero rows."""
        for states, i in self._states():
            states[i] = torch.cat([states[i], states[i].new_zeros(count, *states[i].shape[1:])])

    def bytes_per_row(self) -> int:
        """Bytes of one stream's state (0 before the first pass made it)."""
        return sum(states[i][:1].numel() * states[i].element_size() for states, i in self._states())


def _check_call(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    memory: SlotMemory,
    attention_mask: object,
    kwargs: dict,
) -> int:
    """Refuse a call the bounded attention would otherwise get wrong silently or crash on; return how
    many times the layer's KV heads are tiled in ``key`` and ``value`` (:func:`_kv_tiles`)."""
    name = type(module).__name__
    unknown = sorted(k for k, v in kwargs.items() if k not in IGNORED_KWARGS and v is not None)
    if unknown:
        raise UnsupportedModelError(
            f"{name} passes {', '.join(unknown)} to its attention function, which the bounded attention "
            "does not implement; extend rmm/integration.py:bounded_attention"
        )
    bias = (
        isinstance(attention_mask, torch.Tensor)
        and key_bias_window(getattr(module, "config", None)) is not None
    )
    if attention_mask is not None and not isinstance(attention_mask, ModelMask) and not bias:
        raise UnsupportedModelError(
            f"{name} builds its own attention mask ({type(attention_mask).__name__}) instead of asking "
            "transformers' mask interface, so the bounded attention cannot tell what it hides"
        )
    layer = getattr(module, "layer_idx", None)
    n_layers = memory.keys.shape[0]
    if not isinstance(layer, int) or not 0 <= layer < n_layers:
        raise UnsupportedModelError(f"{name} has no layer index in [0, {n_layers}) (layer_idx={layer!r})")
    _check_once(name, layer, query, key, memory)
    n_kv, head_dim, value_dim = memory.layer_shapes[layer]
    if query.shape[0] != memory.keys.shape[1] or key.shape[0] != memory.keys.shape[1]:
        raise UnsupportedModelError(
            f"{name} hands attention a batch of {query.shape[0]} rows for {memory.keys.shape[1]} streams: "
            "the model reshapes its batch, which the bounded attention cannot follow"
        )
    tiles = _kv_tiles(name, layer, query, key, value, n_kv)
    dims = (query.shape[-1], key.shape[-1], value.shape[-1])
    if dims != (head_dim, head_dim, value_dim):
        raise UnsupportedModelError(
            f"{name} hands attention query/key/value head dimensions {'/'.join(map(str, dims))}, where the "
            f"config gives {head_dim}/{head_dim}/{value_dim}; this model is not supported"
        )
    return tiles


# per layer, the query and key of its last call (weak references: nothing is kept alive)
_LAST_CALL: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _check_once(name: str, layer: int, query: torch.Tensor, key: torch.Tensor, memory: SlotMemory) -> None:
    """Refuse a second call of ``layer`` within one forward pass (DiffLlama's differential attention calls
    it twice, with the same queries and keys and the two halves of its value heads)."""
    last = _LAST_CALL.get(layer)
    _LAST_CALL[layer] = weakref.ref(query), weakref.ref(key)
    if memory.calls[layer] < memory.passes:
        return
    same = last is not None and last[0]() is query and last[1]() is key
    raise UnsupportedModelError(
        f"{name} calls attention twice per layer and pass"
        + (" (same queries and keys, other values)" if same else f" (layer {layer})")
        + ": the slot memory takes a layer's keys, values and attention once per pass and holds one value "
        "per key; this model is not supported"
    )


def _kv_tiles(
    name: str, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, n_kv: int
) -> int:
    """How many times ``key`` [N, r * n_kv, Q, D] and ``value`` repeat ``layer``'s ``n_kv`` KV heads, one
    copy after the other (JetMoE repeats them once per expert a token selects: query head i attends KV
    head i mod n_kv), 1 for plain heads. Other heads (a layer's own count that neither the config nor
    the attention module's projections state: :func:`module_shapes`) are refused."""
    handed = key.shape[1]
    tiles = handed // n_kv
    tiled = handed % n_kv == 0 and query.shape[1] % handed == 0 and value.shape[1] == handed
    if tiled and tiles > 1:
        tiled = all(torch.equal(x, x[:, :n_kv].repeat(1, tiles, 1, 1)) for x in (key, value))
    if not tiled:
        raise UnsupportedModelError(
            f"{name} hands attention {handed} KV heads in layer {layer}, not the layer's {n_kv} nor copies "
            f"of them ({query.shape[1]} query heads): a head count per layer that neither the config "
            "(per_layer_config) nor the attention module's key projection states, which the slot memory's "
            "shapes come from; this model is not supported"
        )
    return tiles


def _untiled(
    tiles: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, s_aux: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(order, query, key, value, s_aux) with one copy of ``tiles`` tiled KV heads [N, n_kv, Q, D] and the
    query heads (and their sinks) reordered by :func:`tiled_head_order`; order None and all unchanged for
    plain heads."""
    if tiles == 1:
        return None, query, key, value, s_aux
    n_kv = key.shape[1] // tiles
    order = tiled_head_order(query.shape[1], tiles, n_kv).to(query.device)
    sinks = None if s_aux is None else s_aux[order]
    return order, query[:, order], key[:, :n_kv], value[:, :n_kv], sinks


def tiled_head_order(n_query: int, tiles: int, n_kv: int) -> torch.Tensor:
    """The model's query heads [n_query] grouped by the KV head they attend, when the ``n_kv`` KV heads
    are handed ``tiles`` times one copy after the other: query head i attends handed head i // g (g =
    n_query / (tiles * n_kv)), which is KV head (i // g) mod n_kv."""
    group = n_query // (tiles * n_kv)
    attended = (torch.arange(n_query) // group) % n_kv
    return torch.sort(attended, stable=True).indices
