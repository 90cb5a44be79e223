"""``model.repeat_kv`` (rmm/kv_heads.py): a GQA model rewritten with one KV head per query head computes
the same function, runs restkv's official variant (one selection per query head, as its authors' code)
exactly against the reference, and a layout it cannot rewrite is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from checks.matrix import sampled_stream, tiny_model
from rmm.engine import StreamingEngine, retained_sets_recorder
from rmm.errors import UnsupportedModelError
from rmm.kv_heads import repeat_kv_heads
from rmm.model_config import describe_model
from rmm.models import load_model
from rmm.policies import make_policy
from rmm.reference import ReferenceSpec, reference_stream

BUDGET, LENGTH, CHUNK = 8, 24, 4
NLL_ATOL = 5e-6  # as tests/test_policies.py
LOGIT_ATOL = 1e-5  # the same products summed in another order at most (fp32)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_repeated_model_computes_the_same_function(arch):
    model = tiny_model(arch)
    repeated = repeat_kv_heads(copy.deepcopy(model))
    shape, new = describe_model(model), describe_model(repeated)
    assert shape["n_kv_heads"] < shape["n_heads"], "the test needs a GQA model"
    assert new["n_kv_heads"] == new["n_heads"] == shape["n_heads"]
    tokens = sampled_stream(model, LENGTH)[None]
    for implementation in ("sdpa", "eager"):
        model.set_attn_implementation(implementation)
        repeated.set_attn_implementation(implementation)
        torch.testing.assert_close(repeated(tokens).logits, model(tokens).logits, rtol=0, atol=LOGIT_ATOL)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("positions", ["original", "cache"])
def test_official_restkv_on_a_repeated_gqa_model_matches_reference(arch, positions):
    model = tiny_model(arch)
    params = {"variant": "official", "window": 2}
    policy = make_policy({"name": "restkv", **params}, budget=BUDGET, chunk=CHUNK)
    with pytest.raises(ValueError, match=r"\+model.repeat_kv=true"):
        StreamingEngine(model, policy).stream(sampled_stream(model, 12))
    repeat_kv_heads(model)
    tokens = sampled_stream(model, LENGTH)
    spec = ReferenceSpec("restkv", budget=BUDGET, chunk=CHUNK, positions=positions, **params)
    ref_nll, ref_correct = reference_stream(model, tokens, spec)
    hook, sets = retained_sets_recorder()
    policy = make_policy({"name": "restkv", **params}, budget=BUDGET, chunk=CHUNK)
    result = StreamingEngine(model, policy, positions=positions).stream(tokens, on_boundary=hook)
    torch.testing.assert_close(result.nll, ref_nll, rtol=0, atol=NLL_ATOL)
    assert torch.equal(result.correct, ref_correct)
    assert sets and result.evicted_count > 0
    for now, engine_set in sets.items():
        assert engine_set == spec.retained_log[now], f"R_{now} differs"


def test_a_model_without_separate_kv_projections_is_refused():
    model = tiny_model("llama")
    attention = model.model.layers[0].self_attn
    attention.k_proj = nn.Identity()  # as a fused projection: no k_proj of n_kv x head_dim outputs
    with pytest.raises(UnsupportedModelError, match="leave model.repeat_kv unset"):
        repeat_kv_heads(model)


def test_a_model_without_gqa_is_unchanged():
    model = tiny_model("llama", num_key_value_heads=4)
    before = model.model.layers[0].self_attn.k_proj
    assert repeat_kv_heads(model).model.layers[0].self_attn.k_proj is before


def test_repeat_kv_must_be_a_boolean():
    with pytest.raises(ValueError, match="model.repeat_kv must be true or false"):
        load_model(
            {"source": "hub", "hub_id": "nowhere", "repeat_kv": "yes"}, torch.device("cpu"), torch.float32
        )
