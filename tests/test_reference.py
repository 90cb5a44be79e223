"""The reference's independence: its imports, its RoPE against the models' own, scaled RoPE end to end;
attention beside learned sinks in both its paths."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch
from conftest import sampled_stream, tiny_model
from test_policies import NLL_ATOL, retained_sets

from checks import architectures
from rmm.reference import (
    ReferenceSpec,
    _with_sinks,
    reference_attention,
    reference_stream,
    rope_frequencies,
    rope_rotate,
)

REFERENCE = Path(__file__).resolve().parents[1] / "rmm" / "reference.py"
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small, so head_dim 16 has low, medium and high frequencies
}
LINEAR = {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}
ROPE_CASES = {
    "default": ("llama", {}),
    "partial": ("gpt_neox", {}),
    "linear": ("llama", {"rope_parameters": LINEAR}),
    "llama3": ("llama", {"rope_parameters": LLAMA3}),
}


def test_reference_imports_nothing_from_the_harness():
    tree = ast.parse(REFERENCE.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    stdlib = {"__future__", "collections", "contextlib", "math", "dataclasses", "sys"}
    assert imported <= stdlib | {"torch", "transformers"}, imported


@pytest.mark.parametrize("case", ROPE_CASES)
def test_reference_rope_is_the_models_rope(case):
    """Rotating a raw vector by p with the reference's RoPE equals the model's own rotation at p."""
    arch, overrides = ROPE_CASES[case]
    model = tiny_model(arch, **overrides)
    module = importlib.import_module(type(model).__module__)
    rotary = next(m for name, m in model.named_modules() if name.endswith("rotary_emb"))
    x = torch.randn(1, 1, 6, model.config.hidden_size // model.config.num_attention_heads)
    positions = torch.tensor([[0, 1, 7, 63, 200, 511]])
    cos, sin = rotary(x, positions)
    expected, _ = module.apply_rotary_pos_emb(x, x, cos, sin)
    inv_freq = rope_frequencies(model.config)
    got = rope_rotate(x[0, 0], positions[0].tolist(), inv_freq)
    torch.testing.assert_close(got, expected[0, 0], rtol=0, atol=2e-5)
    if case in ("linear", "llama3"):  # the scaling must matter at these positions
        plain = rope_rotate(x[0, 0], positions[0].tolist(), rope_frequencies(tiny_model(arch).config))
        assert (plain - got).abs().max() > 1e-2


@pytest.mark.parametrize(("name", "params"), [("h2o", {}), ("streaming_llm", {"sinks": 2})])
@pytest.mark.parametrize("scaling", ["linear", "llama3"])
def test_scaled_rope_cache_positions_match_reference(name, params, scaling):
    """positions=cache on a model with scaled RoPE: the engine's re-rotation against the reference's."""
    model = tiny_model("llama", **ROPE_CASES[scaling][1])
    tokens = sampled_stream(model, n=32)
    spec = ReferenceSpec(policy=name, budget=8, chunk=4, positions="cache", **params)
    ref_nll, _ = reference_stream(model, tokens, spec)
    result, sets = retained_sets(model, tokens, name, params, budget=8, chunk=4, positions="cache")
    torch.testing.assert_close(result.nll, ref_nll, rtol=0, atol=NLL_ATOL)
    assert all(sets[now] == spec.retained_log[now] for now in sets)


def test_reference_refuses_unknown_rope():
    model = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match="no RoPE rule for rope_type 'dynamic'"):
        rope_frequencies(model.config)


def test_attention_weights_beside_learned_sinks_are_the_keys_share():
    """Weights that leave a learned sink out (rows summing to 1) become the keys' probabilities in a softmax
    whose denominator holds the sink too; weights that count the sink already stay as they are."""
    torch.manual_seed(0)
    heads, kv_heads, n_q, n_k, dim, scaling = 4, 2, 3, 5, 8, 0.35
    query, key = torch.randn(1, heads, n_q, dim), torch.randn(1, kv_heads, n_k, dim)
    sinks = torch.randn(heads)
    mask = torch.zeros(1, 1, n_q, n_k).masked_fill(torch.rand(1, 1, n_q, n_k) < 0.3, -torch.inf)
    mask[..., 0] = 0.0  # every query sees a key
    logits = query @ key.repeat_interleave(heads // kv_heads, dim=1).transpose(-1, -2) * scaling + mask
    with_sink = torch.cat([logits, sinks.view(1, -1, 1, 1).expand(1, heads, n_q, 1)], dim=-1)
    expected = with_sink.double().softmax(-1)[..., :-1]
    plain = logits.softmax(-1)
    got = _with_sinks(plain, query, key, mask, scaling, sinks)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-7)
    assert float((expected.sum(-1) - 1).abs().min()) > 1e-3  # the sinks take a visible share
    counted = expected.float()
    assert _with_sinks(counted, query, key, mask, scaling, sinks) is counted


def test_sinks_left_out_of_a_models_weights_are_in_every_reference_path():
    """GraniteSWA's eager attention returns weights without its learned sinks' share (it scales the output
    afterwards). The oracles' future (one forward pass) and the decoder's attention both hold the share,
    and the engine's Belady oracle, whose requests the share moves, keeps the reference's sets."""
    model = architectures.tiny_model("granite_swa")
    tokens = architectures.stream_tokens(model, 40)
    n, budget, chunk = tokens.numel(), 12, 4
    full, windowed = reference_attention(model, tokens), reference_attention(model, tokens, n - 4)
    seen = n - 4  # the queries that see every key in both
    torch.testing.assert_close(full[:, :, :seen], windowed[:, :, :seen], rtol=0, atol=1e-5)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    assert float((group - full[:, :, :seen].sum(-1)).max()) > 0.1  # the sinks take a visible share
    spec = ReferenceSpec(policy="oracle", budget=budget, chunk=chunk)
    nll, _ = reference_stream(model, tokens, spec)
    result, sets = retained_sets(model, tokens, "oracle", {}, budget=budget, chunk=chunk)
    torch.testing.assert_close(result.nll, nll, rtol=0, atol=NLL_ATOL)
    assert sets == {now: spec.retained_log[now] for now in sets}
