"""The architecture matrix (checks/architectures.py): every causal LM type of transformers' registry, built
tiny and streamed, is exact (against its own forward pass and the reference) or refused, never wrong.

The types come from ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` at collection, so a model type that a new
transformers adds gets its own test without a code change. ``python -m checks.architectures`` prints the
same matrix as a table (docs/models.md).
"""

from __future__ import annotations

import pytest
import torch
from conftest import record_max

from checks.architectures import (
    BUDGET,
    CHUNK,
    PASSING,
    TOLERANCE,
    Row,
    _Case,
    causal_lm_types,
    classify,
    engine_nll,
    main,
    own_nll,
    stream_tokens,
    table,
    tiny_config,
    tiny_model,
)
from rmm import integration
from rmm.engine import StreamingEngine
from rmm.errors import UnsupportedModelError
from rmm.model_config import check_attention_heads
from rmm.policies import make_policy
from rmm.reference import ReferenceSpec, reference_stream
from rmm.rotary import Rotary, table_frequencies

TYPES = causal_lm_types()
# the architectures the harness is documented to support: the matrix must find them exact
SUPPORTED = (
    "llama", "mistral", "qwen2", "gpt_neox", "gemma3_text", "qwen3_next", "lfm2",
    "deepseek_v2", "deepseek_v3", "gemma4_text", "gemma4_unified", "jetmoe", "falcon", "minimax_m3_vl_text",
    "mimo_v2_flash", "doge",
)  # fmt: skip


def test_the_types_come_from_the_registry():
    assert set(SUPPORTED) <= set(TYPES) and len(TYPES) > 100
    assert "bart" not in TYPES  # encoder-decoder types are left out


# one type per attention family, in the fast suite (`make test`); the whole registry is slow (about 130 s
# single-threaded; `make test-all`): rotate_half RoPE with GQA, partial rotary, sliding and global layers,
# soft-capping, k-norm, a sin/cos table with interleaved pairing, interleaved inv_freq, NoPE layers, learned
# absolute positions, sinks, MoE; hybrid recurrent (gated delta rule) and convolutional mixers; multi-head
# latent attention (rotated last channels, half and interleaved pairing); per-layer head shapes and
# proportional RoPE (Gemma 4); KV heads handed tiled (JetMoE); a config rotary_dim the model ignores
# (MiniMax-M3); per-layer KV heads only the attention modules state, values of their own head dimension
# (MiMo-V2-Flash); and the refused: no attention switch
FAMILIES = (
    "llama", "gpt_neox", "gemma3_text", "gemma2", "qwen3", "gptj", "cohere", "smollm3", "gpt2", "gpt_oss",
    "mixtral", "falcon", "deepseek_v2", "deepseek_v3", "qwen3_next", "lfm2", "gemma4_text", "jetmoe",
    "minimax_m3_vl_text", "mimo_v2_flash", "gpt_neox_japanese",
)  # fmt: skip


@pytest.mark.parametrize(
    "model_type", [pytest.param(t, marks=[pytest.mark.slow] * (t not in FAMILIES)) for t in TYPES]
)
def test_an_architecture_is_exact_or_refused(model_type):
    row = classify(model_type)
    assert row.status in PASSING, f"{model_type}: {row.status}: {row.reason}"
    if row.status.startswith("exact"):
        record_max("per-token |dNLL| of the architecture matrix's exact rows, fp32", row.max_dnll)
    if model_type in SUPPORTED:
        assert row.status == "exact", row.reason


# attention the harness does not serve, and the reason it must give (before the first scored token)
REFUSED = {
    "diffllama": r"calls attention twice per layer and pass \(same queries and keys, other values\)",
    "gpt_neox_japanese": r"did not switch to the attention function 'rmm_bounded'",
    "xlnet": r"did not switch to the attention function 'rmm_bounded'",  # not bounded by its -1 positions
    "git": r"computes with its attention mask as a tensor \(add\): it applies the mask itself, to "
    r"attention scores it computes outside transformers' attention interface",
}
# what the config (and the model's forward signature) refuses, before any token streams
REFUSED_UP_FRONT = {
    "mamba": r"has no attention layers, so it keeps no KV cache and there is nothing for a KV eviction "
    r"policy to bound: its config states no attention heads \(num_attention_heads\), its layer types "
    r"are linear_attention",
    "rwkv": r"has no attention layers, so it keeps no KV cache",
    "xlstm": r"has no attention layers, so it keeps no KV cache",
    "blt": r"splits its attention layers over sub-models with their own layers and heads \(decoder_config, "
    r"encoder_config, global_config, patcher_config\)",
    "minimax": r"keeps the state of its linear_attention layers in a cache class of its own "
    r"\(MiniMaxCache\), which its forward requires instead of transformers' DynamicCache",
}


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_attention_the_harness_does_not_serve_is_refused_with_its_reason(model_type):
    model = tiny_model(model_type)
    with pytest.raises(UnsupportedModelError, match=REFUSED[model_type]):
        engine = StreamingEngine(model, make_policy({"name": "full"}, budget=None, chunk=64))
        engine.self_check(stream_tokens(model))


def test_per_layer_heads_nothing_states_are_refused(monkeypatch):
    """MiMo-V2-Flash's sliding layers hold twice the config's KV heads; the memory reads that from the
    attention modules' key projections. Where nothing states a layer's own count, the first call with other
    heads is refused with the reason, before any token is scored."""
    model = tiny_model("mimo_v2_flash")
    monkeypatch.setattr(integration, "module_shapes", lambda model, stated: None)
    reason = r"hands attention 4 KV heads in layer 1, not the layer's 2 nor copies of them"
    with pytest.raises(UnsupportedModelError, match=reason):
        engine = StreamingEngine(model, make_policy({"name": "full"}, budget=None, chunk=64))
        engine.self_check(stream_tokens(model))


@pytest.mark.parametrize("model_type", sorted(REFUSED_UP_FRONT))
def test_what_the_config_refuses_is_refused_before_streaming(model_type):
    model = tiny_model(model_type)
    with pytest.raises(UnsupportedModelError, match=REFUSED_UP_FRONT[model_type]):
        StreamingEngine(model, make_policy({"name": "full"}, budget=None, chunk=64))
    if model_type != "minimax":  # from the config alone, before the weights load (rmm.runner.build)
        with pytest.raises(UnsupportedModelError, match=REFUSED_UP_FRONT[model_type]):
            check_attention_heads(tiny_config(model_type).get_text_config(), f"X ({model_type})")


def test_a_model_whose_queries_depend_on_absolute_positions_runs_at_original_positions_only():
    """Beam's NoPE full-attention layers scale their queries by the absolute position (scalable softmax):
    exact at original positions; under positions=cache, which renumbers positions, refused with that
    reason for a position rule and a score-based policy alike (the reference, which renumbers them
    physically, differs from the model at original distances)."""
    model = tiny_model("beam")
    tokens = stream_tokens(model)
    reason = r"layer 1 changes its queries with their absolute position beyond RoPE"
    for policy in ("window", "h2o"):
        engine = StreamingEngine(model, make_policy({"name": policy}, budget=BUDGET, chunk=CHUNK))
        engine.self_check(tokens)
        cached = StreamingEngine(
            model, make_policy({"name": policy}, budget=BUDGET, chunk=CHUNK), positions="cache"
        )
        with pytest.raises(UnsupportedModelError, match=reason):
            cached.self_check(tokens)


def test_image_blocks_of_a_text_stream_are_no_mask_the_stream_evaluates():
    """Gemma 4 unified ORs its causal masks with its image blocks (use_bidirectional_attention="vision"),
    a per-pass tensor that a token stream leaves empty: the stream builds its masks without it and equals
    the model's own forward; the config is restored afterwards."""
    model = tiny_model("gemma4_unified")
    tokens = stream_tokens(model)
    got = engine_nll(model, tokens, _Case("full", "full", None, 16, "original", "own"))
    assert float((got - own_nll(model, tokens)).abs().max()) <= TOLERANCE
    assert model.config.get_text_config().use_bidirectional_attention == "vision"


def test_tiny_configs_are_small_and_keep_the_layer_kinds():
    config = tiny_config("gemma3_text")  # default: five sliding layers to one global, 26 layers
    assert config.num_hidden_layers == 4 and config.hidden_size == 64 and config.sliding_window == 16
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    assert tiny_config("gpt2").n_layer == 4  # through the config's attribute_map
    # hybrid models keep attention between their mixers, as their checkpoints do, where the default has none
    assert tiny_config("lfm2").layer_types == ["conv", "full_attention"] * 2
    assert tiny_config("bamba").layer_types == ["linear_attention", "full_attention"] * 2
    assert tiny_config("granitemoehybrid").layer_types == ["linear_attention", "full_attention"] * 2
    # per-layer shapes: one period of the default's layer types, the full layer twice as wide (Gemma 4)
    gemma4 = tiny_config("gemma4_text")
    assert gemma4.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert [c.head_dim for c in gemma4.per_layer_config] == [16] * 5 + [32]


def test_the_table_is_sorted_and_counted(tmp_path, capsys):
    rows = [Row("b", "refused", "no | way"), Row("a", "exact", "", 1e-6)]
    text = table(rows, "python -m checks.architectures")
    assert text.index("| a | exact") < text.index("| b | refused | no / way |")
    assert "2 types: exact: 1, refused: 1" in text and "Made by `python -m checks.architectures`" in text
    out = tmp_path / "matrix.md"
    assert main(["--types", "gpt2", "--out", str(out)]) == 0
    assert "| gpt2 | refused |" in out.read_text() and "--types gpt2" in out.read_text()


@pytest.mark.parametrize("model_type", ["gptj", "codegen"])
def test_sin_cos_table_rotary_moves_keys_exactly(model_type):
    """GPT-J and CodeGen keep their rotary positions as a sin/cos table (``embed_positions``, no
    ``inv_freq`` buffer) and rotate the interleaved pairs of their first ``rotary_dim`` channels: the
    harness reads the frequencies from the table, the self-check picks the interleaved pairing, and
    ``positions=cache`` matches the reference (told the same partial rotary) token by token."""
    model = tiny_model(model_type)
    config, tokens = model.config, stream_tokens(model)
    rotary = Rotary(model)
    dim = config.rotary_dim
    assert [r.name for r in rotary.candidates] == ["transformer.rotary_emb.embed_positions"]
    expected = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    torch.testing.assert_close(rotary.layers[0].inv_freq.double(), expected, rtol=1e-6, atol=0)
    assert rotary.max_positions == config.max_position_embeddings  # past its table the model fails
    engine = StreamingEngine(
        model, make_policy({"name": "h2o"}, budget=BUDGET, chunk=CHUNK), positions="cache"
    )
    engine.self_check(tokens)
    assert {name for name, _ in engine.checked.rotations.values()} == {
        "transformer.rotary_emb.embed_positions/interleaved"
    }
    own = own_nll(model, tokens)
    for policy in ("h2o", "window"):
        got = engine_nll(model, tokens, _Case("", policy, BUDGET, CHUNK, "cache", "reference"))
        spec = ReferenceSpec(policy=policy, budget=BUDGET, chunk=CHUNK, positions="cache")
        assert float((got - reference_stream(model, tokens, spec)[0]).abs().max()) <= TOLERANCE
        assert float((got - own).abs().max()) > 0.1  # the budget binds
    too_long = torch.zeros(config.max_position_embeddings + 1, dtype=torch.long)
    with pytest.raises(UnsupportedModelError, match="rotary sin/cos table of"):  # refused, not an IndexError
        StreamingEngine(model, make_policy({"name": "h2o"}, budget=BUDGET, chunk=CHUNK)).self_check(too_long)


def test_an_additive_sinusoidal_table_is_no_rotation():
    """CTRL adds a sin/cos table to its embeddings (``pos_encoding``, outside a rotary module): no rotation,
    so positions=cache is refused as for learned positions. A table is read in either order and only
    when every row is sin and cos of one frequency times the position."""
    ctrl = tiny_model("ctrl")
    assert Rotary(ctrl).candidates == []
    with pytest.raises(UnsupportedModelError, match="no rotary position embedding"):
        StreamingEngine(ctrl, make_policy({"name": "h2o"}, budget=BUDGET, chunk=CHUNK), positions="cache")
    assert Rotary(tiny_model("llama")).max_positions is None  # frequencies cover every position
    angles = torch.arange(50.0)[:, None] * torch.tensor([1.0, 0.1, 0.01])
    assert torch.allclose(table_frequencies(torch.cat([angles.sin(), angles.cos()], 1)), angles[1])
    assert torch.allclose(table_frequencies(torch.cat([angles.cos(), angles.sin()], 1)), angles[1])
    noisy = torch.cat([angles.sin(), angles.cos()], 1)
    noisy[30, 0] += 0.01
    assert table_frequencies(noisy) is None and table_frequencies(torch.randn(50, 6)) is None
