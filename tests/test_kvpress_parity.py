"""The ``variant=kvpress`` policies against kvpress's own presses (checks/kvpress_parity.py).

At the engine's first boundary (a kvpress prefill of C tokens) each press's ``score``, called on inputs
built from the engine's memory, must equal the policy's scores to rounding, and its top B' must be the set
the engine kept. kvpress 0.5.5 is installed by ``make setup`` (without its dependencies).
"""

from __future__ import annotations

import functools
import sys

import pytest
from hydra import compose, initialize_config_dir
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from checks import kvpress_parity as parity
from rmm.config import check_run, config_dir
from rmm.matrix import distinct_stream, tiny_model
from rmm.policies import make_policy
from rmm.recording import recording_plan

ARCHS = ["llama", "qwen2"]  # two of the architectures kvpress supports (Llama's and Qwen2's attention)
PRESSED = [case for case in parity.CASES if case.variant == "kvpress"]


@functools.cache
def presses() -> dict[str, type]:
    return parity.load_presses()


@functools.cache
def model(arch: str):
    return tiny_model(arch)


def test_every_kvpress_named_policy_has_a_kvpress_case():
    assert (
        {case.name for case in PRESSED}
        == {case.name for case in parity.CASES}
        == {"knorm", "keydiff", "lagkv", "snapkv", "tova", "observed_attention"}
    )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", PRESSED, ids=[case.name for case in PRESSED])
def test_kvpress_variant_scores_and_keeps_as_the_press(arch, case):
    row = parity.compare(case, model(arch), distinct_stream(parity.CHUNK + 8), presses())
    assert row["max_diff"] <= parity.SCORE_TOLERANCE, f"{arch} {case.settings()}: {row['max_diff']:.2e}"
    assert row["kept_always"], f"{arch} {case.settings()}: the policy always keeps what the press may evict"
    assert row["kept_equal"], (
        f"{arch} {case.settings()}: kept sets differ in (layer, head) {row['mismatched']}"
    )


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
    for case in PRESSED:
        assert make_policy({"name": case.name}, budget=64, chunk=8).variant == "harness"
