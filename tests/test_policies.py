"""Every policy against the token-by-token physical-eviction reference, plus policy invariants."""

from __future__ import annotations

import itertools

import pytest
import torch

from rmm.engine import StreamingEngine
from rmm.future import record_future
from rmm.policies import POLICIES, make_policy
from rmm.reference import POSITION_RULES, SCORE_POLICIES, ReferenceSpec, reference_stream

BUDGET = 12
CASES = [
    ("full", {}),
    ("window", {}),
    ("streaming_llm", {"sinks": 2}),
    ("h2o", {}),
    ("h2o", {"rho": 0.0}),
    ("rmm", {"lag": 3}),
    ("rmm", {"lag": 3, "weight": "prob"}),
    ("rmm", {"lag": 3, "weight": "uniform"}),
    ("rmm", {"lag": 3, "after_commit": "freeze"}),
    ("rmm", {"lag": 5, "weight": "prob", "after_commit": "freeze"}),
    ("rmm", {"lag": 0, "weight": "uniform", "after_commit": "freeze"}),
    ("tova", {}),
    ("random", {}),
    ("oracle", {}),
    ("oracle", {"variant": "future_mass"}),
    ("observed_attention", {}),
    ("observed_attention", {"rho": 0.25}),
    ("snapkv", {"window": 2, "kernel": 3, "pooling": "avg"}),
    ("snapkv", {"window": 3, "kernel": 5, "pooling": "max"}),
    ("knorm", {}),
    ("keydiff", {}),
    ("lru", {}),
    ("lru", {"tau": 0.2}),
    ("lagkv", {"partition": 3, "sinks": 1}),
    ("lagkv", {"partition": 2, "sinks": 0}),
]


def run_engine(
    model,
    tokens,
    name,
    params,
    budget=BUDGET,
    chunk=1,
    positions="original",
    scope="head",
    on_boundary=None,
    observer=None,
):
    policy = make_policy({"name": name, **params}, budget=budget, chunk=chunk)
    policy.prepare(tokens, lambda stream: record_future(model, stream, tau=0.02, context=1024))
    engine = StreamingEngine(model, policy, positions=positions, scope=scope)
    return engine.stream(tokens, observer=observer, on_boundary=on_boundary)


def retained_sets(model, tokens, name, params, **kwargs) -> dict[int, list]:
    """R_now per boundary as nested lists [L][H] of sorted positions."""
    sets = {}

    def hook(memory, now, evicted):
        pos = memory.retained_positions()
        sets[now] = [[sorted(p for p in head.tolist() if p >= 0) for head in layer] for layer in pos]

    result = run_engine(model, tokens, name, params, on_boundary=hook, **kwargs)
    return result, sets


def test_every_policy_has_a_reference_rule_and_a_case():
    assert set(POLICIES) <= set(POSITION_RULES) | set(SCORE_POLICIES), "a policy lacks a reference rule"
    assert set(POLICIES) <= {name for name, _ in CASES}, "a policy is missing from the reference matrix"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt_neox"])
@pytest.mark.parametrize(
    ("name", "params"), CASES, ids=[f"{n}-{'-'.join(map(str, p.values()))}" for n, p in CASES]
)
def test_engine_matches_reference(tiny_models, tokens, distinct_tokens, arch, name, params):
    model = tiny_models[arch]
    if "keys" in POLICIES[name].needs:  # repeated tokens have equal layer-0 keys: see docs/semantics.md
        tokens = distinct_tokens
    for chunk, positions in itertools.product([1, 4], ["original", "cache"]):
        if name in ("rmm",) and params["lag"] >= BUDGET - chunk + 1:
            continue
        spec = ReferenceSpec(policy=name, budget=BUDGET, chunk=chunk, positions=positions, **params)
        ref_nll, ref_correct = reference_stream(model, tokens, spec)
        result, sets = retained_sets(model, tokens, name, params, chunk=chunk, positions=positions)
        torch.testing.assert_close(
            result.nll, ref_nll, rtol=0, atol=1e-4, msg=f"{name} chunk={chunk} positions={positions}"
        )
        assert torch.equal(result.correct, ref_correct)
        if name != "full":
            for now, engine_set in sets.items():
                assert engine_set == spec.retained_log[now], f"R_{now} differs ({positions}, chunk={chunk})"


@pytest.mark.parametrize("scope", ["layer", "global"])
@pytest.mark.parametrize(
    ("name", "params"),
    [("h2o", {}), ("rmm", {"lag": 2}), ("oracle", {}), ("oracle", {"variant": "future_mass"})],
)
def test_shared_scope_matches_reference(tiny_models, tokens, scope, name, params):
    model = tiny_models["llama"]
    spec = ReferenceSpec(policy=name, budget=BUDGET, chunk=2, scope=scope, **params)
    ref_nll, _ = reference_stream(model, tokens, spec)
    result, sets = retained_sets(model, tokens, name, params, chunk=2, scope=scope)
    torch.testing.assert_close(result.nll, ref_nll, rtol=0, atol=1e-4)
    for now, engine_set in sets.items():
        layers = engine_set if scope == "layer" else [sum(engine_set, [])]
        assert all(head == layer[0] for layer in layers for head in layer), "heads must share one set"
        assert engine_set == spec.retained_log[now]


@pytest.mark.parametrize("chunk", [1, 4])
def test_rmm_uniform_accumulate_is_h2o(tiny_models, tokens, chunk):
    model = tiny_models["llama"]
    capacity = BUDGET - chunk + 1
    rho = 0.5
    lag = int(rho * capacity)
    h2o, h2o_sets = retained_sets(model, tokens, "h2o", {"rho": rho}, chunk=chunk)
    rmm, rmm_sets = retained_sets(model, tokens, "rmm", {"lag": lag, "weight": "uniform"}, chunk=chunk)
    assert h2o_sets == rmm_sets
    assert torch.equal(h2o.nll, rmm.nll)


@pytest.mark.parametrize(("name", "params"), CASES[1:])
def test_budget_beyond_stream_equals_full(tiny_models, tokens, name, params):
    model = tiny_models["qwen2"]
    full = run_engine(model, tokens, "full", {})
    bounded = run_engine(model, tokens, name, params, budget=tokens.numel() + 8, chunk=4)
    torch.testing.assert_close(bounded.nll, full.nll, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("name", "params"), CASES[1:])
@pytest.mark.parametrize("chunk", [1, 5])
def test_budget_and_permanent_eviction(tiny_models, tokens, name, params, chunk):
    """|R_t| <= B for every query, and once a position leaves R it never returns."""
    if name == "rmm" and params["lag"] >= BUDGET - chunk + 1:
        pytest.skip("lag does not fit this chunk")
    seen_by: dict[tuple[int, int, int], list[int]] = {}  # (layer, head, key) -> queries that attended it

    def observer(attn, key_pos, query_pos):
        for q, t in enumerate(query_pos.tolist()):
            visible = (attn[:, :, q] > 0) & (key_pos != t) & (key_pos >= 0)
            assert int(visible.sum(-1).max()) <= BUDGET, f"query {t} attended more than B entries"
            for layer, head, slot in torch.nonzero(visible).tolist():
                seen_by.setdefault((layer, head, key_pos[layer, head, slot].item()), []).append(t)

    result = run_engine(tiny_models["llama"], tokens, name, params, chunk=chunk, observer=observer)
    for (_, _, key), queries in seen_by.items():
        assert queries == list(range(key + 1, queries[-1] + 1)), f"key {key} left memory and came back"
    assert result.evicted_count > 0, "the test stream must force evictions"


@pytest.mark.parametrize("chunk", [1, 4])
def test_rmm_provisional_buffer_never_evicted(tiny_models, tokens, chunk):
    lag = 5

    def hook(memory, now, evicted):
        recent = torch.arange(max(0, now - lag), now)
        assert not torch.isin(evicted, recent).any(), f"a buffered position was evicted at {now}"
        pos = memory.retained_positions()
        assert all(
            torch.isin(recent, pos[l_, h_]).all() for l_ in range(pos.shape[0]) for h_ in range(pos.shape[1])
        )

    run_engine(tiny_models["llama"], tokens, "rmm", {"lag": lag}, chunk=chunk, on_boundary=hook)


def test_oracle_evicts_the_furthest_requests(tiny_models, tokens):
    """Belady: every evicted candidate is requested no sooner than every kept one."""
    model = tiny_models["mistral"]
    policy = make_policy({"name": "oracle"}, budget=BUDGET, chunk=3)
    policy.prepare(tokens, lambda stream: record_future(model, stream, tau=0.02, context=1024))
    checked = []

    def hook(memory, now, evicted):
        kept = memory.retained_positions()
        next_kept = policy.future.next_request(kept, now).masked_fill(kept < 0, -1)
        next_evicted = policy.future.next_request(evicted, now).masked_fill(evicted < 0, tokens.numel() + 1)
        assert (next_kept.amax(-1) <= next_evicted.amin(-1)).all(), f"oracle kept a later request at {now}"
        checked.append(bool((evicted >= 0).any()))

    StreamingEngine(model, policy).stream(tokens, on_boundary=hook)
    assert any(checked)
