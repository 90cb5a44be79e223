"""The policies named after kvpress presses against the presses' own ``score`` methods, on the same state.

    python -m checks.kvpress_parity [--out results/bench/kvpress_parity.md]

The state is the engine's first boundary of a stream (rmm.engine.StreamingEngine.stream, positions
original): after the first chunk of C tokens, the candidate slots hold exactly what a kvpress prefill of
those C tokens caches. From the engine's memory at that boundary (a ``before_boundary`` hook) the press's
inputs are built per layer: ``module`` the model's attention layer, ``hidden_states`` its input in that
pass, ``keys`` and ``values`` the memory's slots as cached (rotated by the model at their positions),
``attentions`` the per-head eager attention of the chunk's queries as the engine's attention function
received them (their group sums equal the attention the engine recorded: checked), ``kwargs`` the layer's
call arguments (``position_embeddings``). The press's ``score`` [1, H, C] is compared with the policy's
scores [L, H, S] at those slots, and the press's top B' (``topk``, B' = B - C + 1) with the set the engine
kept at the boundary (an ``on_boundary`` hook).

kvpress (0.5.5, installed by ``make setup`` without its dependencies) is imported press module by press
module: ``import kvpress`` runs its package ``__init__``, which imports every press (some need packages the
harness does not install) and wraps every attention function of transformers for the whole process.

Scores the policy keeps unconditionally (infinite: snapkv's window, tova's latest key) are compared as
kept: the press's score there must be its largest. Every other score is compared as a number, and "max
score difference" is the largest |policy - press| over them, in the press's own scale. tests/
test_kvpress_parity.py requires, for every ``variant=kvpress`` row, a difference within rounding and equal
kept sets; the ``harness`` rows show what the defaults change.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rmm.engine import StreamingEngine
from rmm.files import atomic_write_text
from rmm.matrix import distinct_stream, tiny_model
from rmm.policies import make_policy

KVPRESS_VERSION = "0.5.5"
PRESS_MODULES = {
    "KnormPress": "knorm_press",
    "KeyDiffPress": "keydiff_press",
    "LagKVPress": "lagkv_press",
    "SnapKVPress": "snapkv_press",
    "TOVAPress": "tova_press",
    "ObservedAttentionPress": "observed_attention_press",
}
CHUNK = 32  # C: the prefill the press sees
SCORE_TOLERANCE = 1e-5  # |policy - press|, float32 scores of O(1) (measured: below 1e-6)


@dataclass(frozen=True)
class Case:
    """One comparison: the policy (name, parameters), the press (class, arguments), the budget B."""

    name: str
    params: dict
    press: str
    press_args: dict = field(default_factory=dict)
    budget: int = CHUNK + 15  # B' = 16 of the 32 prefilled entries

    @property
    def variant(self) -> str:
        return self.params.get("variant", "harness")

    def settings(self) -> str:
        policy = ", ".join(f"{k}={v}" for k, v in self.params.items()) or "defaults"
        press = ", ".join(f"{k}={v}" for k, v in self.press_args.items())
        return f"{policy}; B={self.budget}, C={CHUNK} (B'={self.budget - CHUNK + 1}) | {self.press}({press})"


# every policy named after a press: its default (with the sizes the tiny prefill needs) and variant=kvpress
CASES = [
    Case("knorm", {}, "KnormPress"),
    Case("knorm", {"variant": "kvpress"}, "KnormPress"),
    Case("keydiff", {}, "KeyDiffPress"),
    Case("keydiff", {"variant": "kvpress"}, "KeyDiffPress"),
    # 2 scored partitions of 8 (positions 4-19), sinks 4 and a tail of 12 kept: B' = 20 keeps the two
    # best-ranked of each partition (no tie at the cut)
    Case("lagkv", {"partition": 8, "sinks": 4}, "LagKVPress", {"n_sink": 4, "lag_size": 8}, CHUNK + 19),
    Case(
        "lagkv",
        {"partition": 8, "sinks": 4, "variant": "kvpress"},
        "LagKVPress",
        {"n_sink": 4, "lag_size": 8},
        CHUNK + 19,
    ),
    Case("snapkv", {"window": 8, "kernel": 5}, "SnapKVPress", {"window_size": 8, "kernel_size": 5}),
    Case(
        "snapkv",
        {"window": 8, "kernel": 5, "variant": "kvpress"},
        "SnapKVPress",
        {"window_size": 8, "kernel_size": 5},
    ),
    Case("tova", {}, "TOVAPress"),
    Case("tova", {"variant": "kvpress"}, "TOVAPress"),
    Case("observed_attention", {}, "ObservedAttentionPress"),
    Case("observed_attention", {"rho": 0.0, "variant": "kvpress"}, "ObservedAttentionPress"),
]


def load_presses() -> dict[str, type]:
    """The six press classes, from kvpress's own modules, without running ``kvpress/__init__.py``."""
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


@dataclass
class State:
    """What the engine held at its first boundary, per layer, and what it did there."""

    inputs: dict[int, dict] = field(default_factory=dict)  # layer -> hidden_states, kwargs
    queries: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [H, G, C, D] as rotated
    keys: torch.Tensor | None = None  # [L, H, C, D] as cached
    values: torch.Tensor | None = None
    recorded: torch.Tensor | None = None  # [L, H, C, C] the group-summed attention the engine recorded
    scores: torch.Tensor | None = None  # [L, H, C] the policy's
    kept: list | None = None  # [L][H] the positions kept


def first_boundary(model, tokens: torch.Tensor, name: str, params: dict, budget: int) -> State:
    """Stream ``tokens`` under the policy and record the engine's state at its first boundary (now = C)."""
    policy = make_policy({"name": name, **params}, budget=budget, chunk=CHUNK)
    engine = StreamingEngine(model, policy, positions="original")
    engine.self_check(tokens)  # its probe passes first, so that the hooks below see only the stream
    state = State()
    hooks = []
    for layer, block in enumerate(model.model.layers):

        def grab(module, args, kwargs, layer=layer):
            if layer not in state.inputs:  # the first chunk's pass
                hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                state.inputs[layer] = {"hidden_states": hidden.detach().clone(), "kwargs": dict(kwargs)}

        hooks.append(block.self_attn.register_forward_pre_hook(grab, with_kwargs=True))
    make_memory = engine.new_memory

    def new_memory(n_tokens, plan):
        memory = make_memory(n_tokens, plan)
        memory.capture = lambda layer, q, k: state.queries.setdefault(layer, q.detach().clone())
        return memory

    def before(memory, obs, now, scores):
        if now != CHUNK:
            return
        start = memory.retained  # the chunk's slots: positions 0..C-1, nothing retained before them
        assert obs.key_pos[..., start:].eq(torch.arange(CHUNK)).all() and obs.key_pos[..., :start].lt(0).all()
        state.keys = memory.keys[:, :, start:].clone()
        state.values = memory.values[:, :, start:].clone()
        state.recorded = memory.chunk_attention()[..., start:].clone() if memory.record_attention else None
        state.scores = scores[..., start:].clone()

    def after(memory, now, evicted):
        if now == CHUNK:
            state.kept = [
                [sorted(p for p in head.tolist() if p >= 0) for head in layer]
                for layer in (memory.retained_positions().cpu())
            ]

    engine.new_memory = new_memory
    try:
        engine.stream(tokens, before_boundary=before, on_boundary=after)
    finally:
        for hook in hooks:
            hook.remove()
    return state


def eager_attention(module, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The per-head attention [1, n_heads, C, C] of a causal prefill: query [H, G, C, D] as the model
    rotated it, keys [H, C, D] as cached (query head h * G + g belongs to KV head h, as ``repeat_kv``)."""
    n_kv, group, n, dim = query.shape
    logits = torch.matmul(query.float(), keys.float()[:, None].transpose(-1, -2)) * module.scaling
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    logits = logits.masked_fill(~causal, float("-inf"))
    return torch.softmax(logits, dim=-1).reshape(1, n_kv * group, n, n)


# presses that compute their window's attention themselves (from hidden_states and position_embeddings)
# when given none: scored both ways
OWN_ATTENTION = ("SnapKVPress", "TOVAPress")


def compare(case: Case, model, tokens: torch.Tensor, presses: dict[str, type]) -> dict:
    """The press's scores and top-B' sets against the policy's at the engine's first boundary."""
    state = first_boundary(model, tokens, case.name, case.params, case.budget)
    press = presses[case.press](**case.press_args)
    capacity = case.budget - CHUNK + 1
    worst, mismatched, kept_agree = 0.0, set(), True
    for layer, block in enumerate(model.model.layers):
        module = block.self_attn
        attentions = eager_attention(module, state.queries[layer], state.keys[layer])
        if state.recorded is not None:  # the engine's own attention is the prefill's, group summed
            summed = attentions[0].unflatten(0, state.queries[layer].shape[:2]).sum(dim=1)
            torch.testing.assert_close(summed, state.recorded[layer], rtol=0, atol=1e-5)
        inputs = state.inputs[layer]
        ours = state.scores[layer].double()
        kept_always = torch.isinf(ours)
        for given in [attentions, None] if case.press in OWN_ATTENTION else [attentions]:
            with torch.no_grad():
                raw = press.score(
                    module,
                    inputs["hidden_states"],
                    state.keys[layer][None],
                    state.values[layer][None],
                    given,
                    inputs["kwargs"],
                )[0]
            theirs = raw.double()
            top = theirs.max(dim=-1, keepdim=True).values.expand_as(theirs)
            kept_agree &= bool((theirs[kept_always] == top[kept_always]).all())  # the press's largest too
            worst = max(worst, float((ours[~kept_always] - theirs[~kept_always]).abs().max()))
            chosen = raw.topk(capacity, dim=-1).indices.sort(dim=-1).values.tolist()
            mismatched |= {(layer, h) for h, kept in enumerate(chosen) if kept != state.kept[layer][h]}
    return {
        "case": case,
        "max_diff": worst,
        "kept_equal": not mismatched,
        "mismatched": sorted(mismatched),
        "kept_always": kept_agree,
    }


def parity_rows(arch: str = "llama", n_tokens: int = CHUNK + 8) -> list[dict]:
    """Every case of :data:`CASES` on the tiny ``arch`` model over a stream of distinct tokens."""
    presses = load_presses()
    model, tokens = tiny_model(arch), distinct_stream(n_tokens)
    return [compare(case, model, tokens, presses) for case in CASES]


def table(rows: list[dict], arch: str = "llama") -> str:
    shape = tiny_model(arch).config
    lines = [
        f"# kvpress parity: the policies against kvpress {KVPRESS_VERSION}'s own `score`",
        "",
        f"`python -m checks.kvpress_parity --out results/bench/kvpress_parity.md` (also checked by "
        f"tests/test_kvpress_parity.py). State: the engine's first boundary = a kvpress prefill of C={CHUNK} "
        f"distinct tokens, tiny random {arch} ({shape.num_hidden_layers} layers, "
        f"{shape.num_attention_heads} query heads, {shape.num_key_value_heads} KV heads, fp32, CPU), "
        "positions=original. Max score difference: largest |policy - press| over the scores both compute "
        "(the policy's always-kept entries excluded; in every `variant=kvpress` row the press scores them "
        "highest too). Kept sets: the "
        "engine's kept set at the boundary against the press's top-B' (`topk`), every (layer, KV head). "
        "SnapKVPress and TOVAPress are scored twice: given the attention, and computing their window's "
        "attention themselves from the layer's hidden states (`attentions=None`).",
        "",
        "| policy | press | settings | max score difference | kept sets equal |",
        "|---|---|---|---:|---|",
    ]
    for row in rows:
        case = row["case"]
        policy, press = case.settings().split(" | ")
        kept = "yes" if row["kept_equal"] else f"no ({len(row['mismatched'])} of (layer, head))"
        lines.append(f"| {case.name} | {press} | {policy} | {row['max_diff']:.1e} | {kept} |")
    lines += [
        "",
        "The `harness` rows are the defaults (window, partition and sinks sized to the prefill), their "
        "score differences in each definition's own scale (tova's 1.0: the press's maximum + 1 on the "
        "latest key, which the default ranks); what each default changes: docs/semantics.md, \"kvpress's "
        'presses: `policy.variant`".',
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", default="llama", help="the tiny model (rmm.matrix.ARCHITECTURES)")
    parser.add_argument("--out", type=Path, help="write the table to this file")
    args = parser.parse_args(argv)
    text = table(parity_rows(args.arch), args.arch)
    print(text)
    if args.out is not None:
        atomic_write_text(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
