"""Hybrid models: recurrent or convolutional mixers beside attention layers (LFM2, Qwen3-Next).

The mixers carry their state across chunks in the model's own cache, one row per stream, while every
attention layer goes through the bounded memory. Checked here: an unlimited budget equals the model's
own forward pass over a multi-chunk stream; bounded policies equal the token-by-token reference (which
carries the state itself, token by token) in both position modes; a state that restarted at every
chunk is refused by the self-check; batched documents each keep their own state (refills, dropped
rows); and the memory report counts attention entries of attention layers only, the state apart.
"""

from __future__ import annotations

import pytest
import torch
from conftest import record_max
from transformers import DynamicCache, Lfm2Config, Lfm2ForCausalLM, PreTrainedModel

from checks.architectures import own_nll
from checks.architectures import tiny_model as registry_model
from checks.matrix import TINY, sampled_stream
from rmm import evaluate, integration
from rmm.engine import StreamingEngine, retained_sets_recorder
from rmm.errors import UnsupportedModelError
from rmm.policies import make_policy
from rmm.reference import ReferenceSpec, reference_stream

NLL_ATOL = 1e-4
N = 40  # tokens per stream: 5 chunks of 8, 10 of 4


def lfm2(seed: int = 0) -> PreTrainedModel:
    """A tiny LFM2 with its real layer pattern: short convolutions (kernel 3) between attention layers."""
    torch.manual_seed(seed)
    layers = ["conv", "full_attention", "conv", "full_attention"]
    config = Lfm2Config(**{**TINY, "num_hidden_layers": len(layers)}, layer_types=layers)
    return Lfm2ForCausalLM(config).eval().requires_grad_(False)


class _Models(dict):
    """Tiny hybrid models, built on first use: LFM2 with its real layer pattern, the others the registry's."""

    def __missing__(self, arch: str) -> PreTrainedModel:
        self[arch] = lfm2() if arch == "lfm2" else registry_model(arch)
        return self[arch]


@pytest.fixture(scope="module")
def models() -> dict[str, PreTrainedModel]:
    return _Models()


# two families in the fast suite; three more (Mamba-2 mixers: Bamba, Falcon-H1; the gated delta rule in
# Qwen3.5's layer pattern) in the slow one: at least four hybrid families exact, rmm included
ARCHS = [
    "lfm2",
    "qwen3_next",
    *(pytest.param(arch, marks=pytest.mark.slow) for arch in ("bamba", "falcon_h1", "qwen3_5_text")),
]


def streamed(model, tokens, name, budget, chunk, positions="original", **params):
    """Per-token NLL [n - 1] and the retained sets per boundary of ``tokens`` streamed by the engine."""
    policy = make_policy({"name": name, **params}, budget=budget, chunk=chunk)
    engine = StreamingEngine(model, policy, positions=positions)
    hook, sets = retained_sets_recorder()
    return engine.stream(tokens, on_boundary=hook).nll, sets


@pytest.mark.parametrize("arch", ARCHS)
def test_an_unlimited_budget_is_the_models_own_forward(models, arch):
    model = models[arch]
    tokens = sampled_stream(model, N)
    own = own_nll(model, tokens)
    for name, chunk, params in (("h2o", 8, {}), ("rmm", 4, {"lag": 3}), ("window", 8, {})):
        nll, _ = streamed(model, tokens, name, N, chunk, **params)  # several chunks, nothing evicted
        dnll = float((nll - own).abs().max())
        record_max("per-token |dNLL| of hybrid models with an unlimited budget, fp32", dnll)
        assert dnll <= NLL_ATOL, (arch, name, dnll)


@pytest.mark.parametrize("positions", ["original", "cache"])
@pytest.mark.parametrize(
    ("name", "params"), [("window", {}), ("h2o", {}), ("rmm", {"lag": 3}), ("tova", {}), ("knorm", {})]
)
@pytest.mark.parametrize("arch", ARCHS)
def test_bounded_policies_match_the_reference(models, arch, name, params, positions):
    model = models[arch]
    tokens = sampled_stream(model, 24)
    nll, sets = streamed(model, tokens, name, 8, 4, positions, **params)
    spec = ReferenceSpec(policy=name, budget=8, chunk=4, positions=positions, **params)
    expected, _ = reference_stream(model, tokens, spec)
    dnll = float((nll - expected).abs().max())
    record_max("per-token |dNLL| of hybrid models against the reference, fp32", dnll)
    assert dnll <= NLL_ATOL, dnll
    for now, kept in sets.items():
        assert kept == spec.retained_log[now], now
    attends = set(integration.attention_layers(model))
    assert all(
        not any(kept[layer]) for kept in sets.values() for layer in range(len(kept)) if layer not in attends
    )
    # the check's power: the bound moves the NLL, and a mixer without its state moves it too
    assert float((nll - own_nll(model, tokens)).abs().max()) > 10 * NLL_ATOL


def test_a_state_that_restarts_is_refused(models, monkeypatch):
    model = models["lfm2"]
    tokens = sampled_stream(model, N)
    engine = StreamingEngine(model, make_policy({"name": "h2o"}, budget=N, chunk=8))
    assert engine.self_check(tokens).max_abs_dnll <= NLL_ATOL
    forward = StreamingEngine.forward

    def restarting(self, memory, chunk, position_ids):  # the mixers' state lost before every pass
        memory.carried.cache = integration.CarriedState(model).cache
        return forward(self, memory, chunk, position_ids)

    monkeypatch.setattr(StreamingEngine, "forward", restarting)
    engine = StreamingEngine(model, make_policy({"name": "h2o"}, budget=N, chunk=8))
    with pytest.raises(UnsupportedModelError, match="self-check"):
        engine.self_check(tokens)


@pytest.mark.parametrize("arch", ARCHS)
def test_each_document_keeps_its_own_state(models, arch):
    """Three documents at batch 2: the third takes the first's row (emptied), and the second's row is
    renumbered when the third finishes first (rows dropped); each equals itself streamed alone."""
    model = models[arch]
    docs = [sampled_stream(model, n, seed=i) for i, n in enumerate((16, 40, 13))]
    policy = make_policy({"name": "h2o"}, budget=12, chunk=4)
    alone = [StreamingEngine(model, policy).stream(doc).nll for doc in docs]
    batched = evaluate(model, token_ids=docs, policy="h2o", budget=12, chunk=4, batch=2)
    for i, doc in enumerate(docs):
        rows = batched.tokens[batched.tokens["doc_id"] == batched.tokens["doc_id"].unique()[i]]
        got = torch.tensor(rows["nll"].iloc[1:].to_numpy(dtype="float32"))
        assert got.numel() == doc.numel() - 1
        dnll = float((got - alone[i]).abs().max())
        record_max("per-token |dNLL| of hybrid documents in a batch against alone, fp32", dnll)
        assert dnll <= NLL_ATOL, (i, dnll)


def test_rows_of_the_state_follow_the_memory(models):
    model = models["lfm2"]
    engine = StreamingEngine(model, make_policy({"name": "h2o"}, budget=12, chunk=4))
    memory = engine.new_memory(8, engine.plan.recording, rows=2)
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    with integration.install(model):
        engine.forward(memory, tokens, memory.begin_chunk([0, 0], [4, 4]))
    states = [s for layer in memory.carried.layers for s in layer.conv_states.values()]
    before = [s.clone() for s in states]
    assert all(s.shape[0] == 2 and s.abs().sum() > 0 for s in before)
    memory.add_rows(1)
    memory.keep_rows([2, 0])
    memory.reset_row(1)
    after = [s for layer in memory.carried.layers for s in layer.conv_states.values()]
    for old, new in zip(before, after, strict=True):
        assert new.shape[0] == 2 and not new.abs().sum() and not old[1].equal(torch.zeros_like(old[1]))
    assert engine.facts.attending == [False, True, False, True] and engine.facts.carried == [0, 2]


def test_memory_reports_the_state_apart(models):
    model = models["lfm2"]
    short, long = (torch.arange(n) % 61 for n in (24, 48))
    runs = [evaluate(model, token_ids=[doc], policy="h2o", budget=16, chunk=4) for doc in (short, long)]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=short[None, :2], cache=cache, use_cache=True)
    state = sum(s.numel() * s.element_size() for layer in cache.layers if hasattr(layer, "conv_states")
                for s in layer.conv_states.values())  # fmt: skip
    config = model.config
    per_entry = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 2 * 4
    for run in runs:  # two attention layers of four hold B entries; the state does not grow with the stream
        assert run.metrics["kv_cache_bytes"] == 16 * 2 * per_entry
        assert run.metrics["recurrent_state_bytes"] == state > 0


def test_what_a_hybrid_model_cannot_do_is_refused(models):
    model = models["lfm2"]
    with pytest.raises(UnsupportedModelError, match="scope=head"):
        StreamingEngine(model, make_policy({"name": "h2o"}, budget=12, chunk=4), scope="global")
    with pytest.raises(UnsupportedModelError, match="gradient"):
        StreamingEngine(
            model, make_policy({"name": "rmm", "lag": 3, "weight": "gradient"}, budget=12, chunk=4)
        )
    engine = StreamingEngine(model, make_policy({"name": "window"}, budget=12, chunk=4))
    assert engine.chunks(40, engine.plan.recording) == [(s, min(s + 12, 40)) for s in range(0, 40, 12)]
