"""The policies named after kvpress presses against the presses' own ``score`` methods, at every boundary.

    python -m checks.kvpress_parity [--out results/bench/kvpress_parity.md] [--fast]

What is compared. A case (policy, press, B', scope) streams N_TOKENS tokens in chunks of C = CHUNK through
rmm.engine.StreamingEngine (positions=original); at every chunk boundary ``now`` (C, 2C, ...) the policy's
scores of the candidates (a ``before_boundary`` hook) and the set the engine kept (``on_boundary``) are
recorded. Then the press's ``score`` is called, per layer, on the state a plain eager run of the model
gives at that boundary, and compared with both.

The press's inputs: an eager replay, not the engine's memory. kvpress's state at a boundary is a cache of
the retained entries (keys as cached: rotated at their original positions) plus the chunk, and the chunk's
forward over that cache. Which entries are retained is the decision under test, so the replay takes the
engine's retained set after the previous boundary (the positions only) and recomputes everything else
with the model's own modules and nothing of the engine: per chunk, the token embeddings go through each
decoder layer (``model.model.layers[l]``, attention ``eager``) with a cache object that holds the replay's
own keys and values of the retained positions (computed by the replay when their chunk ran) and appends
the chunk's; the causal mask lets every query see the whole retained cache and the chunk up to itself.
From it the press gets ``module`` (the layer's attention), ``hidden_states`` (the attention's input),
``keys``/``values`` [1, H, n, D] (per KV head its own retained positions, oldest first, then the chunk),
``attentions`` [1, H_q, C, n] (the eager attention weights) and ``kwargs`` (``position_embeddings``).
What is exact: at the first boundary nothing was evicted and the replay is a plain eager forward of the
first C tokens (checked against ``model(tokens[:C], output_attentions=True)``: keys, values and
attentions of every layer). After an eviction a layer's output depends on what was evicted upstream, so an
independent forward over the full prefix would give the right keys only in layer 0 (checked: the replay's
layer-0 keys equal a full-prefix forward's at the retained positions at every boundary); for the later
layers the replay recomputes the keys through the model's own modules over the retained cache: the same
state as the engine's, computed independently of the engine's memory, attention function and recording.

Press by press: KnormPress, KeyDiffPress, LagKVPress, SnapKVPress (given the attention, and computing its
window's attention itself, ``attentions=None``), TOVAPress (both ways too) get exactly that.
ObservedAttentionPress averages the attention a prefill's queries paid to each key over the queries that
saw it (dividing column j of an n x n attention by n - j); the policy accumulates over the stream, which
the press sees only at the first boundary. At later boundaries the press is given the stream's history:
keys/values placeholders [1, H, now, D] and ``attentions`` [1, H_q, now, now] whose row s holds the
attention query s paid to every position (0 where not in its cache), filled by the replay chunk by chunk;
a retained entry was seen by every later query, so the press's n - j is the policy's count, and only the
retained positions and the chunk are compared. ExpectedAttentionPress is a prefill press: it drops the
first ``n_sink`` rows of ``hidden_states`` and averages the rotation over positions q_len .. q_len + F - 1
(q_len = the prefill's length). At the first boundary it is called unmodified; at later ones, given the
chunk's hidden states, it drops the chunk's rows at positions < n_sink (none) and averages the rotation
from ``now`` (the subclass :func:`expected_press` changes those two numbers, nothing else). Its
``module.rotary_emb`` (which kvpress's pipeline sets) is the model's rotary module during the call.

Scores. The policy's infinite scores (always kept: snapkv's window, tova's latest key, sinks) are compared
as kept: the press must score them at least as high as every other entry (a press that pads them with its
maximum + 1), except observed_attention with rho > 0, whose recent window is the harness's, not the
press's. Every other score is compared as a number: "score difference" is the largest |policy - press|
over a (layer, KV head) divided by the largest |press score| there (SCORE_TOLERANCE, 1e-5; measured: at
most 3.4e-6, ExpectedAttentionPress, whose exponentials and rotations by now + 512 positions round most;
the others at most 1.3e-6), and the largest absolute difference is reported too.

Kept sets, tie-aware. The press's decision is the always-kept entries plus the press's top B' - |always|
of the rest (``topk``). Where the engine kept another set, the engine's set is judged by the press's
scores: its relative margin (rmm.policies.select.decision_margin: lowest kept minus highest evicted over
their size) at or above -tie_margin(policy.score_digits) (rmm.divergence: TIE_MARGIN = 1e-4 for unrounded
scores) means the deciding scores are within rounding of each other: a tie, where the harness keeps the
more recent position and kvpress's ``topk`` picks arbitrarily. Ties are counted and reported, never a
failure; a set the press's scores clearly rank lower (margin below -tie_margin, a different size, or an
always-kept entry evicted) is a clear difference and fails the case.

Coverage (:data:`CASES` x :data:`MODELS` x :data:`STREAMS`): tiny Llama, Qwen2 and Qwen3 (checks.matrix
``tiny_model``; Qwen3's q_norm and k_norm weights, which its initialisation leaves at 1 so that every
layer-0 key norm is sqrt(D), drawn 1 + r N(0, 1) with the model's seed and init range r), two seeds with
two init ranges, a stream of distinct tokens and one that repeats a 14-token block; several settings
per press. The fast subset (tests/test_kvpress_parity.py, unmarked) is one model, the distinct stream,
every press at its default; the sweep is marked slow.

kvpress (0.5.5, installed by ``make setup`` without its dependencies) is imported press module by press
module: ``import kvpress`` runs its package ``__init__``, which imports every press (some need packages the
harness does not install) and wraps every attention function of transformers for the whole process.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import platform
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch

from checks.matrix import distinct_stream, tiny_model
from rmm.divergence import tie_margin
from rmm.engine import StreamingEngine
from rmm.files import atomic_write_text
from rmm.policies import make_policy
from rmm.policies.select import decision_margin

KVPRESS_VERSION = "0.5.5"
PRESS_MODULES = {
    "KnormPress": "knorm_press",
    "KeyDiffPress": "keydiff_press",
    "LagKVPress": "lagkv_press",
    "SnapKVPress": "snapkv_press",
    "TOVAPress": "tova_press",
    "ObservedAttentionPress": "observed_attention_press",
    "ExpectedAttentionPress": "expected_attention_press",
}
CHUNK = 16  # C
N_TOKENS = 56  # boundaries at 16, 32, 48
SCORE_TOLERANCE = 1e-5  # |policy - press| / max |press| per (layer, KV head), float32 scores
ARCHS = ("llama", "qwen2", "qwen3")
MODELS = ((0, 0.1), (1, 0.25))  # (seed, initializer_range) of tiny_model
STREAMS = ("distinct", "repeated")
# presses that compute their window's attention themselves (from hidden_states and position_embeddings)
# when given none: scored both ways
OWN_ATTENTION = ("SnapKVPress", "TOVAPress")


@dataclass(frozen=True)
class Case:
    """One comparison: the policy (name, parameters), the press (class, arguments), B' and the scope."""

    name: str
    params: dict
    press: str
    press_args: dict = field(default_factory=dict)
    capacity: int = 12  # B'
    scope: str = "head"
    default: bool = False  # the press at its default: the fast subset

    @property
    def budget(self) -> int:
        return self.capacity + CHUNK - 1

    @property
    def pressed(self) -> bool:
        """Whether the policy is the press's definition (``variant=kvpress``; expected_attention has no
        other): only those must agree."""
        return self.params.get("variant") == "kvpress" or self.name == "expected_attention"

    def settings(self) -> str:
        policy = ", ".join(f"{k}={v}" for k, v in self.params.items()) or "defaults"
        scope = "" if self.scope == "head" else f", scope={self.scope}"
        press = ", ".join(f"{k}={v}" for k, v in self.press_args.items())
        return f"{policy}; B'={self.capacity}{scope} | {self.press}({press})"


KV = {"variant": "kvpress"}
# every policy named after a press, several settings each (sizes fit C = 16, B' = 8 or 12)
CASES = [
    Case("knorm", KV, "KnormPress", default=True),
    Case("knorm", KV, "KnormPress", capacity=8),
    Case("keydiff", KV, "KeyDiffPress", default=True),
    Case("keydiff", KV, "KeyDiffPress", capacity=8),
    # lagkv's press scores are ranks within a partition: equal ranks of different partitions tie at
    # every cut, so every budget meets ties
    Case(
        "lagkv", {"partition": 4, "sinks": 2, **KV}, "LagKVPress", {"n_sink": 2, "lag_size": 4}, default=True
    ),
    Case("lagkv", {"partition": 4, "sinks": 2, **KV}, "LagKVPress", {"n_sink": 2, "lag_size": 4}, 10),
    Case("lagkv", {"partition": 3, "sinks": 1, **KV}, "LagKVPress", {"n_sink": 1, "lag_size": 3}, 8),
    Case("lagkv", {"partition": 2, "sinks": 0, **KV}, "LagKVPress", {"n_sink": 0, "lag_size": 2}, 9),
    Case(
        "snapkv",
        {"window": 4, "kernel": 5, **KV},
        "SnapKVPress",
        {"window_size": 4, "kernel_size": 5},
        default=True,
    ),
    Case("snapkv", {"window": 8, "kernel": 3, **KV}, "SnapKVPress", {"window_size": 8, "kernel_size": 3}),
    Case("snapkv", {"window": 2, "kernel": 7, **KV}, "SnapKVPress", {"window_size": 2, "kernel_size": 7}, 8),
    Case("snapkv", {"window": 4, "kernel": 1, **KV}, "SnapKVPress", {"window_size": 4, "kernel_size": 1}),
    Case("tova", KV, "TOVAPress", default=True),
    Case("tova", KV, "TOVAPress", scope="layer"),
    Case("tova", KV, "TOVAPress", capacity=8, scope="layer"),
    Case("observed_attention", {"rho": 0.0, **KV}, "ObservedAttentionPress", default=True),
    Case("observed_attention", {"rho": 0.0, **KV}, "ObservedAttentionPress", capacity=8),
    Case("observed_attention", {"rho": 0.25, **KV}, "ObservedAttentionPress"),
    Case("expected_attention", {}, "ExpectedAttentionPress", default=True),
    Case(
        "expected_attention",
        {"n_future_positions": 16, "sinks": 1, "epsilon": 0.01},
        "ExpectedAttentionPress",
        {"n_future_positions": 16, "n_sink": 1, "epsilon": 0.01},
    ),
    Case(
        "expected_attention",
        {"n_future_positions": 1, "sinks": 0, "use_covariance": False, "use_vnorm": False},
        "ExpectedAttentionPress",
        {"n_future_positions": 1, "n_sink": 0, "use_covariance": False, "use_vnorm": False},
        8,
    ),
    Case(
        "expected_attention",
        {"n_future_positions": 64, "sinks": 2, "use_covariance": False},
        "ExpectedAttentionPress",
        {"n_future_positions": 64, "n_sink": 2, "use_covariance": False},
    ),
]
# the harness's own definitions at the press's default sizes: informational (they differ by design)
HARNESS = [
    Case("knorm", {}, "KnormPress"),
    Case("keydiff", {}, "KeyDiffPress"),
    Case("lagkv", {"partition": 4, "sinks": 2}, "LagKVPress", {"n_sink": 2, "lag_size": 4}),
    Case("snapkv", {"window": 4, "kernel": 5}, "SnapKVPress", {"window_size": 4, "kernel_size": 5}),
    Case("tova", {}, "TOVAPress"),
    Case("observed_attention", {"rho": 0.0}, "ObservedAttentionPress"),
]


def load_presses() -> dict[str, type]:
    """The press classes, from kvpress's own modules, without running ``kvpress/__init__.py``."""
    spec = importlib.util.find_spec("kvpress")  # finds the package without importing it
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            f"kvpress is not installed: `make setup` installs kvpress=={KVPRESS_VERSION}"
        )
    root = Path(spec.origin).parent
    shells = []
    for name, folder in (("kvpress", root), ("kvpress.presses", root / "presses")):
        if name not in sys.modules:  # a package whose __init__ is not run: its modules import as usual
            shell = types.ModuleType(name)
            shell.__path__ = [str(folder)]
            sys.modules[name] = shell
            shells.append(name)
    try:
        return {
            cls: getattr(importlib.import_module(f"kvpress.presses.{module}"), cls)
            for cls, module in PRESS_MODULES.items()
        }
    finally:
        for name in shells:  # a later `import kvpress` gets the real package
            del sys.modules[name]


def parity_model(arch: str, seed: int = 0, init: float = 0.1):
    """The tiny ``arch`` model of ``seed`` and initializer range ``init``; Qwen3's q_norm and k_norm weights
    drawn 1 + init N(0, 1) (left at 1, every layer-0 key has norm sqrt(D) and knorm would rank rounding)."""
    model = tiny_model(arch, seed=seed, initializer_range=init)
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            param.copy_(1 + init * torch.randn(param.shape, generator=generator))
    return model


def stream(kind: str, n: int = N_TOKENS) -> torch.Tensor:
    """``distinct``: no repeated token; ``repeated``: a block of 14 distinct tokens, repeated."""
    if kind == "distinct":
        return distinct_stream(n)
    return distinct_stream(14, seed=2).repeat(-(-n // 14))[:n]


@dataclass
class Boundary:
    """The engine at one boundary: its candidates, the policy's scores, what it kept."""

    now: int
    key_pos: torch.Tensor  # [L, H, S] (-1: empty)
    scores: torch.Tensor  # [L, H, S]
    kept: torch.Tensor | None = None  # [L, H, R] positions retained after the decision (-1: empty)


def run_engine(model, tokens: torch.Tensor, case: Case, policy=None) -> tuple[list[Boundary], int | None]:
    """Stream ``tokens`` under the case's policy; every boundary's candidates, scores and kept set."""
    policy = policy or make_policy({"name": case.name, **case.params}, budget=case.budget, chunk=CHUNK)
    engine = StreamingEngine(model, policy, positions="original", scope=case.scope)
    boundaries: list[Boundary] = []

    def before(memory, obs, now, scores):
        boundaries.append(Boundary(now, obs.key_pos.clone().cpu(), scores.detach().double().clone().cpu()))

    def after(memory, now, evicted):
        assert boundaries[-1].now == now
        boundaries[-1].kept = memory.retained_positions().clone().cpu()

    engine.stream(tokens, before_boundary=before, on_boundary=after)
    return boundaries, policy.score_digits


class ReplayCache:
    """The replay's cache for one chunk's pass: per layer the retained keys and values [1, H, n, D] (the
    replay's own), to which each attention layer's ``cache.update`` appends the chunk's."""

    def __init__(self, past: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        self.past, self.new = past, {}

    def update(self, keys, values, layer_idx, *args, **kwargs):
        self.new[layer_idx] = (keys, values)
        if layer_idx not in self.past:
            return keys, values
        old_keys, old_values = self.past[layer_idx]
        return torch.cat([old_keys, keys], dim=-2), torch.cat([old_values, values], dim=-2)


@dataclass
class ReplayState:
    """The press's inputs at one boundary, per layer."""

    now: int
    positions: torch.Tensor  # [L, H, n] the cache's positions, oldest first (retained, then the chunk)
    hidden: list  # per layer [1, C, hidden] the attention's input
    keys: list  # per layer [1, H, n, D]
    values: list
    attentions: list  # per layer [1, H_q, C, n]
    history: list  # per layer [1, H_q, now, now] attention paid by query s to position p so far
    position_embeddings: tuple


@contextlib.contextmanager
def eager(model):
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@torch.no_grad()
def replay(model, tokens: torch.Tensor, boundaries: list[Boundary]) -> list[ReplayState]:
    """The eager replay (module docstring): per boundary, the state a kvpress cache of the engine's
    retained positions plus the chunk holds, recomputed by the model's own modules."""
    layers = model.model.layers
    n = tokens.numel()
    keys_at: list[torch.Tensor | None] = [None] * len(layers)  # per layer [H, n, D] by position
    values_at: list[torch.Tensor | None] = [None] * len(layers)
    history: list[torch.Tensor | None] = [None] * len(layers)
    states = []
    retained = None  # [L, H, R] after the previous boundary
    with eager(model):
        full = model(tokens[None], use_cache=True)  # layer 0's keys are exact at every boundary
        first = model(tokens[None, :CHUNK], use_cache=True, output_attentions=True)
        for boundary in boundaries:
            now, start = boundary.now, boundary.now - CHUNK
            if retained is None:
                assert start == 0, "the first chunk is C tokens"
                past_pos = torch.empty(len(layers), layers[0].self_attn.config.num_key_value_heads, 0).long()
            else:
                counts = (retained >= 0).sum(-1)
                assert bool((counts == counts.flatten()[0]).all()), "every head retains as many entries"
                past_pos = retained.sort(dim=-1).values[..., -int(counts.flatten()[0]) :]
            chunk_pos = torch.arange(start, now)
            positions = torch.cat([past_pos, chunk_pos.expand(*past_pos.shape[:2], -1)], dim=-1)
            past: dict = {}
            for layer in range(len(layers)):
                if keys_at[layer] is not None:
                    index = past_pos[layer][..., None].expand(-1, -1, keys_at[layer].shape[-1])
                    past[layer] = tuple(
                        torch.gather(x, 1, index)[None] for x in (keys_at[layer], values_at[layer])
                    )
            n_past = past_pos.shape[-1]
            cache = ReplayCache(past)
            hidden = model.model.embed_tokens(tokens[None, start:now])
            embeddings = model.model.rotary_emb(hidden, chunk_pos[None])
            mask = torch.zeros(1, 1, CHUNK, n_past + CHUNK)
            mask[..., n_past:] = torch.full((CHUNK, CHUNK), float("-inf")).triu(1)
            inputs, weights = {}, {}
            hooks = []
            for layer, block in enumerate(layers):

                def grab(module, args, kwargs, layer=layer, inputs=inputs):
                    inputs[layer] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

                def keep(module, args, output, layer=layer, weights=weights):
                    weights[layer] = output[1]

                hooks.append(block.self_attn.register_forward_pre_hook(grab, with_kwargs=True))
                hooks.append(block.self_attn.register_forward_hook(keep))
            try:
                for block in layers:
                    hidden = block(hidden, attention_mask=mask, position_embeddings=embeddings, cache=cache)
            finally:
                for hook in hooks:
                    hook.remove()
            state = ReplayState(now, positions, [], [], [], [], [], embeddings)
            for layer in range(len(layers)):
                new_keys, new_values = cache.new[layer]
                if keys_at[layer] is None:
                    keys_at[layer] = new_keys.new_zeros(new_keys.shape[1], n, new_keys.shape[-1])
                    values_at[layer] = torch.zeros_like(keys_at[layer])
                    n_query = weights[layer].shape[1]
                    history[layer] = torch.zeros(1, n_query, n, n)
                keys_at[layer][:, start:now] = new_keys[0]
                values_at[layer][:, start:now] = new_values[0]
                layer_keys, layer_values = cache.past.get(
                    layer, (new_keys[..., :0, :], new_values[..., :0, :])
                )
                layer_keys = torch.cat([layer_keys, new_keys], dim=-2)
                layer_values = torch.cat([layer_values, new_values], dim=-2)
                attn = weights[layer]  # [1, H_q, C, n]
                group = attn.shape[1] // positions.shape[1]
                columns = positions[layer].repeat_interleave(group, dim=0)  # [H_q, n]
                history[layer][0, :, start:now].scatter_(-1, columns[:, None].expand(-1, CHUNK, -1), attn[0])
                state.hidden.append(inputs[layer])
                state.keys.append(layer_keys)
                state.values.append(layer_values)
                state.attentions.append(attn)
                state.history.append(history[layer][..., :now, :now].clone())
            _check_replay(state, full, first, start)
            states.append(state)
            retained = boundary.kept
    return states


def _check_replay(state: ReplayState, full, first, start: int) -> None:
    """The replay against plain eager forwards: every layer at the first boundary, layer 0 always."""
    reference = full.cache.layers[0].keys[0]  # [H, n, D]
    index = state.positions[0][..., None].expand(-1, -1, reference.shape[-1])
    torch.testing.assert_close(state.keys[0][0], torch.gather(reference, 1, index), rtol=1e-5, atol=1e-5)
    if start == 0:
        for layer, cached in enumerate(first.cache.layers):
            torch.testing.assert_close(state.keys[layer], cached.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(state.values[layer], cached.values, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(state.attentions[layer], first.attentions[layer], rtol=1e-5, atol=1e-6)


def expected_press(cls: type, args: dict, start: int, now: int):
    """ExpectedAttentionPress for the boundary ``now`` after a chunk that began at ``start``: its query
    statistics over the chunk's rows at positions >= n_sink and its rotation averaged from ``now``. At the
    first boundary (start 0, q_len = now) both are the press's own."""

    class AtBoundary(cls):
        def get_query_statistics(self, module, hidden_states):
            sinks = self.n_sink
            self.n_sink = max(0, sinks - start)
            try:
                return super().get_query_statistics(module, hidden_states)
            finally:
                self.n_sink = sinks

        def apply_avg_rope(self, module, mu, cov, q_len):
            return super().apply_avg_rope(module, mu, cov, now)

    return AtBoundary(**args)


@contextlib.contextmanager
def rotary_on(model):
    """``module.rotary_emb`` on every attention layer during the press calls (kvpress's pipeline sets it)."""
    for block in model.model.layers:
        block.self_attn.rotary_emb = model.model.rotary_emb
    try:
        yield
    finally:
        for block in model.model.layers:
            del block.self_attn.rotary_emb


@dataclass
class Row:
    case: Case
    arch: str
    model: tuple
    stream: str
    boundaries: int = 0
    decisions: int = 0  # (boundary, layer, KV head, attention given or computed)
    max_abs: float = 0.0
    max_rel: float = 0.0
    equal: int = 0
    ties: int = 0
    clear: list = field(default_factory=list)  # (now, layer, head, margin)
    kept_always: bool = True

    @property
    def ok(self) -> bool:
        return self.max_rel <= SCORE_TOLERANCE and not self.clear and self.kept_always


def press_scores(
    case: Case, presses: dict, model, state: ReplayState, layer: int, given: bool
) -> torch.Tensor:
    """The press's score [H, n] of one layer at one boundary (the cache's order)."""
    module = model.model.layers[layer].self_attn
    cls = presses[case.press]
    start = state.now - CHUNK
    if case.press == "ExpectedAttentionPress":
        press = expected_press(cls, case.press_args, start, state.now)
    else:
        press = cls(**case.press_args)
    kwargs = {"position_embeddings": state.position_embeddings}
    keys, values, attentions = state.keys[layer], state.values[layer], state.attentions[layer]
    if case.press == "ObservedAttentionPress":  # the stream's history (module docstring)
        attentions = state.history[layer]
        keys = keys.new_zeros(*keys.shape[:2], state.now, keys.shape[-1])
        values = keys
    with torch.no_grad():
        raw = press.score(module, state.hidden[layer], keys, values, attentions if given else None, kwargs)[0]
    if case.press == "ObservedAttentionPress":
        raw = torch.gather(raw, -1, state.positions[layer])
    return raw.double()


def compare(case: Case, model, tokens: torch.Tensor, presses: dict, policy=None, meta=("", (), "")) -> Row:
    """The press's scores and decisions against the policy's at every boundary of the stream."""
    boundaries, digits = run_engine(model, tokens, case, policy)
    states = replay(model, tokens, boundaries)
    margin_allowed = tie_margin(digits)
    row = Row(case, *meta, boundaries=len(boundaries))
    with rotary_on(model):
        for boundary, state in zip(boundaries, states, strict=True):
            for layer in range(len(model.model.layers)):
                positions = state.positions[layer]  # [H, n]
                key_pos, scores = boundary.key_pos[layer], boundary.scores[layer]
                order = torch.where(key_pos >= 0, key_pos, torch.iinfo(torch.long).max).argsort(dim=-1)
                valid = int((key_pos[0] >= 0).sum())
                order = order[:, :valid]
                assert torch.equal(torch.gather(key_pos, -1, order), positions), "the replay's candidates"
                ours = torch.gather(scores, -1, order)
                kept = torch.zeros_like(positions, dtype=torch.bool)
                for h in range(positions.shape[0]):
                    kept[h] = torch.isin(positions[h], boundary.kept[layer, h])
                for given in [True, False] if case.press in OWN_ATTENTION else [True]:
                    theirs = press_scores(case, presses, model, state, layer, given)
                    _judge(row, case, ours, theirs, kept, positions, boundary.now, layer, margin_allowed)
    return row


def _judge(row, case, ours, theirs, kept, positions, now, layer, margin_allowed) -> None:
    always = torch.isinf(ours)
    ranked = ~always
    difference = torch.where(ranked, (ours - theirs).abs(), 0.0)
    scale = torch.where(ranked, theirs.abs(), 0.0).amax(dim=-1).clamp(min=1e-30)
    row.max_abs = max(row.max_abs, float(difference.max()))
    row.max_rel = max(row.max_rel, float((difference.amax(dim=-1) / scale).max()))
    padded = case.press != "ObservedAttentionPress"
    for h in range(ours.shape[0]):
        row.decisions += 1
        if padded and bool(always[h].any()) and bool(ranked[h].any()):
            row.kept_always &= bool(theirs[h][always[h]].min() >= theirs[h][ranked[h]].max())
        if bool((always[h] & ~kept[h]).any()):  # the engine evicted what the policy always keeps
            row.clear.append((now, layer, h, float("-inf")))
            continue
        room = int(kept[h].sum()) - int(always[h].sum())  # the press's top B' - |always| of the rest
        top = torch.zeros_like(kept[h])
        top[torch.where(ranked[h], theirs[h], -torch.inf).topk(room).indices] = True
        if torch.equal(top | always[h], kept[h]):
            row.equal += 1
            continue
        judged = torch.where(always[h], torch.inf, theirs[h]).float()[None, None]
        margin = float(
            decision_margin(
                judged,
                positions[h][None, None],
                torch.ones_like(judged, dtype=torch.bool),
                kept[h][None, None],
            )
        )
        if margin >= -margin_allowed:
            row.ties += 1
        else:
            row.clear.append((now, layer, h, margin))


def sweep(cases=CASES, archs=ARCHS, models=MODELS, streams=STREAMS, progress=False) -> list[Row]:
    presses = load_presses()
    rows = []
    for arch in archs:
        for seed, init in models:
            model = parity_model(arch, seed, init)
            for kind in streams:
                tokens = stream(kind)
                for case in cases:
                    row = compare(case, model, tokens, presses, meta=(arch, (seed, init), kind))
                    rows.append(row)
                    if progress:
                        print(
                            f"{arch} seed={seed} init={init} {kind} {case.settings()}: rel {row.max_rel:.1e} "
                            f"equal {row.equal} ties {row.ties} clear {len(row.clear)}",
                            file=sys.stderr,
                        )
    return rows


def fast_rows() -> list[Row]:
    """The fast subset: tiny Llama (seed 0), the distinct stream, every press at its default."""
    return sweep([case for case in CASES if case.default], ("llama",), MODELS[:1], ("distinct",))


def cpu_name() -> str:
    """The CPU's model name (Linux), else the machine type."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def table(rows: list[Row], harness: list[Row], wall_s: float) -> str:
    by_case: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        by_case.setdefault((row.case.name, row.case.settings()), []).append(row)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    models = sorted({(row.arch, row.model) for row in rows})
    lines = [
        f"# kvpress parity: the policies against kvpress {KVPRESS_VERSION}'s own `score`, at every boundary",
        "",
        "`python -m checks.kvpress_parity --out results/bench/kvpress_parity.md` (the fast subset is checked "
        "by tests/test_kvpress_parity.py, the sweep by its slow test; the design is in the module's "
        f"docstring). Streams of {N_TOKENS} tokens in chunks of C={CHUNK} (boundaries at "
        f"{', '.join(str(t) for t in range(CHUNK, N_TOKENS, CHUNK))}), positions=original; the press's "
        "inputs from an eager replay of the model over the engine's retained positions plus the chunk "
        "(fully independent at the first boundary; later, the retained positions taken from the engine and "
        "everything else recomputed by the model's own modules). Models (tiny, fp32, CPU): "
        + ", ".join(f"{arch} (seed {seed}, init range {init})" for arch, (seed, init) in models)
        + f"; streams: {', '.join(STREAMS)} (a 14-token block repeated). "
        f"Machine: {cpu_name()}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__} ({torch.get_num_threads()} threads), load average {load:.1f}; "
        f"{wall_s:.0f} s.",
        "",
        "Score difference: the largest |policy - press| over a (layer, KV head) divided by the largest "
        f"|press score| there (must be at most {SCORE_TOLERANCE:.0e}), over every boundary, layer, model "
        "and stream; the largest absolute difference beside it. Decisions: one per (boundary, layer, KV "
        "head, and for SnapKV and TOVA attention given or computed by the press); kept sets equal, tie (the "
        "sets differ, but the engine's set is within tie_margin = 1e-4 relative of the press's top B' by the "
        "press's own scores: the harness keeps the more recent, kvpress's topk picks arbitrarily), or "
        "clear difference (a failure).",
        "",
        "| policy | press | settings | runs | max rel. score difference | max abs. | decisions "
        "| equal | ties | clear differences | verdict |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for (name, settings), group in by_case.items():
        policy, press = settings.split(" | ")
        decisions = sum(r.decisions for r in group)
        equal = sum(r.equal for r in group)
        ties = sum(r.ties for r in group)
        clear = sum(len(r.clear) for r in group)
        verdict = "ok" if all(r.ok for r in group) else "FAIL"
        lines.append(
            f"| {name} | {press} | {policy} | {len(group)} | {max(r.max_rel for r in group):.1e} "
            f"| {max(r.max_abs for r in group):.1e} | {decisions} | {equal} | {ties} | {clear} | {verdict} |"
        )
    lines += ["", "Per press, the largest relative score difference over all its settings and runs:", ""]
    per_press: dict[str, float] = {}
    for row in rows:
        per_press[row.case.press] = max(per_press.get(row.case.press, 0.0), row.max_rel)
    lines += [f"- {press}: {value:.1e}" for press, value in per_press.items()]
    if harness:
        lines += [
            "",
            "The harness's own definitions (the defaults, sizes as the press's default rows; tiny Llama seed "
            "0, distinct stream): informational, they differ by design (docs/semantics.md, \"kvpress's "
            'presses: `policy.variant`"); "clear" counts the decisions the press\'s scores rank otherwise.',
            "",
            "| policy | press | settings | max rel. score difference | decisions | equal | ties | clear |",
            "|---|---|---|---:|---:|---:|---:|---:|",
        ]
        for row in harness:
            policy, press = row.case.settings().split(" | ")
            lines.append(
                f"| {row.case.name} | {press} | {policy} | {row.max_rel:.1e} | {row.decisions} | {row.equal} "
                f"| {row.ties} | {len(row.clear)} |"
            )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="write the table to this file")
    parser.add_argument("--fast", action="store_true", help="the fast subset only")
    args = parser.parse_args(argv)
    begin = time.perf_counter()
    rows = fast_rows() if args.fast else sweep(progress=True)
    harness = sweep(HARNESS, ("llama",), MODELS[:1], ("distinct",))
    text = table(rows, harness, time.perf_counter() - begin)
    print(text)
    if args.out is not None:
        atomic_write_text(args.out, text)
    return 0 if all(row.ok for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
