"""The policies named after kvpress presses against the presses' own ``score`` (checks/kvpress_parity.py).

At every chunk boundary of a multi-chunk stream each press's ``score``, called on an eager replay of the
model over the engine's retained positions plus the chunk, must equal the policy's scores to rounding
(relative 1e-5), and the engine's kept set must be the press's top B' or tie with it within the tie margin
(ties reported, never failures). The fast subset is one model, every press at its default; the sweep over
architectures (Llama, Qwen2, Qwen3), seeds, init ranges, streams and settings is slow. A perturbation of
one slot's score by 1e-3 relative must fail the check. kvpress 0.5.5 is installed by ``make setup``
(without its dependencies).
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from checks import kvpress_parity as parity
from rmm.config import check_run
from rmm.files import config_dir
from rmm.planning import recording_plan
from rmm.policies import POLICIES, make_policy

DEFAULTS = [case for case in parity.CASES if case.default]


@functools.cache
def presses() -> dict[str, type]:
    return parity.load_presses()


@functools.cache
def model(arch: str = "llama", seed: int = 0, init: float = 0.1):
    return parity.parity_model(arch, seed, init)


def check(case, arch="llama", seed=0, init=0.1, kind="distinct") -> parity.Row:
    return parity.compare(
        case, model(arch, seed, init), parity.stream(kind), presses(), meta=(arch, (seed, init), kind)
    )


def explain(row: parity.Row) -> str:
    return (
        f"{row.arch} {row.model} {row.stream} {row.case.settings()}: score difference {row.max_rel:.2e} "
        f"(abs {row.max_abs:.2e}), clear differences (boundary, layer, head, margin) {row.clear[:5]}, "
        f"kept_always {row.kept_always}"
    )


def test_every_press_named_policy_has_cases():
    names = {"knorm", "keydiff", "lagkv", "snapkv", "tova", "observed_attention", "expected_attention"}
    assert {case.name for case in parity.CASES} == {case.name for case in DEFAULTS} == names
    assert all(case.pressed for case in parity.CASES)
    assert {case.press for case in parity.CASES} == set(parity.PRESS_MODULES)
    assert "qwen3" in parity.ARCHS and len(parity.ARCHS) >= 3
    assert len(range(parity.CHUNK, parity.N_TOKENS, parity.CHUNK)) >= 3  # boundaries


@pytest.mark.parametrize("case", DEFAULTS, ids=[case.name for case in DEFAULTS])
def test_press_at_every_boundary(case):
    row = check(case)
    assert row.boundaries == len(range(parity.CHUNK, parity.N_TOKENS, parity.CHUNK))
    assert row.ok, explain(row)


@pytest.mark.slow
@pytest.mark.parametrize("arch", parity.ARCHS)
def test_sweep(arch):
    """Every case, both models (seed, init range), both streams: no clear difference, scores to rounding."""
    rows = parity.sweep(archs=(arch,))
    failed = [explain(row) for row in rows if not row.ok]
    assert not failed, "\n".join(failed)
    assert sum(row.ties for row in rows if row.case.name == "lagkv") > 0  # lagkv's budgets do tie


def perturb(monkeypatch, name: str, how) -> None:
    """Replace the policy's scores by ``how(scores, obs)`` at every boundary."""
    cls = POLICIES[name]
    original = cls.score

    def score(self, state, obs, now):
        return how(original(self, state, obs, now).clone(), obs)

    monkeypatch.setattr(cls, "score", score)


def one_slot(scores: torch.Tensor, obs) -> torch.Tensor:
    """The largest finite score of the last layer's first KV head times (1 + 1e-3)."""
    layer = scores[-1, 0]
    finite = torch.where(torch.isfinite(layer) & (obs.key_pos[-1, 0] >= 0), layer.abs(), -1.0)
    layer[finite.argmax()] *= 1 + 1e-3
    return scores


@pytest.mark.parametrize("case", DEFAULTS, ids=[case.name for case in DEFAULTS])
def test_a_slight_perturbation_fails(case, monkeypatch):
    """One slot's score off by 1e-3 relative (a regression far below any decision's usual margin) fails."""
    perturb(monkeypatch, case.name, one_slot)
    row = check(case)
    assert not row.ok and row.max_rel > 100 * parity.SCORE_TOLERANCE, explain(row)


def test_a_clear_difference_in_the_kept_sets_fails(monkeypatch):
    """With the score comparison switched off, a policy that keeps the largest norms (knorm's score
    negated) still fails: its kept sets clearly differ from the press's (a tie would not)."""
    perturb(monkeypatch, "knorm", lambda scores, obs: -scores)
    monkeypatch.setattr(parity, "SCORE_TOLERANCE", float("inf"))
    row = check(DEFAULTS[0])
    assert row.clear and not row.ok
    assert all(margin < -parity.tie_margin(None) for *_, margin in row.clear)


def test_ties_are_reported_not_failed():
    """Repeated tokens: knorm's equal layer-0 norms tie (the harness keeps the more recent); reported."""
    row = check(DEFAULTS[0], kind="repeated")
    assert row.ok and row.ties > 0, explain(row)


def test_presses_load_without_kvpress_patching_transformers():
    """The press modules load without kvpress's package __init__, which would wrap every attention
    function of transformers (kvpress.attention_patch) for the whole test session."""
    loaded = presses()
    assert set(loaded) == set(parity.PRESS_MODULES)
    wrapped = [name for name, fn in ALL_ATTENTION_FUNCTIONS.items() if "attention_patch" in fn.__qualname__]
    assert not wrapped, f"kvpress wrapped transformers' attention functions {wrapped}"
    assert "kvpress" not in sys.modules, "a shell package must not shadow a later `import kvpress`"


@pytest.mark.parametrize("name", ["keydiff", "lagkv"])
def test_keys_as_cached_need_original_positions(name):
    """keydiff's and lagkv's kvpress variants score the keys the cache holds (rotated at their positions):
    the memory's own keys under positions=original, no unrotated copy; positions=cache is refused."""
    policy = make_policy(
        {"name": name, "variant": "kvpress", "partition": 4, "sinks": 1}
        if name == "lagkv"
        else {"name": name, "variant": "kvpress"},
        budget=64,
        chunk=8,
    )
    assert policy.cached_keys and not recording_plan(policy, "original").raw_keys
    assert recording_plan(make_policy({"name": name}, budget=64, chunk=8), "original").raw_keys
    with pytest.raises(ValueError, match="use positions=original"):
        recording_plan(policy, "cache")
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        pressed = [f"policy={name}", "policy.variant=kvpress"]
        with pytest.raises(ValueError, match="use positions=original"):
            check_run(compose("config", overrides=[*pressed, "positions=cache"]))
        check_run(compose("config", overrides=[*pressed, "positions=original"]))
        default = compose("config", overrides=[f"policy={name}"])
        assert compose("config", overrides=pressed).run_name == default.run_name.replace(
            "_B", "_kvpress_B", 1
        )


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"name": "tova", "variant": "press"}, "policy.variant must be one of"),
        ({"name": "knorm", "variant": "kv"}, "policy.variant must be one of"),
        ({"name": "snapkv", "variant": "kvpress", "pooling": "max"}, "set policy.pooling=avg"),
    ],
)
def test_bad_variants_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        make_policy(params, budget=64, chunk=8)


def test_defaults_are_the_harness_variant():
    """Every kvpress-named policy defaults to the harness's own definition (committed runs unchanged)."""
    for case in DEFAULTS:
        if case.params.get("variant") != "kvpress":  # expected_attention has no other variant
            continue
        assert make_policy({"name": case.name}, budget=64, chunk=8).variant == "harness"
