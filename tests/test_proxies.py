"""CPU proxies for what could break on a GPU cluster: bf16 streaming, and each shipped model's geometry."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from conftest import TINY, tiny_model
from omegaconf import OmegaConf
from test_policies import BUDGET, CASES, retained_sets
from transformers import AutoModelForCausalLM

from rmm.engine import StreamingEngine
from rmm.integration import Rotary
from rmm.models import config_from_architecture, describe_model
from rmm.policies import make_policy
from rmm.reference import ReferenceSpec, reference_stream

CONF_MODEL = Path(__file__).resolve().parents[1] / "conf" / "model"
SHIPPED = sorted(p.stem for p in CONF_MODEL.glob("*.yaml") if p.stem != "local")

# bf16 against the fp32 reference, per policy case (chunk 1 and 4, both position modes):
BF16_MEAN_NLL_ATOL = 0.05  # |mean NLL (bf16 engine) - mean NLL (fp32 reference)| per stream
BF16_TOKEN_NLL_ATOL = 0.05  # per-token |NLL difference| while the retained sets are identical
BF16_ARGMAX_AGREEMENT = 0.9  # fraction of tokens whose argmax (correct) agrees
# fraction of (boundary, layer, KV head) retained sets identical to the reference's, averaged over a
# policy's cases: exact for rules that depend on positions only, and for h2o's accumulated sums; lower
# for policies that rank near-tied scores (tova ranks by one query's attention), where one flipped tie
# changes every later set (eviction is permanent)
BF16_SAME_SETS = {"full": 1.0, "window": 1.0, "streaming_llm": 1.0, "random": 1.0, "h2o": 1.0}
BF16_SAME_SETS |= {"rmm": 0.9, "oracle": 0.9, "tova": 0.6}
BF16_SET_OVERLAP = 0.8  # per case, mean |engine set & reference set| / |union| over all sets


def bf16_matrix(arch: str, tokens: torch.Tensor) -> dict[str, list[dict[str, float]]]:
    """Every policy case through the engine in bf16, against the fp32 reference: agreement per case."""
    fp32, bf16 = tiny_model(arch), tiny_model(arch).to(torch.bfloat16)
    rows: dict[str, list[dict[str, float]]] = {}
    for (name, params), chunk, positions in itertools.product(CASES, [1, 4], ["original", "cache"]):
        if name == "rmm" and params["lag"] >= BUDGET - chunk + 1:
            continue
        spec = ReferenceSpec(policy=name, budget=BUDGET, chunk=chunk, positions=positions, **params)
        ref_nll, ref_correct = reference_stream(fp32, tokens, spec)
        result, sets = retained_sets(bf16, tokens, name, params, chunk=chunk, positions=positions)
        pairs = [
            (set(head), set(spec.retained_log[now][layer][h]))
            for now, engine_set in sets.items()
            for layer, heads in enumerate(engine_set)
            for h, head in enumerate(heads)
        ]
        same = [a == b for a, b in pairs]
        overlap = [len(a & b) / max(len(a | b), 1) for a, b in pairs]
        split = [now for now, engine_set in sets.items() if engine_set != spec.retained_log[now]]
        first_split = min(split, default=len(tokens))  # queries before it saw identical sets
        diff = (result.nll - ref_nll).abs()
        rows.setdefault(name, []).append(
            {
                "mean_nll_diff": abs(result.nll.double().mean().item() - ref_nll.double().mean().item()),
                "token_nll_diff_while_same": float(diff[:first_split].max()) if first_split else 0.0,
                "argmax_agreement": float((result.correct == ref_correct).float().mean()),
                "same_sets": sum(same) / len(same),
                "set_overlap": sum(overlap) / len(overlap),
            }
        )
    return rows


def check_bf16(rows: dict[str, list[dict[str, float]]]) -> None:
    for name, cases in rows.items():
        for case in cases:
            assert case["mean_nll_diff"] <= BF16_MEAN_NLL_ATOL, (name, case)
            assert case["token_nll_diff_while_same"] <= BF16_TOKEN_NLL_ATOL, (name, case)
            assert case["argmax_agreement"] >= BF16_ARGMAX_AGREEMENT, (name, case)
            assert case["set_overlap"] >= BF16_SET_OVERLAP, (name, case)
        same = sum(c["same_sets"] for c in cases) / len(cases)
        assert same >= BF16_SAME_SETS[name], (name, same)


def test_bf16_policy_matrix_llama(tokens):
    check_bf16(bf16_matrix("llama", tokens))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "mistral", "gpt_neox"])
def test_bf16_policy_matrix(tokens, arch):
    check_bf16(bf16_matrix(arch, tokens))


def geometry_model(stem: str, n_layers: int = 2) -> torch.nn.Module:
    """A tiny random model with a shipped config's attention geometry and rotary settings.

    Keeps head_dim, the GQA ratio (with at most 2 KV heads), rope theta and scaling, the sliding window
    and the position range; shrinks layers, hidden size, MLP and vocabulary.
    """
    arch = OmegaConf.to_container(OmegaConf.load(CONF_MODEL / f"{stem}.yaml").architecture)
    ratio = arch["num_attention_heads"] // arch["num_key_value_heads"]
    n_kv = min(arch["num_key_value_heads"], 2)
    config = config_from_architecture(
        arch,
        num_hidden_layers=n_layers,
        hidden_size=16 * n_kv * ratio,  # a multiple of the head count, as configs require
        intermediate_size=TINY["intermediate_size"],
        vocab_size=TINY["vocab_size"],
        num_key_value_heads=n_kv,
        num_attention_heads=n_kv * ratio,
        initializer_range=TINY["initializer_range"],
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)


@pytest.mark.parametrize("stem", SHIPPED)
def test_geometry_rotation_composes_over_the_context(stem):
    """Re-rotating a key by d equals the model's own RoPE at p + d, anywhere in its context."""
    model = geometry_model(stem, n_layers=1)
    dims = describe_model(model)
    context = dims["max_position_embeddings"]
    x = torch.randn(1, dims["n_kv_heads"], 6, dims["head_dim"], generator=torch.Generator().manual_seed(0))
    p = torch.tensor([0, 7, 4095, context // 4, context // 2, context - 1])
    d = torch.tensor([5, context // 2, -4000, 3, -(context // 2) + 1, -(context - 1)])
    rope = model.model.rotary_emb
    cos, sin = rope(x, p[None])
    cos2, sin2 = rope(x, (p + d)[None])
    rotary = Rotary(model)
    at_p = _model_rotate(x, cos, sin, rotary.rot_dim)
    expected = _model_rotate(x, cos2, sin2, rotary.rot_dim)
    torch.testing.assert_close(rotary.rotate(at_p[0], d), expected[0], atol=2e-2, rtol=0)


def _model_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int) -> torch.Tensor:
    """The ``rotate_half`` RoPE of Llama-family models, as they apply it (cos/sin [1, P, rot_dim])."""
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    half = rot_dim // 2
    rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos[:, None] + rotated_half * sin[:, None], rest], dim=-1)


@pytest.mark.parametrize("stem", SHIPPED)
def test_geometry_proxy_matches_reference(stem, tokens):
    """Each shipped geometry (GQA ratio, head_dim, rope theta and scaling, window) against the reference."""
    model = geometry_model(stem)
    for (name, params), positions in itertools.product(
        [("window", {}), ("streaming_llm", {"sinks": 2}), ("h2o", {}), ("rmm", {"lag": 3})],
        ["original", "cache"],
    ):
        spec = ReferenceSpec(policy=name, budget=BUDGET, chunk=4, positions=positions, **params)
        ref_nll, ref_correct = reference_stream(model, tokens, spec)
        result, sets = retained_sets(model, tokens, name, params, chunk=4, positions=positions)
        torch.testing.assert_close(result.nll, ref_nll, rtol=0, atol=1e-4, msg=f"{stem} {name} {positions}")
        assert torch.equal(result.correct, ref_correct)
        assert all(engine_set == spec.retained_log[now] for now, engine_set in sets.items())
    full = StreamingEngine(model, make_policy({"name": "full"}, None, 16)).stream(tokens)
    model.set_attn_implementation("sdpa")
    expected = model(tokens[None], labels=tokens[None], use_cache=False).loss.item()
    assert abs(full.nll.double().mean().item() - expected) / expected < 1e-5
