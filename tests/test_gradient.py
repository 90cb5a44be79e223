"""rmm's loss-gradient utility (weight=gradient): finite differences, the reference, no autograd leaks."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from conftest import sampled_stream, tiny_model
from test_policies import CASES, NLL_ATOL, fits, retained_sets
from transformers import AttentionInterface

from rmm.engine import StreamingEngine
from rmm.lookahead import record_future
from rmm.policies import make_policy
from rmm.reference import ReferenceSpec, reference_stream

GRADIENT = {"lag": 3, "weight": "gradient"}


def gated_loss(model, tokens: torch.Tensor, start: int, stop: int, gate_logit: torch.Tensor) -> float:
    """Sum of the NLLs of queries [start, stop) in one full causal forward pass over ``tokens[:stop]``,
    with ``gate_logit`` [L, n_heads, stop, stop] added to the attention logits (log of the gates)."""

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        group = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        logits = query @ key.transpose(-1, -2) * scaling + gate_logit[module.layer_idx]
        causal = torch.ones(logits.shape[-2:], dtype=torch.bool).tril()
        probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)
        return (probs @ value).transpose(1, 2).contiguous(), None

    AttentionInterface.register("test_gated", attention)
    model.set_attn_implementation("test_gated")
    with torch.no_grad():
        log_probs = model(tokens[None, :stop]).logits[0].double().log_softmax(-1)
    return float(-sum(log_probs[s, tokens[s + 1]] for s in range(start, stop)))


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_gradient_utility_is_the_gate_derivative(arch):
    """u_s(j) from the engine = -dl/dlog(gamma_j) by central finite differences (float64), where l is the
    chunk's summed NLL and gamma_j gates j's attention weight for every query head of the KV head."""
    model = tiny_model(arch).double()
    tokens = sampled_stream(tiny_model(arch), n=13)
    start, stop = 4, 8  # the second chunk of 4; budget 16 keeps everything, so attention is full causal
    captured = {}

    def keep(memory, obs, now, scores):
        captured[now] = (obs.gradient.clone(), obs.key_pos.clone())

    policy = make_policy({"name": "rmm", **GRADIENT}, budget=16, chunk=4)
    StreamingEngine(model, policy).stream(tokens, before_boundary=keep)
    utility, key_pos = captured[stop]  # [L, H, Q, S], [L, H, S]
    n_layers, n_kv = utility.shape[:2]
    group = model.config.num_attention_heads // n_kv
    entries = [(0, 0, 5, 2), (n_layers - 1, n_kv - 1, 7, 6), (1, 0, 6, 0), (0, n_kv - 1, 7, 7), (1, 0, 4, 1)]
    # the models' norms compute in float32 even in a float64 model, so the loss is only good to ~1e-7:
    # a five-point stencil (error O(eps^4)) with a large step keeps both errors near 1e-5
    eps = 1e-2
    for layer, h, s, j in entries:
        slot = int((key_pos[layer, h] == j).nonzero())
        got = float(utility[layer, h, s - start, slot])
        loss = {}
        for step in (2, 1, -1, -2):
            gate = torch.zeros(n_layers, model.config.num_attention_heads, stop, stop, dtype=torch.float64)
            gate[layer, h * group : (h + 1) * group, s, j] = step * eps
            loss[step] = gated_loss(model, tokens, start, stop, gate)
        derivative = (8 * (loss[1] - loss[-1]) - (loss[2] - loss[-2])) / (12 * eps)
        assert abs(derivative) > 1e-3, "pick entries whose utility is not negligible"
        assert got == pytest.approx(-derivative, rel=2e-3, abs=2e-5), (layer, h, s, j)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
@pytest.mark.parametrize("positions", ["original", "cache"])
@pytest.mark.parametrize("after_commit", ["accumulate", pytest.param("freeze", marks=pytest.mark.slow)])
def test_gradient_weight_matches_reference_at_chunk_1(streams, tiny_models, arch, positions, after_commit):
    params = {**GRADIENT, "after_commit": after_commit}
    model, tokens = tiny_models[arch], streams[arch]
    spec = ReferenceSpec(policy="rmm", budget=8, chunk=1, positions=positions, **params)
    ref_nll, _ = reference_stream(model, tokens, spec)
    result, sets = retained_sets(model, tokens, "rmm", params, chunk=1, positions=positions)
    torch.testing.assert_close(result.nll, ref_nll, rtol=0, atol=NLL_ATOL)
    assert sets and all(sets[now] == spec.retained_log[now] for now in sets)


def test_gradient_matrix_cases_exist():
    assert ("rmm", GRADIENT) in CASES and ("rmm", {**GRADIENT, "after_commit": "freeze"}) in CASES


def test_gradient_leaves_no_autograd_state(tiny_models, streams):
    """weight=gradient: slots and statistics never hold a graph, the live tensors stay flat across chunks,
    and the caller's grad mode is untouched."""
    model, tokens = tiny_models["llama"], torch.cat([streams["llama"]] * 3)
    policy = make_policy({"name": "rmm", **GRADIENT}, budget=8, chunk=4)
    live = []

    def check(view, obs, now, scores):
        memory = view.memory  # the batch's memory, of which the stream's view is one row
        for tensor in [memory.keys, memory.values, memory.attn, memory.utility, *memory.state.values()]:
            assert not tensor.requires_grad and tensor.grad_fn is None
        assert not memory._outputs, "the chunk's graph must be released after its backward pass"
        if now % 16:  # counting every object is slow: every fourth boundary
            return
        gc.collect()
        with warnings.catch_warnings():  # inspecting every object touches deprecated torch attributes
            warnings.simplefilter("ignore")
            live.append(sum(1 for o in gc.get_objects() if torch.is_tensor(o)))

    StreamingEngine(model, policy).stream(tokens, before_boundary=check)
    assert len(live) >= 4 and max(live) == min(live), live


def test_only_the_gradient_weight_enables_autograd(tiny_models, streams):
    """Every other policy (each case of the reference matrix) streams without autograd."""
    model, tokens = tiny_models["gpt_neox"], streams["gpt_neox"]
    modes: list[bool] = []
    handle = model.register_forward_hook(lambda module, args, out: modes.append(torch.is_grad_enabled()))
    try:
        for name, params in CASES:
            if not fits(name, params, chunk=4):
                continue
            policy = make_policy({"name": name, **params}, budget=8, chunk=4)
            policy.prepare(tokens, lambda stream: record_future(model, stream, tau=0.02, context=1024))
            engine = StreamingEngine(model, policy)
            engine.self_check(tokens)
            modes.clear()  # the streaming passes only, not the oracle's reference pass or the self-check
            with torch.enable_grad():  # even when the caller has autograd on
                engine.stream(tokens)
            expected = params.get("weight") == "gradient"
            assert modes and all(mode == expected for mode in modes), (name, params)
    finally:
        handle.remove()


def test_reference_per_query_loss_equals_chunk_loss_at_chunk_1(tiny_models, streams):
    """The reference's per-query variant (used to measure the chunk-sum definition) is the chunk-1 rule."""
    model, tokens = tiny_models["llama"], streams["llama"]
    logs = {}
    for loss in ("chunk", "query"):
        for chunk in (1, 4):
            spec = ReferenceSpec(policy="rmm", budget=8, chunk=chunk, gradient_loss=loss, **GRADIENT)
            reference_stream(model, tokens, spec)
            logs[loss, chunk] = spec.retained_log
    assert logs["chunk", 1] == logs["query", 1]
    assert logs["chunk", 4] != logs["query", 4], "at C=4 the two losses should rank differently here"


@pytest.mark.slow  # loads SmolLM2
def test_gradient_chunking_script_runs(capsys, monkeypatch):
    """studies/gradient/gradient_chunking.py end to end on a short stream: both comparisons and the sink
    line."""
    from studies.gradient import gradient_chunking

    args = ["--tokens", "48", "--chunk", "8", "--lag", "8", "--budget", "24", "--threads", "1"]
    monkeypatch.setattr("sys.argv", ["gradient_chunking", *args])
    gradient_chunking.main()
    out = capsys.readouterr().out
    assert "chunk-sum vs per-query: Spearman" in out
    assert "kept set (top 9) differs" in out and "position 0" in out
