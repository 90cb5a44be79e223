"""A learned bias per key (Doge's dynamic mask): every logit of key j gets a bias per KV head computed from
j's values, and each query attends only the ``keep_window_size`` keys of largest bias it sees.

The tiny Doge here has random biases (the model initialises their scale A to zero, which makes every bias 1
and the keep window a tie) and a keep window of 12, so that it binds in the bounded runs (B = 12, C = 4: 13
slots) and in the unlimited ones. Streams hold no repeated token: the first layer's values, hence its
biases, depend on the token alone, and where two keys tie at the window's edge the model's own forward
takes the one ``torch.topk`` happens to return, the harness and the reference the more recent one.
"""

from __future__ import annotations

import pytest
import torch
from conftest import record_max

from checks.architectures import own_nll, tiny_config
from checks.matrix import distinct_stream
from rmm import integration
from rmm.api import evaluate
from rmm.divergence import NLL_BOUND
from rmm.errors import UnsupportedModelError
from rmm.reference import ReferenceSpec, reference_stream

WINDOW = 12
TOLERANCE = 1e-4


def doge(window: int = WINDOW, scale: float = 2.0, **changes) -> torch.nn.Module:
    """The tiny Doge with keep window ``window`` and bias scales A drawn with standard deviation ``scale``."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("doge")
    config.keep_window_size = window
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(1)
    for layer in model.model.layers:
        layer.self_attn.A.copy_(torch.randn(layer.self_attn.A.shape, generator=generator) * scale)
    return model


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return doge()


def nll(run) -> torch.Tensor:
    return torch.from_numpy(run.tokens["nll"].dropna().to_numpy(dtype="float32"))


def test_the_bias_and_the_keep_window_change_the_model(model):
    """The checks below are sensitive: the biases and the keep window each move the model's own NLL."""
    tokens = distinct_stream(60, seed=0)
    own = own_nll(model, tokens)
    assert float((own_nll(doge(window=2048), tokens) - own).abs().max()) > 0.1
    assert float((own_nll(doge(scale=0.0), tokens) - own).abs().max()) > 0.1


@pytest.mark.parametrize("window", [WINDOW, 2048])
@pytest.mark.parametrize(("policy", "budget"), [("full", None), ("h2o", 60), ("window", 60)])
def test_an_unlimited_budget_equals_the_models_own_forward(window, policy, budget):
    model = doge(window=window)
    tokens = distinct_stream(60, seed=0)
    got = nll(evaluate(model, token_ids=[tokens], policy=policy, budget=budget, chunk=4))
    dnll = float((got - own_nll(model, tokens)).abs().max())
    record_max("per-token |dNLL| of a key-bias model against its own forward, fp32", dnll)
    assert dnll <= TOLERANCE


@pytest.mark.parametrize("positions", ["original", "cache"])
@pytest.mark.parametrize(
    ("policy", "params", "scope"),
    [
        ("window", {}, "head"),
        ("streaming_llm", {"sinks": 2}, "head"),
        ("h2o", {}, "head"),
        ("h2o", {}, "layer"),
        ("rmm", {"lag": 8}, "head"),
    ],
)
def test_a_bounded_memory_equals_the_reference(model, positions, policy, params, scope):
    """The reference holds the retained keys physically and records each key's bias as its token produced
    it (a head holding other positions would mix the model's per-column biases), then applies the keep
    window by its own rule."""
    tokens = distinct_stream(60, seed=2)
    spec = ReferenceSpec(policy=policy, budget=12, chunk=4, positions=positions, scope=scope, **params)
    expected = reference_stream(model, tokens, spec)[0]
    options = {"positions": positions, "scope": scope}
    run = evaluate(model, token_ids=[tokens], policy=policy, budget=12, chunk=4, **options, **params)
    dnll = float((nll(run) - expected).abs().max())
    record_max("per-token |dNLL| of a key-bias model against the reference, fp32", dnll)
    assert dnll <= TOLERANCE


def test_a_batch_streams_each_document_as_alone(model):
    docs = [distinct_stream(n, seed=i) for i, n in enumerate((40, 17, 29))]
    alone = evaluate(model, token_ids=docs, policy="h2o", budget=12, chunk=4, batch=1)
    batched = evaluate(model, token_ids=docs, policy="h2o", budget=12, chunk=4, batch=2)
    assert float((nll(batched) - nll(alone)).abs().max()) <= NLL_BOUND


def test_ties_at_the_windows_edge_go_to_the_more_recent_key():
    """Slots are in position order: of two keys with the same bias, the later one is kept."""
    bias = torch.tensor([[[1.0, 2.0, 1.0, 3.0, 1.0]]])  # [N, H, S]
    hidden = torch.zeros(1, 1, 2, 5, dtype=torch.bool)
    hidden[0, 0, 0, 4] = True  # the first query does not see the last slot
    shown = ~integration._outside_keep_window(hidden, bias, 3)
    assert shown[0, 0, 0].tolist() == [False, True, True, True, False]
    assert shown[0, 0, 1].tolist() == [False, True, False, True, True]


def test_a_chunk_beyond_the_keep_window_is_refused_before_the_model_runs(model):
    with pytest.raises(ValueError, match=r"use chunk <= 12"):
        evaluate(model, token_ids=[distinct_stream(40, seed=0)], policy="h2o", budget=24, chunk=16)


def test_a_saved_model_with_a_short_keep_window_is_refused_before_its_weights_load(
    model, tmp_path, monkeypatch
):
    """``run.py`` reads a local model's config.json first: a chunk beyond the keep window is refused there."""
    from hydra import compose, initialize_config_dir

    from rmm import runner
    from rmm.files import config_dir

    model.config.save_pretrained(tmp_path)  # config.json only: no weights to load
    monkeypatch.setattr(runner, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    overrides = ["model=local", f"model.path={tmp_path}", "policy=h2o", "chunk=16", "budget=64", "device=cpu"]
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, "wandb.mode=disabled"])
    with pytest.raises(
        ValueError, match=r"\(doge\) lets each query attend only the 12 keys .* use chunk <= 12"
    ):
        runner.build(cfg, runner.check_run(cfg))


def test_a_windowed_mask_under_the_bias_is_refused():
    with pytest.raises(UnsupportedModelError, match=r"bias per key onto a sliding-window mask"):
        evaluate(doge(sliding_window=8), token_ids=[distinct_stream(40, seed=0)], policy="full")
