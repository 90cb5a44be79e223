"""A slow, obviously-correct reference: token-by-token decoding with physical eviction.

For every token the model runs once, with eager attention, over a Hugging Face ``DynamicCache`` that
holds exactly the retained set R_t of each (layer, KV head). Every rule is written out here, plainly,
from the protocol (docs/semantics.md), in Python over explicit position lists and float64 sums.

**What it shares with the harness: nothing but transformers.** It imports only the standard library,
torch and transformers (the model itself, its config and ``DynamicCache``); nothing from
``rmm.engine``, ``rmm.memory``, ``rmm.integration``, ``rmm.policies``, ``rmm.future`` or ``rmm.models``.
In particular it has

- its own RoPE: inverse frequencies derived from the model config (``default``, ``linear`` and
  ``llama3`` rope types, partial rotary as in GPT-NeoX), rotations in float64 with the
  ``rotate_half`` pairing. With ``positions=original`` no rotation is done at all: every key stays
  exactly as the model rotated it at its own position. With ``positions=cache`` every retained key is
  re-rotated, every step, from the position the model produced it at to its rank in the cache;
  the query is rotated by the model at rank |R_t|;
- for a model with multi-head latent attention (DeepSeek-V2/V3, MiniCPM3), the model's own cache as it
  keeps it: one latent per token and layer, shared by all heads (so one retained set per layer), whose
  rotated key part (the cache's second tensor) is what ``positions=cache`` re-rotates; the model expands
  the retained latents into every head's keys and values itself;
- for a model with recurrent or convolutional mixers (hybrid models), the model's own cache over the
  whole stream (``DynamicCache`` from its config), whose mixers carry their state from token to token
  as the model defines it and whose attention layers hold exactly R_t (:class:`_Carried`); a layer
  whose attention is never called holds nothing;
- for a model that adds a learned bias per key and keeps per query the keys of largest bias (Doge), the
  bias each key's token was given when the model produced it (recorded then: the model computes a
  column's bias from every KV head's value there) and its own keep-window rule, the model's own selection
  switched off (:func:`_unselected`);
- its own model shape reading (and which query heads attend which KV head of its cache, from the keys
  the model hands attention: JetMoE hands its KV heads as copies one after the other), its own
  seeded hash for ``random`` (splitmix64 on Python integers),
  its own oracle reference attention (a plain full forward pass, or this decoder under ``window``
  for a windowed reference context);
- its own rules for the policies that rank keys and values (knorm, keydiff, lagkv, expected_attention):
  each key is rotated back, in float64 with this RoPE, from the position the model produced it at
  (expected_attention's queries likewise, as the model's attention call received them), and its own
  reading of each layer's output projection W_o from the model (restkv);
- its own scores: accumulated attention in float64 dictionaries, ranking by explicit sorting
  (higher score kept, ties to the more recent position, as the protocol states).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, eager_mask


class ReferenceSpec:
    """The policy, spelled out: the settings every policy has, then the policy's own parameters, which its
    rule declares with their defaults (``Rule.params``) and the rules read as attributes (``spec.rho``).
    ``budget`` None means unbounded; ``tau`` is the attention a key needs for a query to count as a use
    (lru's and the oracle's records); ``context`` is the oracle's reference window. A parameter the policy
    does not declare is refused when the spec is built, and reading one is an AttributeError."""

    def __init__(
        self,
        policy: str,
        budget: int | None = None,
        chunk: int = 1,
        positions: str = "original",
        scope: str = "head",
        allocation: str = "uniform",  # uniform | adaptive | pyramid: the budget across heads and layers
        layers: str = "all",  # all | global: the policy in global layers only (windowed layers keep theirs)
        tau: float = 0.02,
        context: int | None = None,
        **params: object,
    ) -> None:
        if policy not in RULES:
            raise ValueError(f"no reference rule for policy {policy!r}; rules: {sorted(RULES)}")
        declared = RULES[policy].params
        unknown = sorted(set(params) - set(declared))
        if unknown:
            raise TypeError(
                f"{policy} has no reference parameter {unknown}; its parameters: {sorted(declared)}"
            )
        self.policy, self.budget, self.chunk, self.positions = policy, budget, chunk, positions
        self.scope, self.allocation, self.layers, self.tau, self.context = (
            scope,
            allocation,
            layers,
            tau,
            context,
        )
        self.params = {**declared, **params}
        self.retained_log: list = []  # R_t per query t: [L][H] sorted position lists
        self.attention_log: list = []  # per query t: [L][H] {key position: attention}

    def __getattr__(self, name: str) -> object:  # only for names that are not attributes: the parameters
        params = self.__dict__.get("params", {})
        if name in params:
            return params[name]
        raise AttributeError(f"{self.__dict__.get('policy')} has no reference parameter {name!r}")

    def __repr__(self) -> str:
        common = ", ".join(f"{k}={getattr(self, k)!r}" for k in ("budget", "chunk", "positions", "scope"))
        return f"ReferenceSpec({self.policy!r}, {common}, {self.params})"


# ---- model facts and RoPE, from the config ------------------------------------------------------
def model_shape(model: PreTrainedModel) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) read from the model's (text) config: under latent attention the
    query heads, each with its own expanded key of ``qk_nope_head_dim + qk_rope_head_dim`` channels."""
    config = model.config.get_text_config()
    n_heads = config.num_attention_heads
    if latent(config):
        return config.num_hidden_layers, n_heads, config.qk_nope_head_dim + config.qk_rope_head_dim
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    return config.num_hidden_layers, n_kv, head_dim


def layer_heads(model: PreTrainedModel) -> list[int]:
    """Each layer's KV heads: the config's one number, each layer's own where the config keeps them per
    layer (``per_layer_config``: Gemma 4), or where an attention module's key projection holds another
    number of ``head_dim``-wide heads (MiMo-V2-Flash's sliding layers: twice the config's)."""
    config = model.config.get_text_config()
    if getattr(config, "is_heterogeneous", False):
        layers = config.per_layer_config
        return [getattr(c, "num_key_value_heads", None) or c.num_attention_heads for c in layers]
    heads = [model_shape(model)[1]] * config.num_hidden_layers
    for module in [] if latent(config) else model.modules():
        layer, width = getattr(module, "layer_idx", None), getattr(module, "head_dim", None)
        projection = getattr(module, "k_proj", None)
        if isinstance(projection, torch.nn.Linear) and isinstance(layer, int) and isinstance(width, int):
            if projection.out_features % width == 0:
                heads[layer] = projection.out_features // width
    return heads


def layer_sources(model: PreTrainedModel) -> list[int]:
    """Per layer, the layer whose cache it attends: itself, or under KV sharing (``kv_sharing_modes``
    "reuse", the last ``num_kv_shared_layers``) the earlier layer of its own type marked "store", whose
    keys the model hands it."""
    config = model.config.get_text_config()
    n_layers = config.num_hidden_layers
    modes = getattr(config, "kv_sharing_modes", None) if getattr(config, "num_kv_shared_layers", 0) else None
    if not modes:
        return list(range(n_layers))
    kinds = config.layer_types
    return [
        layer
        if mode != "reuse"
        else next(i for i in range(layer) if modes[i] == "store" and kinds[i] == kinds[layer])
        for layer, mode in enumerate(modes)
    ]


def latent(config) -> bool:
    """Whether a (text) config describes multi-head latent attention: its own cache keeps a latent
    (``kv_lora_rank`` channels) and a rotated key part per token and layer, shared by every head."""
    return bool(getattr(config, "kv_lora_rank", None)) and bool(getattr(config, "qk_nope_head_dim", None))


def layer_frequencies(config, rotary_dim: bool = True) -> list[list[float]]:
    """Each layer's inverse frequencies: :func:`rope_frequencies` of its layer type where the config
    keeps rope parameters per layer type (Gemma 3), else the same for every layer."""
    layer_types = getattr(config, "layer_types", None) or []
    params = getattr(config, "rope_parameters", None) or {}
    if layer_types and all(kind in params for kind in layer_types):
        if getattr(config, "is_heterogeneous", False):  # each layer's own head dimension
            configs = [config.per_layer_config[i] for i in range(len(layer_types))]
            return [
                rope_frequencies(c, kind, rotary_dim) for c, kind in zip(configs, layer_types, strict=True)
            ]
        return [rope_frequencies(config, kind, rotary_dim) for kind in layer_types]
    return [rope_frequencies(config, rotary_dim=rotary_dim)] * config.num_hidden_layers


class _ModelMask:
    """The model's own mask function for a layer type, handed unevaluated to :func:`_ragged_attention`
    (transformers' ``AttentionMaskInterface`` for the reference's attention)."""

    def __init__(self, mask_function: Callable):
        self.mask_function = mask_function


def _model_mask(
    *, mask_function: Callable = causal_mask_function, config=None, **kwargs
) -> _ModelMask | None:
    """The model's mask function, unevaluated; no mask for a model that adds a bias per key onto its mask
    and keeps per query the keys of largest bias (``keep_window_size``), so that what it hands attention is
    that bias alone (:func:`_ragged_attention` masks)."""
    if getattr(config, "keep_window_size", None):
        if mask_function is not causal_mask_function:
            raise ValueError("the reference reads a bias per key on plain causal masks only")
        return None
    return _ModelMask(mask_function)


def sees(layer: int, query: int, keys: list[int]) -> list[bool]:
    """Whether ``layer``, as the model masks it (its mask function in the last pass, evaluated at
    original positions: causal, sliding window, attention chunks), lets ``query`` attend each of
    ``keys`` (all <= query)."""
    mask_function = _MASKS.get(layer, causal_mask_function)
    if mask_function is causal_mask_function or not keys:
        return [True] * len(keys)
    visible = mask_function(0, 0, torch.tensor([query])[:, None], torch.tensor(keys)[None, :])
    return torch.as_tensor(visible).reshape(-1).tolist()


def windowed(layer: int) -> bool:
    """Whether the model masks ``layer`` beyond causality (a sliding or chunked window)."""
    return _MASKS.get(layer, causal_mask_function) is not causal_mask_function


def rope_frequencies(config, layer_type: str | None = None, rotary_dim: bool = True) -> list[float]:
    """Inverse frequencies (float64) of the rotated pairs, from the config's rope parameters (those of
    ``layer_type`` where the config keeps them per layer type); without ``rotary_dim``, the config's
    ``rotary_dim`` is not read (a model whose rotary module ignores it: MiniMax-M3).

    Supports the rope types of the shipped models: ``default``, ``linear`` and ``llama3``, with partial
    rotary (``partial_rotary_factor``, GPT-NeoX's ``rotary_pct``, GPT-J's and CodeGen's ``rotary_dim``),
    and Gemma 4's ``proportional``: the first ``partial_rotary_factor`` of the pairs at the frequencies of
    the whole head dimension, the others not rotated (frequency 0).
    """
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if layer_type is not None:
        if params[layer_type] is None:  # a layer type without rotary positions (Beam's NoPE full layers)
            return []
        params = dict(params[layer_type])
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    partial = params.get(
        "partial_rotary_factor",
        getattr(config, "partial_rotary_factor", None) or getattr(config, "rotary_pct", None) or 1.0,
    )
    n_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    if latent(config):  # the rotated part of a latent-attention key
        head_dim = config.qk_rope_head_dim
    dim = (getattr(config, "rotary_dim", None) if rotary_dim else None) or int(head_dim * partial)
    inv_freq = [1.0 / theta ** (i / dim) for i in range(0, dim, 2)]  # an odd dim rotates ceil(dim / 2) pairs
    if rope_type == "proportional":
        angles = int(partial * head_dim // 2)
        rotated = [1.0 / theta ** (2 * i / head_dim) / params.get("factor", 1.0) for i in range(angles)]
        return rotated + [0.0] * (head_dim // 2 - angles)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return [f / params["factor"] for f in inv_freq]
    if rope_type == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_context = params["original_max_position_embeddings"]
        scaled = []
        for f in inv_freq:
            wavelen = 2 * math.pi / f
            if wavelen < old_context / high:  # high frequencies: unchanged
                scaled.append(f)
            elif wavelen > old_context / low:  # low frequencies: interpolated by the factor
                scaled.append(f / factor)
            else:  # in between: a smooth mix of the two
                smooth = (old_context / wavelen - low) / (high - low)
                scaled.append((1 - smooth) * f / factor + smooth * f)
        return scaled
    raise ValueError(f"the reference has no RoPE rule for rope_type {rope_type!r}")


def rope_rotate(
    x: torch.Tensor, shift: list[float], inv_freq: list[float], pairing: str = "half"
) -> torch.Tensor:
    """Rotate ``x`` [P, head_dim] by ``shift[p]`` positions per row. ``pairing``: ``half`` (channels i and
    i + d/2), ``interleaved`` (2i and 2i + 1) or ``none`` (a layer without positions: unchanged)."""
    if pairing == "none":
        return x
    half = len(inv_freq)
    out = x.double().clone()
    angles = torch.tensor(shift, dtype=torch.float64)[:, None] * torch.tensor(inv_freq, dtype=torch.float64)
    cos, sin = angles.cos(), angles.sin()
    if pairing == "interleaved":
        first, second = x.double()[:, 0 : 2 * half : 2], x.double()[:, 1 : 2 * half : 2]
        out[:, 0 : 2 * half : 2] = first * cos - second * sin
        out[:, 1 : 2 * half : 2] = second * cos + first * sin
        return out.to(x.dtype)
    first, second = x.double()[:, :half], x.double()[:, half : 2 * half]
    out[:, :half] = first * cos - second * sin
    out[:, half : 2 * half] = second * cos + first * sin
    return out.to(x.dtype)


PAIRINGS = ("half", "interleaved", "none")
PAIRING_SHIFT, PAIRING_TOLERANCE = 37, 1e-3


@torch.no_grad()
def layer_rotations(model: PreTrainedModel) -> list[tuple[list[float], str]]:
    """Each layer's RoPE: its frequencies from the config (:func:`layer_frequencies`) and the pairing
    under which they rotate the keys the model produced for 8 tokens at positions 0..7 into those it
    produces for them at 37..44 (``half`` first; ``none`` for a layer the model does not rotate); under
    latent attention, of the cache's rotated key part (its second tensor).
    Raises ValueError when no pairing does: the reference has no RoPE rule for the layer."""
    config = model.config.get_text_config()
    readings = [layer_frequencies(config)]  # the config read both ways where it states a rotary_dim
    if getattr(config, "rotary_dim", None):
        readings.append(layer_frequencies(config, rotary_dim=False))
    rotated = 1 if latent(config) else 0  # which of the cache's two tensors the model rotates
    tokens = torch.arange(1, 9)[None] % config.vocab_size
    produced = []
    for shift in (0, PAIRING_SHIFT):
        cache = _Carried(model) if _has_mixers(model) else DynamicCache()
        model(tokens, position_ids=torch.arange(8)[None] + shift, cache=cache, use_cache=True)
        if isinstance(cache, _Carried):
            produced.append({layer: pair[rotated][0] for layer, pair in cache.produced.items()})
        else:
            pairs = [(cached.keys, cached.values) for cached in cache.layers]
            produced.append({layer: pair[rotated][0] for layer, pair in enumerate(pairs)})
    rotations = []
    for layer in range(config.num_hidden_layers):
        if layer not in produced[0]:  # a recurrent or convolutional mixer: no keys, nothing to rotate
            rotations.append((readings[0][layer], "none"))
            continue
        before, after = produced[0][layer].double(), produced[1][layer].double()
        for inv_freq, pairing in ((r[layer], p) for r in readings for p in PAIRINGS):
            shift = [PAIRING_SHIFT] * 8
            moved = torch.stack([rope_rotate(head, shift, inv_freq, pairing) for head in before])
            if float((moved - after).norm() / after.norm()) <= PAIRING_TOLERANCE:
                rotations.append((inv_freq, pairing))
                break
        else:
            raise ValueError(
                f"the reference has no RoPE rule for layer {layer} of {model.config.model_type}: its keys do "
                "not rotate with the config's frequencies under any pairing"
            )
    return rotations


def splitmix_uniform(seed: int, layer: int, head: int, position: int) -> float:
    """The seeded priority of ``random`` in [0, 1): splitmix64 of (seed, layer, head, position)."""
    mask64 = (1 << 64) - 1
    x = (((seed * 1_000_003 + layer) * 1_000_003 + head) * 1_000_003 + position) & mask64
    x = (x + 0x1E3779B97F4A7C15) & mask64
    x = ((x ^ (x >> 30)) * 0x3F58476D1CE4E5B9) & mask64
    x = ((x ^ (x >> 27)) * 0x14D049BB133111EB) & mask64
    x = x ^ (x >> 31)
    return ((x >> 11) & ((1 << 52) - 1)) / float(1 << 52)


# ---- the oracle's reference attention -----------------------------------------------------------
@torch.no_grad()
def reference_attention(model: PreTrainedModel, tokens: torch.Tensor, context: int | None = None):
    """Reference attention a*_s(j), GQA group summed: float64 [L, H, n, n] (query s, key j)."""
    return reference_pass(model, tokens, context)[0]


@torch.no_grad()
def reference_pass(model: PreTrainedModel, tokens: torch.Tensor, context: int | None = None):
    """(a*, w*): the reference attention float64 [L, H, n, n] (query s, key j) and the pass's own query
    weights {"correct", "prob", "uniform"} -> float64 [n] (0 for the last query's correct and prob).

    Full causal attention (one forward pass through the model's own eager attention,
    :func:`_eager_weights`), or with ``context`` = W, attention over the W previous positions: this decoder
    under ``window`` with budget W.
    """
    heads = layer_heads(model)
    n_layers, n_kv = len(heads), max(heads)
    n = tokens.numel()
    if context is None or context >= n - 1:
        previous = model.config._attn_implementation
        AttentionInterface.register(EAGER_WEIGHTS, _eager_weights)
        AttentionMaskInterface.register(EAGER_WEIGHTS, eager_mask)
        model.set_attn_implementation(EAGER_WEIGHTS)
        try:
            out = model(tokens[None], output_attentions=True, use_cache=False)
        finally:
            model.set_attn_implementation(previous)
        attention = torch.zeros(n_layers, n_kv, n, n, dtype=torch.float64)  # a layer's own heads first
        sources = layer_sources(model)  # a layer reading another's cache: its attention is that layer's
        for layer, a in enumerate(out.attentions):
            attention[sources[layer], : heads[layer]] += a[0].double().view(heads[layer], -1, n, n).sum(1)
        log_probs = torch.log_softmax(out.logits[0, :-1].float(), dim=-1)
        nll = -log_probs.gather(-1, tokens[1:, None])[:, 0]
        correct = log_probs.argmax(dim=-1) == tokens[1:]
    else:
        spec = ReferenceSpec(policy="window", budget=context)
        nll, correct = reference_stream(model, tokens, spec, record_attention=True)
        attention = torch.zeros(n_layers, n_kv, n, n, dtype=torch.float64)
        for s, per_layer in enumerate(spec.attention_log):
            for layer in range(n_layers):
                for h in range(heads[layer]):
                    for j, a in per_layer[layer][h].items():
                        attention[layer, h, s, j] = a
    no_target = torch.zeros(1, dtype=torch.float64)
    weights = {
        "correct": torch.cat([correct.double(), no_target]),
        "prob": torch.cat([torch.exp(-nll.double()), no_target]),
        "uniform": torch.ones(n, dtype=torch.float64),
    }
    return attention, weights


# ---- the decoder --------------------------------------------------------------------------------
@torch.no_grad()
def reference_stream(
    model: PreTrainedModel, tokens: torch.Tensor, spec: ReferenceSpec, record_attention: bool = False
):
    """Returns (nll [n-1], correct [n-1]) decoding ``tokens`` [n] one at a time under ``spec``.

    Fills ``spec.retained_log`` (R_t for every query t) and, with ``record_attention``,
    ``spec.attention_log``. The model's attention implementation is restored afterwards.
    """
    previous = model.config._attn_implementation
    config = model.config.get_text_config()
    # image tokens attend bidirectionally within their image ("vision": Gemma 4 unified): a stream of token
    # ids has none, so the model's masks are its causal ones, built without the per-pass image-block ids
    vision = getattr(config, "use_bidirectional_attention", None) == "vision"
    if vision:
        config.use_bidirectional_attention = None
    try:
        return _reference_stream(model, tokens, spec, record_attention)
    finally:
        model.set_attn_implementation(previous)
        if vision:
            config.use_bidirectional_attention = "vision"


def _reference_stream(
    model: PreTrainedModel, tokens: torch.Tensor, spec: ReferenceSpec, record_attention: bool
):
    if spec.policy not in RULES:
        raise ValueError(f"reference has no rule for policy {spec.policy!r}")
    rule = RULES[spec.policy]
    n = tokens.numel()
    heads = layer_heads(model)  # each layer's KV heads
    n_layers = len(heads)
    sources = layer_sources(model)  # KV sharing: the layer whose cache each layer attends
    shared = latent(model.config.get_text_config())  # one cache entry per token and layer, for every head
    if shared and (rule.reads_keys or rule.reads_values):
        raise ValueError(
            f"the reference holds a latent-attention model's own cache (one latent per token and layer), "
            f"not the per-head keys and values that {spec.policy} reads"
        )
    inv_freq = layer_rotations(model) if spec.positions == "cache" or rule.reads_keys else []
    if spec.allocation != "uniform" and spec.positions != "original":
        raise ValueError("the reference's non-uniform allocations need original positions")
    # the model's own eager attention over the physical cache, masked at original positions
    AttentionInterface.register(RAGGED_ATTENTION, _ragged_attention)
    AttentionMaskInterface.register(RAGGED_ATTENTION, _model_mask)
    model.set_attn_implementation(RAGGED_ATTENTION)
    _MASKS.clear()
    _BIAS.clear()
    retained = [[[] for _ in range(h)] for h in heads]  # R_t, sorted position lists

    def per_head() -> list:
        return [[{} for _ in range(h)] for h in heads]

    # what the rules read: the record of the stream so far
    record = {
        "model": model,
        "tokens": tokens,
        "rows": [],  # per query t: [L][H] {j: a_t(j)}, GQA group summed
        "weights": [],  # per query t: {"correct", "prob", "uniform"}
        "count": per_head(),  # j -> queries that saw j
        "last_use": per_head(),  # j -> last s with a_s(j) >= tau (or j itself)
        "attention_sum": per_head(),  # j -> sum of a_s(j) over the queries that saw j
        "utility": per_head(),  # rmm: j -> its accumulated utility
        "auto": per_head(),  # rmm lag=auto: its arms' shadows and losses, and h2o's statistic
        "partitions": per_head(),  # lagkv: a partition's first position -> its scores (computed once)
        "unrotated": {"keys": per_head(), "values": per_head()},  # j -> its key or value in float64 lists
        "keys": per_head(),  # j -> key j as the model produced it (at made_at[j])
        "values": per_head(),
        "made_at": {},  # j -> the position key j was rotated at by the model
        "inv_freq": inv_freq,  # per layer: (frequencies, pairing)
        # layers=global: a windowed layer keeps every entry its own window shows, the policy decides elsewhere
        "exempt": [False] * n_layers,
        "future": reference_pass(model, tokens, spec.context) if rule.reads_future else None,
    }
    keys, values, made_at = record["keys"], record["values"], record["made_at"]
    nll, correct = torch.zeros(n - 1), torch.zeros(n - 1, dtype=torch.bool)
    carried = _Carried(model) if _has_mixers(model) else None
    if carried is not None and (rule.reads_future or getattr(spec, "weight", None) == "gradient"):
        raise ValueError("the reference carries a hybrid model's state through one stream, not a look-ahead")
    with _unselected(model):  # the model selects no keys itself: the rule does
        for t in range(n):
            spec.retained_log.append([[list(r) for r in layer] for layer in retained])
            m = max(len(kept) for per_head in retained for kept in per_head)
            query_pos = t if spec.positions == "original" else m
            cache = _cache(
                retained, keys, values, made_at, spec.positions, inv_freq, [t], carried, shared, sources
            )
            out = model(
                tokens[None, t : t + 1],
                position_ids=torch.tensor([[query_pos]]),
                cache=cache,
                use_cache=True,
                output_attentions=True,
            )
            made_at[t] = query_pos
            if carried is None:
                produced = {layer: (c.keys, c.values) for layer, c in enumerate(out.past_key_values.layers)}
            else:
                produced = carried.produced
            holding = [layer for layer in sorted(produced) if sources[layer] == layer]
            # the layers whose attention ran: every layer but a mixer's, those reading another's cache too
            attending = sorted(holding + [layer for layer, source in enumerate(sources) if source != layer])
            if len(out.attentions) != len(attending):
                raise ValueError(
                    f"{len(out.attentions)} attention maps for the {len(attending)} layers that attended"
                )
            for layer in holding:
                for h in range(heads[layer]):
                    entry = 0 if shared else h  # a latent is every head's
                    keys[layer][h][t] = produced[layer][0][0, entry, -1].clone()
                    values[layer][h][t] = produced[layer][1][0, entry, -1].clone()
            log_probs = torch.log_softmax(out.logits[0, -1].double(), -1)
            if t + 1 < n:
                nll[t] = -log_probs[tokens[t + 1]]
                correct[t] = int(log_probs.argmax()) == int(tokens[t + 1])
                weight = {"correct": float(correct[t]), "prob": math.exp(log_probs[tokens[t + 1]].item())}
            else:  # the document's last query has no target
                weight = {"correct": 0.0, "prob": 0.0}
            record["weights"].append(weight | {"uniform": 1.0})
            # a mixer sees nothing; a layer reading another's cache adds its attention to that layer's
            step_attention = per_head()
            for layer, maps in zip(attending, out.attentions, strict=True):
                probs = maps[0, _PASS["order", layer], 0].double()  # [n_heads, m + 1], by KV head
                group = probs.shape[0] // heads[layer]
                held = retained[sources[layer]]
                for h in range(heads[layer]):
                    summed = probs[h * group : (h + 1) * group].sum(0).tolist()  # GQA group summed
                    summed = summed[: len(held[h])] + summed[-1:]  # without a ragged head's padding
                    seen = dict(zip(held[h] + [t], summed, strict=True))
                    shown = sees(layer, t, list(seen))  # the layer's own window
                    row = step_attention[sources[layer]][h]
                    for (j, a), visible in zip(seen.items(), shown, strict=True):
                        if visible:
                            row[j] = row.get(j, 0.0) + a
            for layer in holding:
                for h, seen in enumerate(step_attention[layer]):
                    count, last_use = record["count"][layer][h], record["last_use"][layer][h]
                    attention_sum = record["attention_sum"][layer][h]
                    for j, a in seen.items():
                        count[j] = count.get(j, 0) + 1
                        if a >= spec.tau or j == t:
                            last_use[j] = t
                        attention_sum[j] = attention_sum.get(j, 0.0) + a
            record["rows"].append(step_attention)
            if record_attention:
                spec.attention_log.append(step_attention)
            for layer in holding:
                for h in range(heads[layer]):
                    retained[layer][h].append(t)
            now = t + 1
            if now == n:
                break
            if rule.observe is not None:
                rule.observe(spec, record, t)
            record["exempt"] = [spec.layers == "global" and windowed(layer) for layer in range(n_layers)]
            for layer in range(n_layers):
                # a score rule never keeps what the layer's window hides from now on; nor does an exempt layer
                if rule.visible is None or record["exempt"][layer]:
                    for h in range(heads[layer]):
                        kept = retained[layer][h]
                        shown = sees(layer, now, kept)
                        retained[layer][h] = [j for j, visible in zip(kept, shown, strict=True) if visible]
            if rule.visible is not None:
                for layer in range(n_layers):
                    if record["exempt"][layer]:
                        continue
                    for h in range(heads[layer]):
                        retained[layer][h] = [j for j in retained[layer][h] if rule.visible(spec, now, j)]
            elif now % spec.chunk == 0:
                _decide(spec, retained, now, record)
    return nll, correct


def _cache(
    retained: list,
    keys: list,
    values: list,
    made_at: dict,
    positions: str,
    inv_freq: list,
    queries: list[int],
    carried: _Carried | None = None,
    shared: bool = False,
    sources: list[int] | None = None,
):
    """A ``DynamicCache`` holding exactly R (per layer and KV head), None when R is empty, for a pass of
    the queries ``queries`` (original positions). With cache positions every key moves from the position
    the model produced it at to its rank: the query is at m, the largest |R| of any head, and key j at
    m minus the number of entries its head holds at or after j (the usual rank when all heads hold m).
    ``shared`` (latent attention): the cache holds each layer's one set of latents, for all its heads
    (ValueError if their sets differ), and the rotated key part, its second tensor, is what moves.

    Heads holding different numbers of entries (a non-uniform allocation, a windowed layer) are padded
    with zero keys and values to the longest; :data:`_PASS` tells :func:`_ragged_attention` which
    position each column holds (None: padding) for the pass's queries. ``carried`` (a hybrid model's own
    cache over the stream) is returned instead, holding R for the pass, and layers that never attended
    (no key) hold nothing.
    """
    longest = _set_pass(retained, queries, sources)
    if carried is not None:
        carried.held.clear()
        carried.produced.clear()
    if not longest:
        return carried
    cache = DynamicCache() if carried is None else carried
    for layer, per_head in enumerate(retained):
        if not keys[layer][0]:  # a layer whose attention never ran (a recurrent or convolutional mixer)
            continue
        rotation = inv_freq[layer] if positions == "cache" else None
        held = _layer_entries(layer, per_head, keys[layer], values[layer], made_at, rotation, longest, shared)
        if carried is None:
            cache.update(*held, layer)
        else:
            carried.held[layer] = held
    return cache


def _set_pass(retained: list, queries: list[int], sources: list[int] | None = None) -> int:
    """Record in :data:`_PASS` the pass's queries and, per layer and head, the position each column holds
    (R, None for padding, then the queries; a layer reading another's cache, ``sources``, that layer's);
    the largest |R| of any head."""
    _PASS.clear()
    _PASS["queries"] = queries
    longest = max(len(kept) for per_head in retained for kept in per_head)
    for layer, per_head in enumerate(retained):
        _PASS[layer] = [kept + [None] * (longest - len(kept)) + queries for kept in per_head]
    for layer, source in enumerate(sources or []):
        _PASS[layer] = _PASS[source]
    return longest


def _layer_entries(
    layer: int,
    per_head: list[list[int]],
    keys: list,
    values: list,
    made_at: dict,
    rotation: tuple | None,
    longest: int,
    shared: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's retained keys and values, [1, H, longest, D] each (one head when ``shared``), each head
    zero-padded to ``longest``; with a ``rotation`` (cache positions) key j moves to its rank, the rotated
    key part of latents (their second tensor) when ``shared``."""
    if shared and any(kept != per_head[0] for kept in per_head):
        raise ValueError(
            f"layer {layer}: a latent-attention cache holds one set for all heads, but the heads' "
            "retained sets differ (scope=head)"
        )
    layer_keys, layer_values = [], []
    for h, kept in enumerate(per_head[:1] if shared else per_head):
        pad = longest - len(kept)
        head_keys = _stacked(keys[h], kept, pad)
        head_values = _stacked(values[h], kept, pad)
        if rotation is not None and kept:  # key j moves to its rank
            ranks = [longest - (len(kept) - i) for i in range(len(kept))]
            shift = [r - made_at[j] for r, j in zip(ranks, kept, strict=True)] + [0.0] * pad
            if shared:
                head_values = rope_rotate(head_values, shift, *rotation)
            else:
                head_keys = rope_rotate(head_keys, shift, *rotation)
        layer_keys.append(head_keys)
        layer_values.append(head_values)
    return torch.stack(layer_keys)[None], torch.stack(layer_values)[None]


def _stacked(entries: dict, kept: list[int], pad: int) -> torch.Tensor:
    """The vectors ``entries[j]`` of the positions ``kept``, then ``pad`` zeros: [len(kept) + pad, D]."""
    zero = torch.zeros_like(next(iter(entries.values())))
    return torch.stack([entries[j] for j in kept] + [zero] * pad)


def _has_mixers(model: PreTrainedModel) -> bool:
    """Whether the model's own cache holds state beside attention entries (conv or recurrent states)."""
    return any(hasattr(layer, "conv_states") for layer in DynamicCache(config=model.config).layers)


class _Carried(DynamicCache):
    """A hybrid model's own cache over one stream: its recurrent and convolutional layers carry their
    state from token to token as the model defines it; its attention layers hold exactly R. Each pass
    sets ``held`` (layer -> keys, values [1, H, m, D]); ``update`` returns them followed by the pass's own
    keys and values, which it records in ``produced`` (layer -> keys, values [1, H, Q, D])."""

    def __init__(self, model: PreTrainedModel):
        super().__init__(config=model.config)
        self.held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.produced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.produced[layer_idx] = key_states, value_states
        if layer_idx not in self.held:
            return key_states, value_states
        keys, values = self.held[layer_idx]
        return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)


# the pass being run: "queries" -> the queries' original positions; layer -> per KV head the position
# each key column holds (None: a shorter head's padding), the pass's own keys last; ("query", layer) ->
# the query heads' vectors [n_heads, Q, head_dim] as the model rotated them (expected_attention reads them),
# grouped by the KV head they attend as ("order", layer) orders the model's query heads
_PASS: dict = {}
# layer -> the model's mask function in the last pass (causal, sliding window, attention chunks)
_MASKS: dict[int, Callable] = {}
# (layer, query head, position) -> the bias per key the model gave that token's key when it produced it
_BIAS: dict[tuple[int, int, int], float] = {}
RAGGED_ATTENTION = "rmm_reference_ragged"


def _ragged_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """The model's own eager attention over the physical cache, masked per KV head at original positions
    (:data:`_PASS`): a shorter head's padding, the future, and what the layer's own mask function hides;
    its weights as :func:`_eager_weights` gives them."""
    layer = module.layer_idx
    if isinstance(attention_mask, _ModelMask):
        _MASKS[layer] = attention_mask.mask_function
    queries, columns = _PASS["queries"], _PASS[layer]
    attended = _attended_heads(query, key, len(columns))
    _PASS["order", layer] = torch.sort(attended, stable=True).indices
    _PASS["query", layer] = query[0, _PASS["order", layer]].detach()
    blocked = []  # per KV head, query and column: padding, the future, or hidden by the layer's window
    for head in columns:
        positions = [-1 if j is None else j for j in head]
        blocked.append(
            [
                [
                    j < 0 or j > s or not shown
                    for j, shown in zip(positions, sees(layer, s, positions), strict=True)
                ]
                for s in queries
            ]
        )
    bias = attention_mask if isinstance(attention_mask, torch.Tensor) else None
    attention_mask = torch.zeros(len(columns), len(queries), len(columns[0]), dtype=query.dtype)
    attention_mask = attention_mask.masked_fill(torch.tensor(blocked), -math.inf)
    attention_mask = attention_mask[attended][None]  # per query head, its KV head's
    if bias is not None:  # the model's bias per key, each key's as its token produced it; its keep window
        bias = _produced_bias(layer, bias, columns, attended, queries)
        attention_mask = _keep_window(attention_mask + bias, bias, columns, attended, queries, module)
    return _eager_weights(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


EAGER_WEIGHTS = "rmm_reference_eager"


def _eager_weights(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """The model's own eager attention, whose weights are the probabilities the output uses: with learned
    sinks (``s_aux``, one more logit per head in the softmax's denominator) a model whose eager function
    returns weights that leave the sink out (summing to 1, the output scaled afterwards) has them scaled by
    the keys' share (:func:`_with_sinks`)."""
    # read from the model's own module: a decorated __init__, as the ``kernels`` package makes, has other
    # globals
    eager = sys.modules[type(module).__module__].eager_attention_forward
    out, weights = eager(
        module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
    )
    sinks = kwargs.get("s_aux")
    if sinks is not None and weights is not None:
        weights = _with_sinks(weights, query, key, attention_mask, scaling, sinks)
    return out, weights


def _with_sinks(weights, query, key, attention_mask, scaling, sinks):
    """Attention weights [1, heads, Q, S] as probabilities beside learned sinks [heads]: weights that leave
    the sink out (each row sums to 1) scaled by the keys' share of the softmax's denominator."""
    total = weights.double().sum(dim=-1, keepdim=True)
    if not torch.allclose(total, torch.ones_like(total), atol=1e-5):
        return weights  # the model's eager function counted the sink already
    keys = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    logits = torch.matmul(query.double(), keys.double().transpose(-1, -2)) * scaling
    if attention_mask is not None:
        logits = logits + attention_mask[..., : keys.shape[-2]].double()
    lse = torch.logsumexp(logits, -1, keepdim=True)
    share = torch.sigmoid(lse - sinks.double().view(1, -1, 1, 1))
    return (weights.double() * share).to(weights.dtype)


def _produced_bias(layer, bias, columns, attended, queries):
    """The model's bias per key [1, n_heads, Q, K] with every column holding the bias its key's token was
    given when it was produced (recorded in :data:`_BIAS` from the pass's own columns, the last Q): the model
    computes a key's bias from all KV heads' values at its column, which heads holding other positions
    (``scope=head``) would mix."""
    out = torch.zeros_like(bias)
    for head, kv in enumerate(attended.tolist()):
        positions = columns[kv]
        for c, j in enumerate(positions[-len(queries) :], start=len(positions) - len(queries)):
            _BIAS[layer, head, j] = bias[0, head, 0, c].item()
        for c, j in enumerate(positions):
            if j is not None:
                out[0, head, :, c] = _BIAS[layer, head, j]
    return out


def _keep_window(mask, bias, columns, attended, queries, module):
    """``mask`` [1, n_heads, Q, K] (the bias added) with, for each query head and query, the columns it sees
    beyond the ``keep_window_size`` of largest ``bias`` set to -inf, ties to the more recent position."""
    window = module.config.keep_window_size
    mask = mask.clone()
    for head, kv in enumerate(attended.tolist()):
        positions = columns[kv]
        for q in range(len(queries)):
            seen = [c for c, j in enumerate(positions) if j is not None and mask[0, head, q, c] > -math.inf]
            ranked = sorted(seen, key=lambda c: (float(bias[0, head, q, c]), positions[c]), reverse=True)
            for c in ranked[window:]:
                mask[0, head, q, c] = -math.inf
    return mask


@contextlib.contextmanager
def _unselected(model: PreTrainedModel):
    """``with _unselected(model):`` a model that keeps per query the keys of largest bias
    (``keep_window_size``) hands attention every key's bias, selecting none itself (its attention modules'
    ``keep_window_size`` raised for the block): :func:`_keep_window` selects, by the rule."""
    modules = [m for m in model.modules() if hasattr(m, "keep_window_size")]
    saved = [m.keep_window_size for m in modules]
    for m in modules:
        m.keep_window_size = sys.maxsize
    try:
        yield
    finally:
        for m, window in zip(modules, saved, strict=True):
            m.keep_window_size = window


def _attended_heads(query: torch.Tensor, key: torch.Tensor, n_kv: int) -> torch.Tensor:
    """Per query head of ``query`` [1, n_heads, Q, D], the cache's KV head (of ``n_kv``) it attends. The
    model's eager attention repeats each handed key head for n_heads / handed query heads in a row; the
    handed heads are the cache's, or copies of them one after the other (JetMoE: handed head c is the
    cache's c mod n_kv)."""
    handed = key.shape[1]
    attended = torch.arange(query.shape[1]) // (query.shape[1] // handed)
    if handed == n_kv:
        return attended
    tiles = handed // n_kv
    if handed % n_kv or not torch.equal(key, key[:, :n_kv].repeat(1, tiles, 1, 1)):
        raise ValueError(f"the model hands attention {handed} KV heads, not copies of its cache's {n_kv}")
    return attended % n_kv


def gradient_utility(
    model: PreTrainedModel,
    tokens: torch.Tensor,
    start: int,
    stop: int,
    retained: list,
    keys: list,
    values: list,
    made_at: dict,
    spec: ReferenceSpec,
    rotations: list | None = None,
) -> list:
    """rmm's gradient utility of the chunk [start, stop): [L][H] {query s: {key j: u_s(j)}}.

    One forward pass of the chunk's tokens, with eager attention, over a cache holding exactly the chunk's
    retained set ``retained`` ([L][H] position lists); l is the sum of the chunk's NLLs (queries with a
    target). Autograd through the model's own attention probabilities a gives dl/da, and the logit
    derivative dl/dz = a * (dl/da - sum_j a dl/da); u_s(j) = -dl/dz_{s,j}, summed over the query heads of
    each KV head's group in float64. At chunk 1 this is the single query's own loss. ``rotations``: each
    layer's (frequencies, pairing) under cache positions (:func:`layer_rotations`; found when not given).
    """
    n_layers, n_kv, _ = model_shape(model)
    inv_freq = (rotations or layer_rotations(model)) if spec.positions == "cache" else []
    m = max(len(kept) for per_head in retained for kept in per_head)
    first = start if spec.positions == "original" else m
    shared = latent(model.config.get_text_config())
    queries = list(range(start, stop))
    cache = _cache(retained, keys, values, made_at, spec.positions, inv_freq, queries, shared=shared)
    scored = range(start, min(stop, tokens.numel() - 1))
    utilities = [[{s: {} for s in range(start, stop)} for _ in range(n_kv)] for _ in range(n_layers)]
    if not scored:
        return utilities
    embeddings = model.get_input_embeddings()(tokens[None, start:stop]).detach().requires_grad_(True)
    with torch.enable_grad():
        out = model(
            inputs_embeds=embeddings,
            position_ids=torch.arange(first, first + stop - start)[None],
            cache=cache,
            use_cache=True,
            output_attentions=True,
        )
        log_probs = torch.log_softmax(out.logits[0].double(), -1)
        loss = -sum(log_probs[s - start, tokens[s + 1]] for s in scored)
        grads = torch.autograd.grad(loss, list(out.attentions))
    for layer in range(n_layers):
        order = _PASS.get(("order", layer), slice(None))  # the query heads by KV head
        a, da = out.attentions[layer][0, order].detach().double(), grads[layer][0, order].double()
        _store_utilities(utilities[layer], a, da, retained[layer], m, queries)
    return utilities


def _store_utilities(
    per_head: list[dict],
    a: torch.Tensor,
    da: torch.Tensor,
    kept: list[list[int]],
    longest: int,
    queries: list[int],
) -> None:
    """One layer's u_s(j) = -dl/dz_{s,j} into ``per_head`` ([H] {query s: {key j: u_s(j)}}), from its
    attention probabilities ``a`` and dl/da ``da`` ([n_heads, Q, longest + Q], query heads by KV head,
    float64), summed over each KV head's group; ``kept``: each head's retained positions."""
    utility = -a * (da - (a * da).sum(-1, keepdim=True))
    group = a.shape[0] // len(per_head)
    for h, utilities in enumerate(per_head):
        summed = utility[h * group : (h + 1) * group].sum(0)  # [Q, longest + Q]
        padding = [math.inf] * (longest - len(kept[h]))  # a shorter head's padded slots
        columns = kept[h] + padding + queries
        for i, s in enumerate(queries):
            utilities[s] = {j: float(summed[i, c]) for c, j in enumerate(columns) if j <= s}


# ---- decisions at a boundary ----------------------------------------------------------------------
def _decide(spec: ReferenceSpec, retained: list, now: int, record: dict) -> None:
    """At boundary ``now``: keep B' = B - C + 1 of the candidates (R plus the chunk), in place; under a
    non-uniform ``allocation`` the capacity of each (layer, head) of docs/semantics.md. Every policy's
    scores come from its rule in :data:`RULES`; the highest are kept, ties to the more recent position."""
    n_layers = len(retained)
    capacity = spec.budget - spec.chunk + 1
    rule = RULES[spec.policy]
    if spec.allocation == "adaptive":
        for layer in range(n_layers):
            _decide_adaptive(spec, retained, layer, now, capacity, record)
        return
    per_layer = [capacity] * n_layers
    if spec.allocation == "pyramid":
        per_layer = _pyramid(capacity, rule.always_kept(spec, capacity), n_layers)
    layers = [layer for layer in range(n_layers) if not record["exempt"][layer]]  # exempt: kept as they are
    heads = [range(len(per_head)) for per_head in retained]  # each layer's own KV heads
    if spec.scope == "head":
        groups = [[(layer, h)] for layer in layers for h in heads[layer]]
    elif spec.scope == "layer":
        groups = [[(layer, h) for h in heads[layer]] for layer in layers]
    else:
        groups = [[(layer, h) for layer in range(n_layers) for h in heads[layer]]]
    for members in groups:
        candidates = retained[members[0][0]][members[0][1]]
        assert all(retained[layer][h] == candidates for layer, h in members), "a shared set diverged"
        if not candidates:  # a layer holding no entries (a mixer's, or one reading another's cache)
            continue
        room = per_layer[members[0][0]]  # the layer's capacity; the policy's own rules read B'
        tables = [rule.score(spec, record, layer, h, candidates, now, capacity) for layer, h in members]
        score = {j: rule.reduce(spec, [table[j] for table in tables]) for j in candidates}
        keep = sorted(candidates, key=lambda j: (score[j], j), reverse=True)[:room]  # noqa: B023
        for layer, h in members:
            retained[layer][h] = sorted(keep)


def _pyramid(capacity: int, always_kept: int, n_layers: int) -> list[int]:
    """Per-layer capacities falling linearly with depth, summing to L * B' (docs/semantics.md)."""
    if n_layers == 1:
        return [capacity]
    last = max(-(-capacity // 4), always_kept + 1)
    first = 2 * capacity - last
    caps = [first]
    for layer in range(1, n_layers - 1):
        caps.append((first * (n_layers - 1) + (last - first) * layer) // (n_layers - 1))  # floor, exact
    caps.append(last)
    residue = n_layers * capacity - sum(caps)
    return [c + (1 if layer < residue else 0) for layer, c in enumerate(caps)]


def _decide_adaptive(spec, retained, layer, now, capacity, record) -> None:
    """AdaKV over one layer: each head keeps its f = ceil(0.2 B') best, then the layer's other
    n_kv (B' - f) slots go to the best remaining candidates of all its heads (higher score, then more
    recent position, then lower head index)."""
    floor = -(-capacity // 5)
    kept, rest = [], []
    for h, candidates in enumerate(retained[layer]):
        score = RULES[spec.policy].score(spec, record, layer, h, candidates, now, capacity)
        ranked = sorted(candidates, key=lambda j: (score[j], j), reverse=True)  # noqa: B023
        kept.append(ranked[:floor])
        rest += [(-score[j], -j, h, j) for j in ranked[floor:]]
    for _, _, h, j in sorted(rest)[: len(retained[layer]) * (capacity - floor)]:
        kept[h].append(j)
    for h in range(len(retained[layer])):
        retained[layer][h] = sorted(kept[h])


def _next_request(future: torch.Tensor, layer: int, h: int, j: int, now: int, tau: float) -> float:
    """The first query s >= now whose reference attention on j is at least tau; infinity if none."""
    for s in range(now, future.shape[2]):
        if future[layer, h, s, j] >= tau:
            return s
    return math.inf


# ---- the rules: one table -----------------------------------------------------------------------
# A score rule scores one (layer, KV head)'s whole candidate list (sorted positions) at boundary ``now``
# and returns {position: score}, math.inf for a position that is always kept; ``capacity`` is B', from
# which a policy's own recent window counts.


def _recent(scores: dict[int, float], now: int, recent: int) -> dict[int, float]:
    """``scores`` with the ``recent`` most recent positions (j >= now - recent) always kept."""
    return {j: math.inf if j >= now - recent else score for j, score in scores.items()}


def _rho_window(spec: ReferenceSpec, capacity: int) -> int:
    """r = floor(rho * B') of rho as written in decimals (the product rounded to 9 decimals first)."""
    return math.floor(round(spec.rho * capacity, 9))


def _h2o(spec, record, layer, h, candidates, now, capacity) -> dict[int, float]:
    """A_j = sum_s a_s(j); the r = floor(rho * B') most recent positions kept."""
    acc = record["attention_sum"][layer][h]
    return _recent({j: acc.get(j, 0.0) for j in candidates}, now, _rho_window(spec, capacity))


def _counts(spec: ReferenceSpec, s: int, j: int) -> bool:
    """rmm: does query s add to key j's utility (always, or with ``freeze`` only while s - j <= H)?"""
    return spec.after_commit == "accumulate" or s - j <= spec.lag


def _rmm_observe(spec: ReferenceSpec, record: dict, t: int) -> None:
    """rmm after query t: add a_t(j) * w_t to every key it saw (``weight=gradient``: at the end of each
    chunk, the chunk's gradient utility u_s(j) instead), subject to ``after_commit``."""
    utility = record["utility"]
    if spec.weight != "gradient":
        w = record["weights"][t][spec.weight]
        for layer, per_head in enumerate(record["rows"][t]):
            for h, seen in enumerate(per_head):
                for j, a in seen.items():
                    if _counts(spec, t, j):
                        utility[layer][h][j] = utility[layer][h].get(j, 0.0) + a * w
        return
    now = t + 1
    if now % spec.chunk:
        return
    start = now - spec.chunk
    if spec.gradient_loss == "chunk":
        parts = [(start, now, spec.retained_log[start])]
    else:  # each query alone, over R plus the chunk's earlier tokens (the chunk-1 computation)
        parts = [(s, s + 1, spec.retained_log[s]) for s in range(start, now)]
    for first, stop, kept in parts:
        gradient = gradient_utility(
            record["model"], record["tokens"], first, stop, kept, record["keys"], record["values"],
            record["made_at"], spec, record["inv_freq"],
        )  # fmt: skip
        for layer, per_head in enumerate(gradient):
            for h, rows in enumerate(per_head):
                for s, row in rows.items():
                    for j, u in row.items():
                        if _counts(spec, s, j):
                            utility[layer][h][j] = utility[layer][h].get(j, 0.0) + u


def _auto_windows(spec: ReferenceSpec, capacity: int) -> list[int]:
    """rmm lag=auto's arms as their recent windows: h2o's floor(B' / 2) (uniform statistic), then the
    candidate lags (the configured weight): step * m for every m >= 2 whose odd part is 1 or 3 (2, 3, 4,
    6, 8, 12, ...) with 2 * step * m <= B'."""
    lags = []
    for m in range(2, capacity + 1):
        odd = m
        while odd % 2 == 0:
            odd //= 2
        if odd in (1, 3) and 2 * spec.step * m <= capacity:
            lags.append(spec.step * m)
    return [capacity // 2, *lags]


def _rmm_auto_observe(spec: ReferenceSpec, record: dict, t: int) -> None:
    """rmm lag=auto after query t, per (layer, KV head). At the first query of a chunk (after the
    boundary ``start``), every arm's shadow drops, of the retained set R_start less what it dropped
    before, all but its B' - C best by its own ranking. Every query adds w_t * a_t(j) over the retained
    entries j < start in an arm's dropped set to that arm's loss, and a_t(j) to h2o's statistic; then
    rmm's own utility (:func:`_rmm_observe`)."""
    capacity = spec.budget - spec.chunk + 1
    windows = _auto_windows(spec, capacity)
    start = t - t % spec.chunk
    w = record["weights"][t][spec.weight]
    for layer, per_head in enumerate(record["rows"][t]):
        for h, seen in enumerate(per_head):
            auto = record["auto"][layer][h]
            if not auto:
                auto.update(acc={}, dropped=[set() for _ in windows], loss=[0.0 for _ in windows])
            if t == start > 0:
                retained = spec.retained_log[start][layer][h]
                for arm, recent in enumerate(windows):
                    statistic = auto["acc"] if arm == 0 else record["utility"][layer][h]
                    held = [j for j in retained if j not in auto["dropped"][arm]]
                    ranked = sorted(
                        held,
                        key=lambda j: (math.inf if j >= start - recent else statistic.get(j, 0.0), j),  # noqa: B023
                        reverse=True,
                    )
                    auto["dropped"][arm] |= set(ranked[max(capacity - spec.chunk, 0) :])
            for arm, dropped in enumerate(auto["dropped"]):
                auto["loss"][arm] += sum(w * a for j, a in seen.items() if j < start and j in dropped)
            for j, a in seen.items():
                auto["acc"][j] = auto["acc"].get(j, 0.0) + a
    _rmm_observe(spec, record, t)


GRADIENT_DIGITS = 3  # rmm compares gradient utilities at 3 significant digits (docs/semantics.md)


def _rmm(spec, record, layer, h, candidates, now, capacity) -> dict[int, float]:
    """The accumulated utility (the gradient utility at GRADIENT_DIGITS significant digits); the
    provisional buffer (the last H positions) kept. ``lag=auto``: the arm with the least loss (at
    SCORE_DIGITS significant digits, the first on ties) ranks by its statistic behind its recent window."""
    if spec.lag == "auto":
        auto = record["auto"][layer][h]
        losses = [_significant(loss) for loss in auto["loss"]]
        arm = losses.index(min(losses))
        statistic = auto["acc"] if arm == 0 else record["utility"][layer][h]
        recent = _auto_windows(spec, capacity)[arm]
        return _recent({j: statistic.get(j, 0.0) for j in candidates}, now, recent)
    utility = {j: record["utility"][layer][h].get(j, 0.0) for j in candidates}
    if spec.weight == "gradient":
        utility = {j: _significant(u, GRADIENT_DIGITS) for j, u in utility.items()}
    return _recent(utility, now, spec.lag)


def _tova(spec, record, layer, h, candidates, now, capacity) -> dict[int, float]:
    """The attention of the latest query, a_{now-1}(j)."""
    if spec.variant == "kvpress":
        return _tova_kvpress(spec, record, layer, h, candidates, now, capacity)
    latest = record["rows"][now - 1][layer][h]
    return {j: latest[j] for j in candidates}


def _random(spec, record, layer, h, candidates, now, capacity) -> dict[int, float]:
    """The seeded priority; the r = floor(rho * B') most recent positions kept."""
    scores = {j: splitmix_uniform(spec.seed, layer, h, j) for j in candidates}
    return _recent(scores, now, _rho_window(spec, capacity))


def _oracle(spec, record, layer, h, candidates, now, capacity) -> dict[int, float]:
    """next_use (Belady): minus the first future request s >= now with a*_s(j) >= tau (-inf if none);
    future_mass / future_utility: sum over s >= now of a*_s(j) * w*_s where a*_s(j) >= tau (w* = 1 for
    future_mass, the reference pass's own ``weight`` for future_utility)."""
    attention, weights = record["future"]
    if spec.variant == "next_use":
        return {j: -_next_request(attention, layer, h, j, now, spec.tau) for j in candidates}
    weight = weights[spec.weight if spec.variant == "future_utility" else "uniform"][now:].tolist()
    scores = {}
    for j in candidates:
        requests = zip(attention[layer, h, now:, j].tolist(), weight, strict=True)
        scores[j] = math.fsum(a * w for a, w in requests if a >= spec.tau)
    return scores


def _oracle_reduce(spec: ReferenceSpec, scores: list[float]) -> float:
    """A shared set serves whoever requests a key first (next_use); the masses add up otherwise."""
    return max(scores) if spec.variant == "next_use" else math.fsum(scores)


# observed_attention, snapkv, knorm, keydiff, lru, lagkv


def _unrotated(record, source: str, layer: int, h: int, j: int) -> list[float]:
    """Key j (rotated back from the position the model produced it at) or value j, in float64 (computed
    once: a key or value never changes once the model produced it)."""
    known = record["unrotated"][source][layer][h]
    if j not in known:
        x = record[source][layer][h][j].double()
        if source == "keys":
            x = rope_rotate(x[None], [-record["made_at"][j]], *record["inv_freq"][layer])[0]
        known[j] = x.tolist()
    return known[j]


def _observed_attention(spec, record, layer, h, candidates, now, capacity) -> dict[int, float]:
    """A_j / n_j (``kvpress``: A_j / (G n_j), the mean over the group's query heads); the
    r = floor(rho * B') most recent positions kept."""
    recent = _rho_window(spec, capacity)
    acc, count = record["attention_sum"][layer][h], record["count"][layer][h]
    group = _group(record["model"]) if spec.variant == "kvpress" else 1
    return {j: math.inf if j >= now - recent else acc[j] / count[j] / group for j in candidates}


def _snapkv(spec, record, layer, h, candidates, now, capacity) -> dict[int, float]:
    """Mean attention of the chunk's last min(window, C) queries, pooled over position-sorted neighbours."""
    if spec.variant == "kvpress":
        return _snapkv_kvpress(spec, record, layer, h, candidates, now, capacity)
    rows = [record["rows"][s][layer][h] for s in range(now - min(spec.window, spec.chunk), now)]
    mean = [math.fsum(row.get(j, 0.0) for row in rows) / len(rows) for j in candidates]
    half, scores = spec.kernel // 2, {}
    for i, j in enumerate(candidates):
        around = [mean[i + d] if 0 <= i + d < len(candidates) else 0.0 for d in range(-half, half + 1)]
        pooled = math.fsum(around) / spec.kernel if spec.pooling == "avg" else max(around)
        scores[j] = math.inf if j >= now - spec.window else pooled
    return scores


SCORE_DIGITS = 4  # knorm, keydiff and lagkv compare their scores at 4 significant digits (docs/semantics.md)


def _significant(x: float, digits: int = SCORE_DIGITS) -> float:
    """``x`` rounded half to even to ``digits`` significant decimal digits (zero and infinities kept)."""
    if x == 0 or not math.isfinite(x):
        return x
    scale = 10.0 ** (math.floor(math.log10(abs(x))) - (digits - 1))
    return round(x / scale) * scale


def _knorm(spec, record, layer, h, candidates, now, capacity) -> dict[int, float]:
    """Minus the L2 norm of the unrotated key, at SCORE_DIGITS significant digits (``kvpress``: unrounded)."""
    if spec.variant == "kvpress":
        return {j: -math.hypot(*_unrotated(record, "keys", layer, h, j)) for j in candidates}
    return {j: -_significant(math.hypot(*_unrotated(record, "keys", layer, h, j))) for j in candidates}


def _keydiff(spec, record, layer, h, candidates, now, capacity) -> dict[int, float]:
    """Minus the cosine similarity of the unrotated key to the mean normalised key, at SCORE_DIGITS
    significant digits."""
    if spec.variant == "kvpress":
        return _keydiff_kvpress(spec, record, layer, h, candidates, now, capacity)
    units = {}
    for j in candidates:
        k = _unrotated(record, "keys", layer, h, j)
        units[j] = [x / math.hypot(*k) for x in k]
    dims = range(len(units[candidates[0]]))
    mean = [math.fsum(units[j][c] for j in candidates) / len(candidates) for c in dims]
    return {
        j: -_significant(math.fsum(u * m for u, m in zip(units[j], mean, strict=True)) / math.hypot(*mean))
        for j in candidates
    }


def _lru(spec, record, layer, h, candidates, now, capacity) -> dict[int, float]:
    """The last query s with a_s(j) >= tau, or j itself."""
    return {j: float(record["last_use"][layer][h][j]) for j in candidates}


def _lagkv(spec, record, layer, h, candidates, now, capacity) -> dict[int, float]:
    """Partition k = positions [S + kP, S + (k + 1)P), scored against partition k + 1 once that one is
    whole; sinks and positions of partitions not yet scored are kept."""
    if spec.variant == "kvpress":
        return _lagkv_kvpress(spec, record, layer, h, candidates, now, capacity)
    size, sinks = spec.partition, spec.sinks
    scores, partitions = {}, record["partitions"][layer][h]  # a partition's keys and values never change
    for j in candidates:
        k = (j - sinks) // size
        if j < sinks or sinks + (k + 2) * size > now:
            scores[j] = math.inf
            continue
        start = sinks + k * size
        if start not in partitions:
            partitions[start] = _lagkv_partition(record, layer, h, start, size)
        scores[j] = _significant(partitions[start][j])
    return scores


def _lagkv_partition(record, layer: int, h: int, start: int, size: int) -> dict[int, float]:
    """Each position i of the partition [start, start + P) -> the softmax over the partition of its keys'
    spreads plus that of its values' (each row min-max normalised by the next partition, per channel)."""
    part, reference = range(start, start + size), range(start + size, start + 2 * size)
    total = dict.fromkeys(part, 0.0)
    for source in ("keys", "values"):
        rows = {i: _unrotated(record, source, layer, h, i) for i in [*part, *reference]}
        dims = range(len(rows[start]))
        low = [min(rows[i][c] for i in reference) for c in dims]
        high = [max(rows[i][c] for i in reference) for c in dims]
        spread = {}
        for i in part:
            normed = [(rows[i][c] - low[c]) / max(high[c] - low[c], 1e-6) for c in dims]
            mean = math.fsum(normed) / len(normed)
            spread[i] = math.sqrt(math.fsum((x - mean) ** 2 for x in normed) / (len(normed) - 1))
        top = max(spread.values())
        denominator = math.fsum(math.exp(v - top) for v in spread.values())
        for i in part:
            total[i] += math.exp(spread[i] - top) / denominator
    return total


# ---- variant=kvpress: the scores of kvpress 0.5.5's presses on the same state (docs/semantics.md) ---------
# (any other ``variant`` of these six policies is the harness's definition above)


def _group(model: PreTrainedModel) -> int:
    """G, the query heads per KV head, from the config."""
    return model.config.get_text_config().num_attention_heads // model_shape(model)[1]


def _cached(spec, record, source: str, layer: int, h: int, j: int) -> list[float]:
    """Key j as the cache holds it (as the model rotated it, at its original position) or value j."""
    if spec.positions != "original":
        raise ValueError(
            "variant=kvpress scores keys as cached at their original positions: positions=original"
        )
    return record[source][layer][h][j].double().tolist()


def _keydiff_kvpress(spec, record, layer, h, candidates, now, capacity) -> dict[int, float]:
    """KeyDiffPress: minus the cosine similarity of the cached key to the mean of the normalised keys."""
    keys = {j: _cached(spec, record, "keys", layer, h, j) for j in candidates}
    units = {j: [x / math.hypot(*k) for x in k] for j, k in keys.items()}
    dims = range(len(keys[candidates[0]]))
    mean = [math.fsum(units[j][c] for j in candidates) / len(candidates) for c in dims]
    return {
        j: -math.fsum(x * m for x, m in zip(k, mean, strict=True)) / (math.hypot(*k) * math.hypot(*mean))
        for j, k in keys.items()
    }


def _lagkv_kvpress(spec, record, layer, h, candidates, now, capacity) -> dict[int, float]:
    """LagKVPress (cross_scoring=False) over the candidates as a cache (sorted positions, indices 0..n-1):
    the first S indices and the tail score 1; each whole partition of P indices but the last is ranked,
    rank / P, by the mean of its keys' and values' softmax spreads against the next partition; fewer than
    S + 2P entries score (i - S) / (n - S) by index i (sinks 1)."""
    size, sinks, n = spec.partition, spec.sinks, len(candidates)
    if n < sinks + 2 * size:
        return {j: 1.0 if i < sinks else (i - sinks) / (n - sinks) for i, j in enumerate(candidates)}
    end = sinks + (n - sinks) // size * size
    scores = dict.fromkeys(candidates, 1.0)
    for start in range(sinks, end - size, size):
        part, reference = candidates[start : start + size], candidates[start + size : start + 2 * size]
        total = dict.fromkeys(part, 0.0)
        for source in ("keys", "values"):
            rows = {i: _cached(spec, record, source, layer, h, i) for i in [*part, *reference]}
            dims = range(len(rows[part[0]]))
            low = [min(rows[i][c] for i in reference) for c in dims]
            high = [max(rows[i][c] for i in reference) for c in dims]
            spread = {}
            for i in part:
                normed = [(rows[i][c] - low[c]) / (high[c] - low[c]) for c in dims]
                mean = math.fsum(normed) / len(normed)
                spread[i] = math.sqrt(math.fsum((x - mean) ** 2 for x in normed) / (len(normed) - 1))
            top = max(spread.values())
            weights = {i: math.exp(v - top) for i, v in spread.items()}
            for i in part:
                total[i] += weights[i] / math.fsum(weights.values()) / 2
        for rank, j in enumerate(sorted(part, key=lambda i: (total[i], i))):  # noqa: B023
            scores[j] = rank / size
    return scores


def _snapkv_kvpress(spec, record, layer, h, candidates, now, capacity) -> dict[int, float]:
    """SnapKVPress: the mean over the group's query heads of the window's mean attention, pooled (sum of the
    k places centred on j over k) over the candidates before the window only, zeros beyond them."""
    if spec.pooling != "avg":
        raise ValueError("variant=kvpress pools as SnapKVPress does: pooling=avg")
    rows = [record["rows"][s][layer][h] for s in range(now - min(spec.window, spec.chunk), now)]
    group = _group(record["model"])
    older = [j for j in candidates if j < now - spec.window]
    mean = [math.fsum(row.get(j, 0.0) for row in rows) / len(rows) / group for j in older]
    half = spec.kernel // 2
    scores = dict.fromkeys(candidates, math.inf)
    for i, j in enumerate(older):
        around = [mean[i + d] if 0 <= i + d < len(older) else 0.0 for d in range(-half, half + 1)]
        scores[j] = math.fsum(around) / spec.kernel
    return scores


def _tova_kvpress(spec, record, layer, h, candidates, now, capacity) -> dict[int, float]:
    """TOVAPress: the latest query's attention on j averaged over all the layer's query heads (the same
    score in every KV head); the latest query's own key kept."""
    rows = record["rows"][now - 1][layer]  # per KV head {j: a_{now-1}(j)}, group summed
    heads = record["model"].config.get_text_config().num_attention_heads
    return {
        j: math.inf if j == now - 1 else math.fsum(row.get(j, 0.0) for row in rows) / heads
        for j in candidates
    }


# ---- restkv, expected_attention (2026 baselines) --------------------------------------------------


def _output_columns(record: dict, layer: int, h: int) -> list[list[float]]:
    """Wbar_h [hidden][D]: the columns of ``layer``'s attention output projection (the linear ``o_proj``,
    ``dense`` or ``out_proj`` of the module whose ``layer_idx`` is ``layer``, read from the model) that
    the KV head's query heads h G + g feed, summed over g (float64)."""
    cached = record.setdefault("output_columns", {})
    if (layer, h) not in cached:
        model = record["model"]
        head_dim, group = model_shape(model)[2], _group(model)
        linears = [
            getattr(module, name)
            for module in model.modules()
            if getattr(module, "layer_idx", None) == layer
            for name in ("o_proj", "dense", "out_proj")
            if isinstance(getattr(module, name, None), torch.nn.Linear)
        ]
        assert len(linears) == 1, f"layer {layer}: {len(linears)} output projections"
        weight = linears[0].weight.detach().double()  # [hidden, n_heads * D], head by head
        heads = [weight[:, q * head_dim : (q + 1) * head_dim] for q in range(h * group, (h + 1) * group)]
        cached[layer, h] = sum(heads).tolist()
    return cached[layer, h]


def _restkv(spec, record, layer, h, candidates, now, capacity) -> dict[int, float]:
    """p_j / max(1 - p_j, 1e-6) * ||Wbar_h (o - v_j)||: m the EMA (``beta``) over the chunk's queries of
    the group's mean attention, o = sum_j m_j v_j, p_j the mean of m over the ``kernel`` position-sorted
    candidates centred on j (a missing neighbour counts 0). ``variant=official``: :func:`_restkv_official`."""
    if spec.variant == "official":
        return _restkv_official(spec, record, layer, h, candidates, now, capacity)
    group, queries = _group(record["model"]), list(range(now - spec.chunk, now))
    n_q, beta = len(queries), spec.beta
    weights = [beta ** (n_q - 1)] + [(1 - beta) * beta ** (n_q - 1 - i) for i in range(1, n_q)]
    terms: dict[int, list[float]] = {}
    for w, s in zip(weights, queries, strict=True):
        for j, a in record["rows"][s][layer][h].items():  # every key s saw (0 for the others)
            terms.setdefault(j, []).append(w * a / group)
    ema = {j: math.fsum(parts) for j, parts in terms.items()}
    values = {j: record["values"][layer][h][j].double().tolist() for j in set(ema) | set(candidates)}
    dims = range(len(values[candidates[0]]))
    output = [math.fsum(ema[j] * values[j][c] for j in ema) for c in dims]
    columns = _output_columns(record, layer, h)

    def projected_norm(x: list[float]) -> float:  # ||Wbar x||
        return math.sqrt(math.fsum(math.fsum(row[c] * x[c] for c in dims) ** 2 for row in columns))

    half, scores, n = spec.kernel // 2, {}, len(candidates)
    for i, j in enumerate(candidates):
        around = [ema.get(candidates[i + d], 0.0) for d in range(-half, half + 1) if 0 <= i + d < n]
        p = math.fsum(around) / spec.kernel
        size = projected_norm([output[c] - values[j][c] for c in dims])
        if size <= 1e-5 * (projected_norm(output) + projected_norm(values[j])):  # o = v_j up to rounding
            size = 0.0
        scores[j] = p / max(1.0 - p, 1e-6) * size
    return scores


def _restkv_official(spec, record, layer, h, candidates, now, capacity) -> dict[int, float]:
    """ReST-KV as the authors' RestKVCluster scores (paper configuration), one query head per KV head:
    the window's W queries' attention folded by the EMA recurrence m <- alpha a + (1 - alpha) m from the
    first, o over the candidates before the window, r_j = m_j / (1 - m_j) ||W_o^(h) (o - v_j)||, then
    the head's adaptive window: t from the index sums of the B' - W most attended candidates under the
    window's first and second halves, kernel max(k, 2 floor(|t| / scale) + 1), shift floor(t / scale)
    (+ 1 unless t > 0), averaged with the ends repeated. The window's W positions are always kept."""
    model, window = record["model"], spec.window
    if _group(model) != 1:
        raise ValueError("restkv variant=official keeps one set per query head: the model must have G = 1")
    if window > spec.chunk:
        raise ValueError("restkv variant=official reads the window's queries from the chunk: window <= C")
    rows = [record["rows"][s][layer][h] for s in range(now - window, now)]
    older = [j for j in candidates if j < now - window]
    ema = {}
    for j in older:
        m = rows[0].get(j, 0.0)
        for row in rows[1:]:
            m = spec.alpha * row.get(j, 0.0) + (1.0 - spec.alpha) * m
        ema[j] = m
    values = {j: record["values"][layer][h][j].double().tolist() for j in older}
    columns = _output_columns(record, layer, h)  # G = 1: head h's own columns
    dims = range(len(columns[0]))
    output = [math.fsum(ema[j] * values[j][c] for j in older) for c in dims]
    raw = []
    for j in older:
        change = [output[c] - values[j][c] for c in dims]
        norm = math.sqrt(math.fsum(math.fsum(row[c] * change[c] for c in dims) ** 2 for row in columns))
        raw.append(ema[j] / (1.0 - ema[j]) * norm)
    top = min(capacity - window, len(candidates))  # the K most attended keys of each window query

    def index_sum(row: dict[int, float]) -> int:  # indices: places in the position-sorted candidates
        attended = [row.get(j, 0.0) for j in candidates]
        return sum(sorted(range(len(candidates)), key=lambda i: (attended[i], i))[-top:])

    numerator = sum(index_sum(rows[i]) - index_sum(rows[window // 2 + i]) for i in range(window // 2))
    unit = (window // 2) * top * spec.scale  # t / scale = numerator / unit
    kernel = max(spec.kernel, 2 * (abs(numerator) // unit) + 1)
    shift = numerator // unit if numerator > 0 else numerator // unit + 1
    scores = dict.fromkeys(candidates, math.inf)
    n, half = len(older), kernel // 2
    for i, j in enumerate(older):
        around = [raw[min(max(i + shift + d, 0), n - 1)] for d in range(-half, half + 1)]
        scores[j] = math.fsum(around) / kernel
    return scores


def _expected_attention_observe(spec: ReferenceSpec, record: dict, t: int) -> None:
    """Keep query t's vectors of every layer, [n_heads][D], rotated back from the position the model
    rotated them at (the model's attention call of t's own pass left them in :data:`_PASS`)."""
    queries = record.setdefault("queries", {})
    for layer, (inv_freq, pairing) in enumerate(record["inv_freq"]):
        rotated = _PASS["query", layer][:, -1].double()  # [n_heads, D]
        shift = [-record["made_at"][t]] * rotated.shape[0]
        queries[layer, t] = rope_rotate(rotated, shift, inv_freq, pairing).tolist()


def _mean_rotation(record: dict, layer: int, future: int) -> list[list[float]]:
    """Rbar [D][D] = (1 / F) sum_{d < F} R_d, the layer's rotation by d positions averaged over F."""
    cached = record.setdefault("mean_rotation", {})
    if (layer, future) not in cached:
        head_dim = model_shape(record["model"])[2]
        inv_freq, pairing = record["inv_freq"][layer]
        basis = torch.eye(head_dim, dtype=torch.float64).repeat(future, 1)  # row d * D + c: e_c
        shift = [float(d) for d in range(future) for _ in range(head_dim)]
        rotated = rope_rotate(basis, shift, inv_freq, pairing).view(future, head_dim, head_dim)  # R_d e_c
        cached[layer, future] = (rotated.sum(0) / future).T.tolist()  # column c: Rbar e_c
    return cached[layer, future]


def _expected_attention(spec, record, layer, h, candidates, now, capacity) -> dict[int, float]:
    """(mean over the group of softmax_j z_{g,j} + epsilon) * ||v_j||, with z_{g,j} the expected logit of
    the key R_{j-now} k_j under the mean and covariance of the chunk's queries at positions >= sinks,
    rotated by Rbar; the first ``sinks`` positions kept."""
    inv_freq, pairing = record["inv_freq"][layer]
    head_dim, group = model_shape(record["model"])[2], _group(record["model"])
    dims = range(head_dim)
    rbar = _mean_rotation(record, layer, spec.n_future_positions)
    used = [s for s in range(now - spec.chunk, now) if s >= spec.sinks]
    keys = {}
    for j in candidates:
        if j >= spec.sinks:
            k = torch.tensor([_unrotated(record, "keys", layer, h, j)], dtype=torch.float64)
            keys[j] = rope_rotate(k, [float(j - now)], inv_freq, pairing)[0].tolist()
    expected = dict.fromkeys(keys, 0.0)
    for q in range(h * group, (h + 1) * group):
        vectors = [record["queries"][layer, s][q] for s in used]
        n = max(len(vectors), 1)  # no query: mean and covariance 0
        mean = [math.fsum(x[c] for x in vectors) / n for c in dims]
        centred = [[x[c] - mean[c] for c in dims] for x in vectors]
        cov = [[math.fsum(x[a] * x[b] for x in centred) / n for b in dims] for a in dims]
        mu = [math.fsum(rbar[r][c] * mean[c] for c in dims) for r in dims]  # Rbar mu
        left = [[math.fsum(rbar[r][c] * cov[c][b] for c in dims) for b in dims] for r in dims]  # Rbar Sigma
        sigma = [[math.fsum(left[r][c] * rbar[b][c] for c in dims) for b in dims] for r in dims]  # .. Rbar^T
        logits = {}
        for j, k in keys.items():
            logits[j] = math.fsum(mu[c] * k[c] for c in dims) / math.sqrt(head_dim)
            if spec.use_covariance:
                quadratic = math.fsum(k[a] * sigma[a][b] * k[b] for a in dims for b in dims)
                logits[j] += quadratic / (2 * head_dim)
        top = max(logits.values(), default=0.0)
        total = math.fsum(math.exp(z - top) for z in logits.values())
        for j, z in logits.items():
            expected[j] += math.exp(z - top) / total / group
    scores = {}
    for j in candidates:
        if j < spec.sinks:
            scores[j] = math.inf
        elif spec.use_vnorm:
            norm = math.hypot(*record["values"][layer][h][j].double().tolist())
            scores[j] = (expected[j] + spec.epsilon) * norm
        else:
            scores[j] = expected[j]
    return scores


def _visible_full(spec: ReferenceSpec, now: int, j: int) -> bool:
    return True


def _visible_window(spec: ReferenceSpec, now: int, j: int) -> bool:
    return j >= now - spec.budget


def _visible_streaming_llm(spec: ReferenceSpec, now: int, j: int) -> bool:
    return j < spec.sinks or j >= now - (spec.budget - spec.sinks)


def _none(spec: ReferenceSpec, capacity: int) -> int:
    return 0


def _fsum(spec: ReferenceSpec, scores: list[float]) -> float:
    return math.fsum(scores)


def _latest(spec: ReferenceSpec, scores: list[float]) -> float:
    return max(scores)


@dataclass(frozen=True)
class Rule:
    """One policy's rule, spelled out.

    visible : a position rule: may query ``now`` see key j? (applied to every query)
    score : a score-based rule: {position: score} of one head's candidates at a boundary.
    observe : called after every query t but the last, to fold what it saw into ``record``.
    always_kept : how many positions the rule keeps whatever their scores, at most (its recent window and
        its sinks): the pyramid's smallest layer holds more.
    reduce : how the scores of heads or layers that share one set combine.
    reads_keys : the rule reads keys rotated back (the RoPE frequencies are needed).
    reads_values : the rule reads values.
    reads_future : the rule reads the reference pass (the oracle).
    params : the policy's own parameters and their defaults (read as ``spec.<name>``).
    """

    visible: Callable[[ReferenceSpec, int, int], bool] | None = None
    score: Callable[..., dict[int, float]] | None = None
    observe: Callable[[ReferenceSpec, dict, int], None] | None = None
    always_kept: Callable[[ReferenceSpec, int], int] = _none
    reduce: Callable[[ReferenceSpec, list[float]], float] = _fsum
    reads_keys: bool = False
    reads_values: bool = False
    reads_future: bool = False
    params: dict[str, object] = field(default_factory=dict)


RULES: dict[str, Rule] = {
    "full": Rule(visible=_visible_full),
    "window": Rule(visible=_visible_window),
    "streaming_llm": Rule(visible=_visible_streaming_llm, params={"sinks": 4}),
    "h2o": Rule(score=_h2o, always_kept=_rho_window, params={"rho": 0.5}),
    "rmm": Rule(
        score=_rmm,
        observe=lambda spec, record, t: (_rmm_auto_observe if spec.lag == "auto" else _rmm_observe)(
            spec, record, t
        ),
        always_kept=lambda spec, capacity: capacity // 2 if spec.lag == "auto" else spec.lag,
        params={
            "lag": 0,
            "weight": "correct",
            "after_commit": "accumulate",
            "gradient_loss": "chunk",
            "step": 16,
        },
    ),
    "tova": Rule(score=_tova, params={"variant": "harness"}),
    "random": Rule(score=_random, always_kept=_rho_window, params={"rho": 0.5, "seed": 0}),
    "oracle": Rule(
        score=_oracle,
        reduce=_oracle_reduce,
        reads_future=True,
        params={"variant": "next_use", "weight": "correct"},
    ),
    "observed_attention": Rule(
        score=_observed_attention, always_kept=_rho_window, params={"rho": 0.5, "variant": "harness"}
    ),
    "snapkv": Rule(
        score=_snapkv,
        always_kept=lambda spec, capacity: spec.window,
        params={"window": 32, "kernel": 5, "pooling": "avg", "variant": "harness"},
    ),
    "knorm": Rule(score=_knorm, reads_keys=True, params={"variant": "harness"}),
    "keydiff": Rule(score=_keydiff, reads_keys=True, params={"variant": "harness"}),
    "lru": Rule(score=_lru, reduce=_latest),
    "lagkv": Rule(
        score=_lagkv,
        always_kept=lambda spec, capacity: spec.sinks + 2 * spec.partition - 1,
        reads_keys=True,
        reads_values=True,
        params={"partition": 32, "sinks": 4, "variant": "harness"},
    ),
    "restkv": Rule(
        score=_restkv,
        always_kept=lambda spec, capacity: spec.window if spec.variant == "official" else 0,
        reads_values=True,
        params={"beta": 0.8, "kernel": 5, "variant": "harness", "window": 32, "alpha": 0.3, "scale": 2000},
    ),
    "expected_attention": Rule(
        score=_expected_attention,
        observe=_expected_attention_observe,
        always_kept=lambda spec, capacity: spec.sinks,
        reads_keys=True,
        reads_values=True,
        params={
            "n_future_positions": 512,
            "use_covariance": True,
            "use_vnorm": True,
            "epsilon": 0.0,
            "sinks": 4,
        },
    ),
}
POSITION_RULES = tuple(name for name, rule in RULES.items() if rule.visible is not None)
SCORE_POLICIES = tuple(name for name, rule in RULES.items() if rule.score is not None)
