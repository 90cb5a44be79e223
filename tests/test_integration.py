"""The bounded attention reproduces the model's own attention, windows included, or refuses the model."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from conftest import tiny_model
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    CohereConfig,
    CohereForCausalLM,
    FalconConfig,
    FalconForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from checks.architectures import tiny_model as matrix_model
from rmm import integration, selfcheck
from rmm.engine import StreamingEngine
from rmm.errors import UnsupportedModelError
from rmm.integration import ATTENTION_NAME, bounded_attention, install, tiled_head_order
from rmm.masks import additive
from rmm.policies import make_policy
from rmm.reference import ReferenceSpec, reference_stream

WINDOW = 16  # the tiny models' sliding window; the test streams are longer
FALCON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, vocab_size=61, alibi=True)
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=61)


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 61, (48,), generator=torch.Generator().manual_seed(1))


def engine(model, name: str, budget: int | None = 12, chunk: int = 4, positions: str = "original", **params):
    return StreamingEngine(model, make_policy({"name": name, **params}, budget, chunk), positions=positions)


def plain_nll(model, tokens: torch.Tensor) -> torch.Tensor:
    """Per-token NLL of the model's own forward pass (its own attention implementation)."""
    logits = model(tokens[None], use_cache=False).logits[0, :-1].float()
    return -torch.log_softmax(logits, -1).gather(-1, tokens[1:, None])[:, 0]


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def windowed(request: pytest.FixtureRequest):
    """A tiny model whose every layer applies a sliding window of WINDOW positions."""
    extra = {"use_sliding_window": True, "max_window_layers": 0} if request.param == "qwen2" else {}
    return tiny_model(request.param, sliding_window=WINDOW, **extra)


def test_sliding_window_is_applied(windowed, tokens):
    """Past WINDOW tokens the model's own attention differs from unbounded attention, and the engine
    with an unlimited budget reproduces the windowed one."""
    windowed_nll = plain_nll(windowed, tokens)
    plain_without = plain_nll(tiny_model(windowed.config.model_type, sliding_window=None), tokens)
    assert (windowed_nll - plain_without).abs().max() > 1e-3
    for chunk in (4, 48):
        unbounded = engine(windowed, "full", budget=None, chunk=chunk).stream(tokens)
        torch.testing.assert_close(unbounded.nll, windowed_nll, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "positions", "budget"),
    [
        ("window", "original", 24),
        ("window", "cache", 24),
        ("streaming_llm", "cache", 24),
        ("h2o", "original", 24),
        ("h2o", "cache", 24),
        ("rmm", "cache", 24),
    ],
)
def test_windowed_streams_match_the_reference(windowed, tokens, name, positions, budget):
    """Budgets beyond the window: the window hides what the policy keeps, as in the reference."""
    params = {"lag": 4} if name == "rmm" else {}
    spec = ReferenceSpec(
        policy=name, budget=budget, chunk=1 if name != "h2o" else 4, positions=positions, **params
    )
    ref_nll, _ = reference_stream(windowed, tokens, spec)
    result = engine(windowed, name, budget=budget, positions=positions, chunk=4, **params).stream(tokens)
    torch.testing.assert_close(result.nll, ref_nll, rtol=0, atol=1e-5)


def test_windowed_layers_drop_what_they_hide(windowed, tokens):
    """A score-based policy never keeps an entry its layer's window hides from every later query."""
    kept = []
    eng = engine(windowed, "h2o", budget=24, chunk=4)
    eng.stream(
        tokens, on_boundary=lambda memory, now, evicted: kept.append((now, memory.retained_positions()))
    )
    for now, positions in kept:
        held = positions[positions >= 0]
        assert int(held.min()) > now - WINDOW, f"an entry the window hides was kept at {now}"


def test_inactive_sliding_window_is_ignored(tokens):
    model = tiny_model("qwen2", sliding_window=WINDOW, use_sliding_window=False)
    engine(model, "full", budget=None).stream(tokens)


def test_attention_softcapping_and_hybrid_windows(tokens):
    """Gemma 2: logit soft-capping and alternating sliding/global layers, against its own forward and
    the reference (the model's eager attention)."""
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(
        Gemma2Config(
            **SMALL, num_key_value_heads=1, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=5.0
        )
    ).eval()
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    full = engine(model, "full", budget=None).stream(tokens)
    torch.testing.assert_close(full.nll, plain_nll(model, tokens), rtol=0, atol=1e-5)
    for positions in ("original", "cache"):
        spec = ReferenceSpec(policy="h2o", budget=20, chunk=4, positions=positions)
        ref_nll, _ = reference_stream(model, tokens, spec)
        result = engine(model, "h2o", budget=20, positions=positions).stream(tokens)
        torch.testing.assert_close(result.nll, ref_nll, rtol=0, atol=1e-5)


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


def test_rotation_calibrated_against_the_model(tokens):
    """A rotary module the model does not use (a decoy in layer 0) is not trusted: the self-check finds
    the rotation the model applies, and cache positions match the reference."""
    model = tiny_model("llama")
    decoy = copy.deepcopy(model.model.rotary_emb)
    decoy.inv_freq = decoy.inv_freq * 2
    model.model.layers[0].rotary_emb = decoy
    eng = engine(model, "h2o", positions="cache")
    assert eng.facts.rotary.layers[0].name == "model.layers.0.rotary_emb.inv_freq"  # the default reading
    result = eng.stream(tokens)
    assert {name for name, _ in eng.checked.rotations.values()} == {"model.rotary_emb.inv_freq"}
    ref_nll, _ = reference_stream(
        model, tokens, ReferenceSpec(policy="h2o", budget=12, chunk=4, positions="cache")
    )
    torch.testing.assert_close(result.nll, ref_nll, rtol=0, atol=1e-5)


def test_interleaved_pairing_and_nope_layers(tokens):
    """Cohere pairs channels (2i, 2i + 1); SmolLM3 leaves every fourth layer unrotated. The self-check
    finds both, so keys move to their cache rank as the model would rotate them there."""
    torch.manual_seed(0)
    cohere = CohereForCausalLM(CohereConfig(**SMALL, num_key_value_heads=1, pad_token_id=None)).eval()
    smollm3 = SmolLM3ForCausalLM(
        SmolLM3Config(**{**SMALL, "num_hidden_layers": 4}, num_key_value_heads=1, pad_token_id=None)
    ).eval()
    for model, expected in ((cohere, ["interleaved"] * 2), (smollm3, ["", "", "", "none"])):
        for positions in ("original", "cache"):
            full = engine(model, "full", budget=None, positions=positions).stream(tokens)
            torch.testing.assert_close(full.nll, plain_nll(model, tokens), rtol=0, atol=1e-5)
        eng = engine(model, "knorm", positions="cache")
        eng.stream(tokens)
        names = [eng.checked.rotations[layer][0] for layer in range(len(expected))]
        assert [
            name.rsplit("/", 1)[-1] if "/" in name or name == "none" else "" for name in names
        ] == expected


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"foo": 1}, "passes foo"), ({"bar": torch.ones(1)}, "passes bar")]
)
def test_unknown_attention_keywords_refused(kwargs, message):
    model = tiny_model("llama")
    module = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 3, 16)
    kv = torch.zeros(1, 2, 3, 16)
    memory = types.SimpleNamespace(keys=torch.zeros(2, 2, 4, 16))
    with pytest.raises(UnsupportedModelError, match=message):
        bounded_attention(module, q, kv, kv, None, 0.25, kv_memory=memory, position_ids=None, **kwargs)


def test_refused_before_any_forward(tokens, monkeypatch: pytest.MonkeyPatch):
    model = tiny_model("llama")
    model.config.index_topk = 8  # a sparse attention indexer, as DeepSeek-V3.2's configs say
    calls = []
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(UnsupportedModelError, match="learned indexer"):
        engine(model, "h2o").stream(tokens)
    assert not calls


def test_a_layer_bypassing_the_registered_attention_is_refused(tokens):
    """A layer whose attention ignores the registered function (its own config keeps sdpa) would give a
    policy's perplexity over chunks that see only themselves: the self-check refuses it."""
    model = tiny_model("llama")
    attention = model.model.layers[1].self_attn
    attention.config = copy.deepcopy(attention.config)
    attention.config.set_attn_implementation = lambda *_: None
    attention.config._attn_implementation = "sdpa"
    forward = attention.forward
    attention.forward = lambda *a, **k: forward(*a, **{**k, "attention_mask": None})  # plain causal sdpa
    with pytest.raises(UnsupportedModelError, match=r"self-check.*layer 1: 0.*bypasses"):
        engine(model, "h2o").stream(tokens)


def test_a_layer_calling_attention_twice_is_refused(tokens):
    """Two calls per layer and pass would overwrite the layer's slots: refused at the second call, which
    says when it has the first call's queries and keys (DiffLlama's two calls differ in values only)."""
    model = tiny_model("llama")
    attention = model.model.layers[0].self_attn
    once = attention.forward

    def twice(*args, **kwargs):
        once(*args, **kwargs)
        return once(*args, **kwargs)

    attention.forward = twice
    with pytest.raises(UnsupportedModelError, match=r"calls attention twice per layer and pass \(layer 0\)"):
        engine(model, "h2o").stream(tokens)
    with pytest.raises(UnsupportedModelError, match=r"twice per layer and pass \(same queries and keys"):
        engine(matrix_model("diffllama"), "full").stream(tokens)


def test_tiled_kv_heads_are_held_once():
    """KV heads handed as copies one after the other (JetMoE: query head i attends KV head i mod n_kv)
    are held once; the query heads are grouped by the KV head they attend."""
    assert tiled_head_order(4, 2, 2).tolist() == [0, 2, 1, 3]
    assert tiled_head_order(8, 2, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]  # two query heads per copy
    assert tiled_head_order(6, 3, 2).tolist() == [0, 2, 4, 1, 3, 5]


def test_layers_that_drop_keywords_still_reach_the_memory(tokens):
    """A layer that does not pass keyword arguments on (StableLM, Nemotron) reads the active memory."""
    model = tiny_model("llama")
    for layer in model.model.layers:
        forward = layer.self_attn.forward
        layer.self_attn.forward = lambda *a, forward=forward, kv_memory=None, **k: forward(*a, **k)
    result = engine(model, "full", budget=None).stream(tokens)
    torch.testing.assert_close(result.nll, plain_nll(model, tokens), rtol=0, atol=1e-5)


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


def test_half_precision_self_check_catches_a_missing_window(
    windowed, tokens, monkeypatch: pytest.MonkeyPatch
):
    """In bf16 the self-check bounds each pass's mean |dNLL| (per-token rounding is too large to bound):
    the right engine passes, one that forgets the model's window is refused."""
    model = copy.deepcopy(windowed).to(torch.bfloat16)
    check = engine(model, "h2o", budget=24).self_check(tokens)
    assert check.worst_pass_mean_dnll <= check.tolerance and check.probe_tokens > WINDOW
    monkeypatch.setattr(
        integration.Visibility, "__call__", lambda self, q, k: k[..., None, :] <= q[..., :, None]
    )
    with pytest.raises(UnsupportedModelError, match="a pass's mean NLL"):
        engine(model, "h2o", budget=24).self_check(tokens)


def test_the_self_check_runs_again_only_for_a_stream_that_needs_a_longer_probe(
    windowed, tokens, monkeypatch: pytest.MonkeyPatch
):
    """An engine checks itself once; a later stream runs the check again only where its probe is longer
    than the checked one (here a stream past the window, after a first one of 20 tokens)."""
    probes = []
    run = selfcheck.self_check
    monkeypatch.setattr(selfcheck, "self_check", lambda e, t: probes.append(t.numel()) or run(e, t))
    checked = engine(windowed, "h2o", budget=24)
    first = checked.self_check(tokens[:20])
    assert checked.self_check(tokens[:20]) is first and checked.self_check(tokens[:10]) is first
    assert probes == [20] and first.probe_tokens == 20
    longer = checked.self_check(tokens)
    assert probes == [20, tokens.numel()] and longer.probe_tokens == selfcheck.probe_length(checked, 48) > 20
    assert checked.self_check(tokens[:30]) is longer and len(probes) == 2


def test_the_self_check_holds_the_stream_against_a_later_forward_pass(tokens):
    """On CPU a process's first forward pass may differ from its later ones (checks/first_forward.py): the
    self-check runs the model's own pass twice and holds the stream against the second. Here the model's
    first call gives other logits; the check passes, and held against that first call it would fail."""
    model = tiny_model("llama")
    calls = []

    def first_call_differs(module, args, kwargs, out):
        calls.append(kwargs.get("input_ids", args[0] if args else None).shape)
        if len(calls) == 1:
            out.logits = out.logits * 1.01
        return out

    model.register_forward_hook(first_call_differs, with_kwargs=True)
    check = engine(model, "h2o", budget=24).self_check(tokens)
    assert check.max_abs_dnll <= check.tolerance
    assert calls[0] == calls[1] == (1, check.probe_tokens)  # the first two calls: the model's own pass
    first = model(tokens[None, : check.probe_tokens], use_cache=False).logits[0, :-1].float() * 1.01
    nll = -torch.log_softmax(first, -1).gather(-1, tokens[1 : check.probe_tokens, None])[:, 0]
    assert (nll - plain_nll(model, tokens[: check.probe_tokens])).abs().max() > 10 * check.tolerance


def test_first_forward_check_compares_three_passes_of_one_process():
    """checks/first_forward.py's child (SmolLM2-135M, 8 tokens, with and without its warm-up call; the
    suite's own process is warm already, conftest.py): the second and the third of three equal passes in
    one process are bit-identical (what the self-check relies on), and the rotary tables are read from
    the model's ``rotary_emb`` module."""
    from checks.first_forward import child

    for warm in (False, True):
        result = child("smollm2_135m", 8, warm)
        assert result["warm"] is warm and result["second_vs_last"] == 0.0
        assert (
            result["rotary_cos_first_vs_last"] is not None and result["rotary_sin_first_vs_last"] is not None
        )


def test_first_forward_check_recognises_vml_low_accuracy_cos():
    """checks/first_forward.py tells a first pass whose cos rows are MKL VML's low-accuracy (EP) cos from one
    whose rows differ otherwise; torch's own cos is VML's high-accuracy one where torch has VML."""
    from checks.first_forward import _is_vml_ep, vml_cos

    module = tiny_model("llama").model.rotary_emb
    positions = torch.arange(48)[None]
    freqs = (module.inv_freq[None, :, None].float() @ positions[:, None, :].float()).transpose(1, 2)
    angles = torch.cat((freqs, freqs), dim=-1)  # [1, 48, D]
    last = angles.cos() * module.attention_scaling
    ep = vml_cos(angles, "EP")
    if ep is None:
        pytest.skip("this torch build exports no MKL VML")
    assert torch.equal(vml_cos(angles, "HA"), angles.cos()) and not torch.equal(ep, angles.cos())
    first = last.clone()
    first[:, 24:] = ep[:, 24:] * module.attention_scaling
    assert _is_vml_ep(module, positions, first, last) is True
    first[:, 24:] = last[:, 24:] + 1e-4
    assert _is_vml_ep(module, positions, first, last) is False
    assert _is_vml_ep(module, positions, last, last) is None


def test_recurrent_layers_the_cache_cannot_carry_are_refused(monkeypatch):
    """Convolutional and recurrent layers are carried by the model's own cache (tests/test_hybrid.py);
    a cache layer the harness does not know, or a model without any attention layer, is refused before
    any forward pass."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    config = Lfm2Config(**SMALL, num_key_value_heads=1, layer_types=["conv", "full_attention"])
    model = Lfm2ForCausalLM(config).eval()
    assert engine(model, "h2o").facts.carried == [0]
    monkeypatch.setattr(integration, "CARRIED_CACHE_LAYERS", ())
    with pytest.raises(UnsupportedModelError, match="cache layers LinearAttentionLayer"):
        engine(model, "h2o")
    monkeypatch.undo()
    config = Lfm2Config(**SMALL, num_key_value_heads=1, layer_types=["conv", "conv"])
    with pytest.raises(UnsupportedModelError, match=r"no attention layer \(its layer types: conv\)"):
        engine(Lfm2ForCausalLM(config).eval(), "h2o")


def test_row_blocks_split_only_the_cpu_explicit_path():
    """The explicit path's gate: on a CPU, blocks of rows whose fp32 probabilities stay within
    CPU_BLOCK_BYTES; every row at once on any other device, and whenever gradients are tracked."""
    rows, heads, group, n_q, dim, slots = 6, 2, 3, 64, 8, 512
    per_row = heads * group * n_q * slots * 4  # fp32 probabilities of one row
    query = torch.zeros(rows, heads, group, n_q, dim)
    blocks = integration.row_blocks(query, slots, whole=False)
    step = max(1, integration.CPU_BLOCK_BYTES // per_row)
    assert [b.stop - b.start for b in blocks] == [min(step, rows - s) for s in range(0, rows, step)]
    assert integration.row_blocks(query, slots, whole=True) == [slice(0, rows)]
    on_device = torch.zeros(rows, heads, group, n_q, dim, device="meta")  # stands for a GPU's tensor
    assert integration.row_blocks(on_device, slots, whole=False) == [slice(0, rows)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_scaling_and_masking_in_one_op_keeps_the_bits(dtype):
    """The explicit path scales its logits and adds the additive mask in one op (mask + scaling * logits):
    its probabilities equal scaling the logits, then hiding keys with masked_fill, bit for bit, at a
    scaling that is no power of two."""
    generator = torch.Generator().manual_seed(0)
    rows, heads, group, n_q, dim, slots = 2, 3, 2, 8, 24, 19
    q = torch.randn(rows, heads, group, n_q, dim, generator=generator).to(dtype)
    keys = torch.randn(rows, heads, slots, dim, generator=generator).to(dtype)
    hidden = torch.rand(rows, heads, n_q, slots, generator=generator) < 0.4
    hidden[..., -1] = False  # every query sees a key
    scaling = dim**-0.5
    probs = integration._probabilities(q, keys, additive(hidden), None, 0, scaling, None, None)
    wide = torch.promote_types(dtype, torch.float32)
    logits = torch.matmul(q.reshape(rows, heads, group * n_q, dim), keys.transpose(-1, -2)).to(wide)
    logits = logits.mul_(scaling).view(rows, heads, group, n_q, slots)
    expected = torch.softmax(logits.masked_fill(hidden[:, :, None], float("-inf")), dim=-1)
    assert probs.dtype == wide and torch.equal(probs, expected)


class _SinkSlots:
    """The memory's side of the sink path for one layer: ``n_sink_slots`` sink slots first, nothing blocked;
    the fused part's additive mask hides the sink slots (they enter through their own logits)."""

    def __init__(self, rows: int, heads: int, n_q: int, slots: int, n_sinks: int, dtype: torch.dtype):
        self.n_sink_slots = n_sinks
        self.blocked = torch.zeros(rows, heads, n_q, slots, dtype=torch.bool)
        self.bias = torch.zeros(rows, 1, n_q, slots, dtype=dtype)
        self.bias[..., :n_sinks] = float("-inf")

    def blocked_mask(self, layer: int) -> torch.Tensor:
        return self.blocked

    def folded_mask(self, layer: int, group: int, bias: bool = False) -> torch.Tensor:
        return self.bias.repeat(1, 1, group, 1)


@pytest.mark.parametrize("merged_by_lse", [True, False], ids=["cpu-lse", "bias"])
def test_sink_slots_in_bfloat16_stay_near_the_exact_attention(monkeypatch, merged_by_lse):
    """positions=cache in bfloat16 with sinks holding about three quarters of the attention: both ways of
    adding the re-rotated sink logits (the CPU's merge by log-sum-exps, the additive bias a GPU takes) stay
    within 1.25 % of the float64 attention, relative to its largest output. The sink logits are computed
    in float32 from the start; rounded to bfloat16 first they were up to 1.8 % and 2.7 % off."""
    monkeypatch.setattr(integration, "_cpu_kernel_with_lse", lambda query: merged_by_lse)
    rows, heads, group, n_q, dim, slots, n_sinks = 2, 2, 2, 8, 64, 40, 4
    worst = 0.0
    for seed in range(4):
        generator = torch.Generator().manual_seed(seed)
        shape = (rows, heads, group, n_q, dim)
        q = torch.randn(shape, generator=generator, dtype=torch.float64)
        sink_q = q + 0.3 * torch.randn(shape, generator=generator, dtype=torch.float64)
        keys = torch.randn(rows, heads, slots, dim, generator=generator, dtype=torch.float64)
        direction = sink_q.mean(dim=(2, 3))  # sink keys along the queries: large sink logits
        keys[:, :, :n_sinks] = (
            0.5 * keys[:, :, :n_sinks]
            + 18 * direction[:, :, None] / direction.norm(dim=-1, keepdim=True)[..., None]
        )
        values = torch.randn(rows, heads, slots, dim, generator=generator, dtype=torch.float64)
        scaling = dim**-0.5
        logits = torch.matmul(q.reshape(rows, heads, group * n_q, dim), keys.transpose(-1, -2)) * scaling
        sink_logits = torch.matmul(sink_q, keys[:, :, None, :n_sinks].transpose(-1, -2)) * scaling
        logits[..., :n_sinks] = sink_logits.reshape(rows, heads, group * n_q, n_sinks)
        probabilities = torch.softmax(logits, dim=-1)
        assert 0.7 < float(probabilities[..., :n_sinks].sum(-1).mean()) < 0.85
        expected = probabilities @ values
        memory = _SinkSlots(rows, heads, n_q, slots, n_sinks, torch.bfloat16)
        low = [x.to(torch.bfloat16) for x in (q, sink_q, keys, values)]
        out = integration._attention_with_sinks(*low, memory, 0, scaling)
        worst = max(worst, float((out.double() - expected).abs().max() / expected.abs().max()))
    assert worst < 0.0125
