"""restkv and expected_attention beyond the reference matrix: the model constants they read
(rmm/integration.py:output_projections), restkv's score as the exact output change of a removal, and
expected_attention against kvpress's own ExpectedAttentionPress."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from checks.matrix import distinct_stream, tiny_model
from rmm.engine import StreamingEngine
from rmm.integration import output_projections
from rmm.policies import make_policy
from rmm.policies.base import Observation


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "gemma3"])
def test_output_projections_are_each_kv_heads_columns(tiny_models, arch):
    model = tiny_models[arch]
    config = model.config
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    weights = output_projections(model)
    modules = [
        m
        for m in model.modules()
        if hasattr(m, "layer_idx") and hasattr(m, "o_proj" if arch != "gpt_neox" else "dense")
    ]
    assert weights.shape[:2] == (config.num_hidden_layers, n_kv) and weights.dtype == torch.float32
    group = n_heads // n_kv
    for layer, module in enumerate(modules):
        w = (module.dense if arch == "gpt_neox" else module.o_proj).weight
        head_dim = w.shape[1] // n_heads
        for h in range(n_kv):
            torch.testing.assert_close(
                weights[layer, h], w[:, h * group * head_dim : (h + 1) * group * head_dim]
            )


def test_observation_names_a_missing_model_constant():
    obs = Observation(torch.zeros(1, 1, 2, dtype=torch.long), torch.arange(1))
    with pytest.raises(AttributeError, match="'output_projection'.*model constant"):
        _ = obs.output_projection
    with pytest.raises(AttributeError, match="'rotation'.*model constant"):
        _ = obs.rotary


def test_the_engine_hands_the_model_constants_to_the_policy(tiny_models):
    """restkv's output projection and expected_attention's rotation are read once per engine."""
    restkv = StreamingEngine(tiny_models["llama"], make_policy({"name": "restkv"}, budget=8, chunk=4))
    assert set(restkv.plan.constants) == {"output_projection"}
    assert torch.equal(restkv.plan.constants["output_projection"], output_projections(tiny_models["llama"]))
    expected = StreamingEngine(
        tiny_models["llama"], make_policy({"name": "expected_attention"}, budget=8, chunk=4)
    )
    assert expected.plan.constants["rotary"] is expected.facts.rotary
    assert (
        StreamingEngine(tiny_models["llama"], make_policy({"name": "h2o"}, budget=8, chunk=4)).plan.constants
        == {}
    )


@pytest.mark.parametrize("group", [1, 2])
def test_restkv_scores_the_output_change_of_removing_one_entry(group):
    """With one query (beta irrelevant), no pooling (kernel 1) and query heads that attend alike, the score
    is exactly ||W_o (o' - o)||, o' the heads' output with j removed and the attention renormalised."""
    torch.manual_seed(0)
    n_slots, head_dim, hidden = 7, 4, 6
    probs = torch.softmax(torch.randn(n_slots), dim=0)
    values = torch.randn(n_slots, head_dim)
    projection = torch.randn(hidden, group * head_dim)
    obs = Observation(
        torch.arange(n_slots)[None, None],
        torch.tensor([n_slots - 1]),
        attention=(group * probs)[None, None, None],  # group summed
        values=values[None, None],
        output_projection=projection[None, None],
    )
    scores = make_policy({"name": "restkv", "kernel": 1}, budget=8, chunk=1).score({}, obs, n_slots)[0, 0]
    output = probs @ values
    for j in range(n_slots):
        kept = torch.ones(n_slots, dtype=torch.bool)
        kept[j] = False
        removed = (probs[kept] / probs[kept].sum()) @ values[kept]
        change = projection @ (removed - output).repeat(group)  # every head of the group changes alike
        torch.testing.assert_close(scores[j].item(), change.norm().item(), rtol=1e-5, atol=1e-7)


def _expected_attention_press() -> type:
    """kvpress 0.5.5's ExpectedAttentionPress, from its own module, without running kvpress/__init__.py
    (which would patch transformers' attention functions for the whole session)."""
    spec = importlib.util.find_spec("kvpress")
    if spec is None or spec.origin is None:
        pytest.skip("kvpress is not installed (make setup installs kvpress==0.5.5)")
    root, shells = Path(spec.origin).parent, []
    for name, folder in (("kvpress", root), ("kvpress.presses", root / "presses")):
        if name not in sys.modules:
            shell = types.ModuleType(name)
            shell.__path__ = [str(folder)]
            sys.modules[name] = shell
            shells.append(name)
    try:
        return importlib.import_module("kvpress.presses.expected_attention_press").ExpectedAttentionPress
    finally:
        for name in shells:
            del sys.modules[name]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "params",
    [
        {"n_future_positions": 16, "sinks": 2},
        {"n_future_positions": 512, "sinks": 4, "epsilon": 0.01},
        {"n_future_positions": 7, "sinks": 1, "use_covariance": False},
    ],
)
def test_expected_attention_scores_as_kvpress_at_a_prefill_boundary(arch, params):
    """At the first boundary (now = C: a prefill of C tokens) the policy's scores of the keys past the sinks
    equal ExpectedAttentionPress.score on the same model and tokens (queries' statistics rotated to the
    next F absolute positions against keys rotated at their own positions: the same frame)."""
    press_cls, chunk = _expected_attention_press(), 16
    model, tokens = tiny_model(arch), distinct_stream(chunk + 4)
    seen = {}

    def before(memory, obs, now, scores):
        if now == chunk:
            seen["pos"], seen["scores"] = obs.key_pos.clone(), scores.clone()

    policy = make_policy({"name": "expected_attention", **params}, budget=chunk + 8, chunk=chunk)
    StreamingEngine(model, policy).stream(tokens, before_boundary=before)
    hidden, layers = {}, model.model.layers
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda module, args, kwargs, i=i: hidden.__setitem__(i, kwargs["hidden_states"]), with_kwargs=True
        )
        for i, layer in enumerate(layers)
    ]
    cache = DynamicCache()
    with torch.no_grad():
        model(tokens[None, :chunk], cache=cache, use_cache=True)
    for hook in hooks:
        hook.remove()
    press = press_cls(
        n_future_positions=params["n_future_positions"],
        n_sink=params["sinks"],
        use_covariance=params.get("use_covariance", True),
        epsilon=params.get("epsilon", 0.0),
    )
    for i, layer in enumerate(layers):
        layer.self_attn.rotary_emb = model.model.rotary_emb  # as kvpress's pipeline sets it
        with torch.no_grad():
            theirs = press.score(
                layer.self_attn, hidden[i], cache.layers[i].keys, cache.layers[i].values, None, {}
            )
        for h, positions in enumerate(seen["pos"][i].tolist()):
            ours = {
                j: float(seen["scores"][i, h, slot])
                for slot, j in enumerate(positions)
                if j >= params["sinks"]
            }
            assert sorted(ours) == list(range(params["sinks"], chunk))
            expected = torch.tensor([float(theirs[0, h, j]) for j in ours])
            torch.testing.assert_close(torch.tensor(list(ours.values())), expected, rtol=1e-5, atol=0)
