"""Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3): the model's own cache keeps one latent per token
and layer, which every head expands into a key of qk_nope_head_dim + qk_rope_head_dim channels (the last
qk_rope_head_dim rotated) and a value of v_head_dim channels.

Checked here: an unlimited budget equals the model's own forward pass over a multi-chunk stream; bounded
policies that read attention or positions equal the token-by-token reference, which holds the model's own
latent cache (one set per layer), in both position modes; the self-check finds the rotation of the last
channels (half pairing for DeepSeek-V3, interleaved for V2's complex rotation); what cannot be honoured is
refused before any forward pass (sets per head, policies that read the expanded keys or values); batched
documents equal single ones; the memory report gives the harness's per-head bytes and the latent cache's.
"""

from __future__ import annotations

import pytest
import torch
from conftest import record_max
from hydra import compose, initialize_config_dir
from transformers import PreTrainedModel

from checks.architectures import own_nll
from checks.architectures import tiny_model as registry_model
from checks.matrix import sampled_stream
from rmm import evaluate, runner
from rmm.engine import StreamingEngine, retained_sets_recorder
from rmm.errors import UnsupportedModelError
from rmm.files import config_dir
from rmm.lookahead import record_future
from rmm.policies import make_policy
from rmm.reference import ReferenceSpec, reference_stream

NLL_ATOL = 1e-4
N = 24  # tokens per stream: 6 chunks of 4
ARCHS = ("deepseek_v2", "deepseek_v3", "minicpm3")


@pytest.fixture(scope="module")
def models() -> dict[str, PreTrainedModel]:
    return {arch: registry_model(arch) for arch in ARCHS}


def streamed(model, tokens, name, budget, chunk, positions="original", scope="layer", **params):
    """Per-token NLL [n - 1] and the retained sets per boundary of ``tokens`` streamed by the engine."""
    policy = make_policy({"name": name, **params}, budget=budget, chunk=chunk)
    policy.prepare(tokens, lambda stream: record_future(model, stream, tau=0.02, context=1024))
    engine = StreamingEngine(model, policy, positions=positions, scope=scope)
    hook, sets = retained_sets_recorder()
    return engine.stream(tokens, on_boundary=hook).nll, sets


def test_keys_and_values_have_their_own_head_dimensions(models):
    model = models["deepseek_v3"]
    config = model.config
    assert config.qk_nope_head_dim + config.qk_rope_head_dim != config.v_head_dim  # the tiny config differs
    engine = StreamingEngine(model, make_policy({"name": "h2o"}, budget=8, chunk=4), scope="layer")
    memory = engine.new_memory(N, engine.plan.recording)  # B - C + 1 = 5 retained slots, then the chunk's 4
    assert memory.keys.shape[2:] == (4, 9, config.qk_nope_head_dim + config.qk_rope_head_dim)
    assert memory.values.shape[2:] == (4, 9, config.v_head_dim)


@pytest.mark.parametrize("arch", ARCHS)
def test_an_unlimited_budget_is_the_models_own_forward(models, arch):
    model = models[arch]
    tokens = sampled_stream(model, 40)
    own = own_nll(model, tokens)
    for name, chunk, params in (("h2o", 8, {}), ("rmm", 4, {"lag": 3}), ("window", 8, {})):
        nll, _ = streamed(model, tokens, name, 40, chunk, **params)  # several chunks, nothing evicted
        dnll = float((nll - own).abs().max())
        record_max("per-token |dNLL| of latent-attention models with an unlimited budget, fp32", dnll)
        assert dnll <= NLL_ATOL, (arch, name, dnll)


@pytest.mark.parametrize("positions", ["original", "cache"])
@pytest.mark.parametrize(
    ("name", "params", "scope"),
    [
        ("window", {}, "head"),
        ("streaming_llm", {"sinks": 2}, "head"),
        ("h2o", {}, "layer"),
        ("h2o", {}, "global"),
        ("rmm", {"lag": 3}, "layer"),
        ("rmm", {"lag": 3, "weight": "gradient"}, "layer"),
        ("tova", {}, "layer"),
        ("snapkv", {"window": 2, "kernel": 3, "pooling": "avg"}, "layer"),
        ("oracle", {}, "layer"),
    ],
)
@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_bounded_policies_match_the_reference(models, arch, name, params, scope, positions):
    model = models[arch]
    tokens = sampled_stream(model, N)
    nll, sets = streamed(model, tokens, name, 8, 4, positions, scope, **params)
    spec = ReferenceSpec(policy=name, budget=8, chunk=4, positions=positions, scope=scope, **params)
    expected, _ = reference_stream(model, tokens, spec)
    dnll = float((nll - expected).abs().max())
    record_max("per-token |dNLL| of latent-attention models against the reference, fp32", dnll)
    assert dnll <= NLL_ATOL, dnll
    for now, kept in sets.items():
        assert kept == spec.retained_log[now], now
    assert float((nll - own_nll(model, tokens)).abs().max()) > 0.05  # the budget binds


@pytest.mark.parametrize(("arch", "pairing"), [("deepseek_v2", "/interleaved"), ("deepseek_v3", "")])
def test_the_self_check_finds_the_rotation_of_the_last_channels(models, arch, pairing):
    model = models[arch]
    engine = StreamingEngine(
        model, make_policy({"name": "h2o"}, budget=8, chunk=4), positions="cache", scope="layer"
    )
    engine.self_check(sampled_stream(model, N))
    offset = model.config.qk_nope_head_dim
    names = {name for name, _ in engine.checked.rotations.values()}
    assert names == {f"model.rotary_emb.inv_freq{pairing}/from {offset}"}, names


def test_what_latent_attention_cannot_honour_is_refused_before_any_forward(models, monkeypatch):
    model = models["deepseek_v3"]
    calls = []
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(1))
    h2o = make_policy({"name": "h2o"}, budget=8, chunk=4)
    with pytest.raises(UnsupportedModelError, match=r"one latent per token and layer .* use scope=layer"):
        StreamingEngine(model, h2o, scope="head")
    with pytest.raises(UnsupportedModelError, match="policy knorm reads keys"):
        StreamingEngine(model, make_policy({"name": "knorm"}, budget=8, chunk=4), scope="layer")
    with pytest.raises(UnsupportedModelError, match="reads output_projection, values"):
        StreamingEngine(model, make_policy({"name": "restkv"}, budget=8, chunk=4), scope="layer")
    StreamingEngine(model, make_policy({"name": "window"}, budget=8, chunk=4), scope="head")  # one set anyway
    assert not calls
    with pytest.raises(ValueError, match="per-head keys and values that knorm reads"):
        reference_stream(
            model, torch.arange(8), ReferenceSpec(policy="knorm", budget=8, chunk=4, scope="layer")
        )


def test_a_batch_equals_its_documents_streamed_alone(models):
    model = models["deepseek_v2"]
    docs = [
        sampled_stream(model, 22, seed=1),
        sampled_stream(model, 13, seed=2),
        sampled_stream(model, 17, seed=3),
    ]
    settings = {"policy": "h2o", "budget": 8, "chunk": 4, "positions": "cache", "scope": "layer"}
    batched = evaluate(model, token_ids=docs, batch=2, **settings).tokens
    for doc_id, doc in enumerate(docs):
        alone = evaluate(model, token_ids=[doc], **settings).tokens
        got = batched[batched["doc_id"] == batched["doc_id"].unique()[doc_id]]["nll"].to_numpy()
        assert abs(got[1:] - alone["nll"].to_numpy()[1:]).max() <= NLL_ATOL


def test_memory_report_gives_the_harness_bytes_and_the_latent_cache(models):
    model = models["deepseek_v3"]
    config = model.config
    run = evaluate(
        model, token_ids=[sampled_stream(model, N)], policy="h2o", budget=8, chunk=4, scope="layer"
    )
    key_dim, value_dim = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    per_entry = config.num_attention_heads * (key_dim + value_dim) * 4  # every head's key and value, fp32
    assert run.metrics["kv_cache_bytes"] == 8 * config.num_hidden_layers * per_entry
    latent = (config.kv_lora_rank + config.qk_rope_head_dim) * 4  # one latent for all heads
    assert run.metrics["latent_cache_bytes"] == 8 * config.num_hidden_layers * latent
    plain = evaluate(
        registry_model("llama"), token_ids=[torch.arange(1, 20)], policy="h2o", budget=8, chunk=4
    )
    assert "latent_cache_bytes" not in plain.metrics


def test_a_saved_latent_model_is_refused_before_its_weights_load(models, tmp_path, monkeypatch):
    """``run.py`` reads a local (or cached hub) model's config.json before loading it: scope=head with a
    score-based policy is refused without the weights."""
    models["deepseek_v3"].config.save_pretrained(tmp_path)  # config.json only: no weights to load
    monkeypatch.setattr(runner, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    overrides = ["model=local", f"model.path={tmp_path}", "policy=h2o", "device=cpu", "wandb.mode=disabled"]
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    with pytest.raises(UnsupportedModelError, match=r"\(deepseek_v3\) uses multi-head latent attention"):
        runner.build(cfg, runner.check_run(cfg))
    assert runner.peek_config({"name": "smollm2_135m", "source": "gguf_package"}) is None
