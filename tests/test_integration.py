"""Attention features the bounded attention does not reproduce are refused before streaming."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_model
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    FalconConfig,
    FalconForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
)

from rmm.engine import StreamingEngine
from rmm.integration import ATTENTION_NAME, bounded_attention, check_model, install
from rmm.models import UnsupportedModelError
from rmm.policies import make_policy
from rmm.reference import ReferenceSpec, reference_stream

WINDOW = 16  # the tiny models' sliding window; the test streams are longer
FALCON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, vocab_size=61, alibi=True)
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=61)


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 61, (48,), generator=torch.Generator().manual_seed(1))


def engine(model, name: str, budget: int | None = 12, chunk: int = 4, positions: str = "original"):
    return StreamingEngine(model, make_policy({"name": name}, budget, chunk), positions=positions)


def plain_nll(model, tokens: torch.Tensor) -> torch.Tensor:
    model.set_attn_implementation("sdpa")
    logits = model(tokens[None], use_cache=False).logits[0, :-1].float()
    return -torch.log_softmax(logits, -1).gather(-1, tokens[1:, None])[:, 0]


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def windowed(request: pytest.FixtureRequest):
    """A tiny model whose every layer applies a sliding window of WINDOW positions."""
    extra = {"use_sliding_window": True, "max_window_layers": 0} if request.param == "qwen2" else {}
    return tiny_model(request.param, sliding_window=WINDOW, **extra)


def test_sliding_window_matters_beyond_its_reach(windowed, tokens):
    """The premise: past WINDOW tokens the model's own attention differs from unbounded attention."""
    unbounded = engine(copy.deepcopy(windowed), "full", budget=None, chunk=WINDOW).stream(tokens[:WINDOW])
    torch.testing.assert_close(unbounded.nll, plain_nll(windowed, tokens[:WINDOW]), rtol=0, atol=1e-5)
    with pytest.raises(UnsupportedModelError):
        engine(windowed, "full", budget=None).stream(tokens)
    windowed_nll = plain_nll(windowed, tokens)
    plain_without = plain_nll(tiny_model(windowed.config.model_type, sliding_window=None), tokens)
    assert (windowed_nll - plain_without).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("name", "positions"), [("full", "original"), ("h2o", "original"), ("streaming_llm", "original")]
)
def test_sliding_window_refused_when_reachable(windowed, tokens, name, positions):
    budget = None if name == "full" else 12
    with pytest.raises(UnsupportedModelError) as err:
        engine(windowed, name, budget=budget, positions=positions).stream(tokens)
    message = str(err.value)
    assert f"sliding window of {WINDOW}" in message
    assert f"up to {tokens.numel() - 1} positions back" in message
    assert "positions=cache" in message and f"budget<={WINDOW - 1}" in message


@pytest.mark.parametrize(
    ("name", "positions", "budget"),
    [("window", "original", WINDOW - 1), ("h2o", "cache", 12), ("streaming_llm", "cache", WINDOW - 1)],
)
def test_sliding_window_accepted_within_reach(windowed, tokens, name, positions, budget):
    """Below the window the bounded memory decides everything, and the engine agrees with the reference."""
    spec = ReferenceSpec(policy=name, budget=budget, chunk=4, positions=positions)
    ref_nll, _ = reference_stream(windowed, tokens, spec)
    result = engine(windowed, name, budget=budget, positions=positions).stream(tokens)
    torch.testing.assert_close(result.nll, ref_nll, rtol=0, atol=1e-4)


def test_window_at_the_sliding_window_is_refused(windowed, tokens):
    with pytest.raises(UnsupportedModelError, match=f"up to {WINDOW} positions back"):
        engine(windowed, "window", budget=WINDOW).stream(tokens)


def test_inactive_sliding_window_is_ignored(tokens):
    model = tiny_model("qwen2", sliding_window=WINDOW, use_sliding_window=False)
    engine(model, "full", budget=None).stream(tokens)


def test_attention_softcapping_refused():
    model = Gemma2ForCausalLM(Gemma2Config(**SMALL, num_key_value_heads=1, head_dim=16))
    assert model.config.attn_logit_softcapping is not None
    with pytest.raises(UnsupportedModelError, match="attn_logit_softcapping"):
        engine(model, "window")


@pytest.mark.parametrize(
    "model",
    [
        lambda: BloomForCausalLM(BloomConfig(hidden_size=32, n_layer=2, n_head=2, vocab_size=61)),
        lambda: FalconForCausalLM(FalconConfig(**FALCON)),
    ],
    ids=["bloom", "falcon-alibi"],
)
def test_alibi_refused(model):
    with pytest.raises(UnsupportedModelError, match="ALiBi"):
        engine(model(), "window")


def test_dynamic_rope_refused_with_cache_positions(tokens):
    model = tiny_model("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="dynamic RoPE.*positions=original"):
        engine(model, "streaming_llm", positions="cache")
    engine(model, "streaming_llm", positions="original").stream(tokens)


def test_per_layer_rotary_frequencies_refused():
    model = tiny_model("llama")
    other = copy.deepcopy(model.model.rotary_emb)
    other.inv_freq = other.inv_freq * 2
    model.model.layers[0].rotary_emb = other
    with pytest.raises(UnsupportedModelError, match="different rotary frequencies"):
        check_model(model, "original")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"s_aux": torch.zeros(4)}, "passes s_aux"),
        ({"softcap": 30.0}, "passes softcap"),
        ({"sliding_window": 8}, "sliding window of 8 that its config does not declare"),
    ],
)
def test_unknown_attention_keywords_refused(kwargs, message):
    model = tiny_model("llama")
    module = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 3, 16)
    kv = torch.zeros(1, 2, 3, 16)
    with pytest.raises(UnsupportedModelError, match=message):
        bounded_attention(module, q, kv, kv, None, 0.25, kv_memory=object(), position_ids=None, **kwargs)


def test_refused_before_any_forward(windowed, tokens, monkeypatch: pytest.MonkeyPatch):
    calls = []
    monkeypatch.setattr(windowed, "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(UnsupportedModelError):
        engine(windowed, "h2o").stream(tokens)
    assert not calls


def test_install_restores_the_attention_implementation(tokens):
    """The bounded attention holds only while installed: inside a stream, or a ``with install(model):``
    block, even one left by an error."""
    model = tiny_model("llama")
    model.set_attn_implementation("eager")
    seen = []
    engine(model, "h2o").stream(
        tokens[:12], on_chunk=lambda *_: seen.append(model.config._attn_implementation)
    )
    assert set(seen) == {ATTENTION_NAME}
    assert model.config._attn_implementation == "eager"
    with pytest.raises(RuntimeError, match="left"):
        with install(model):
            assert model.config._attn_implementation == ATTENTION_NAME
            raise RuntimeError("left")
    assert model.config._attn_implementation == "eager"
