"""The memory planner's figures against the tensors the engine actually allocates."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_model

from experiments import plan as planner
from rmm import integration, runner
from rmm.data import DatasetStats, Document
from rmm.engine import StreamingEngine
from rmm.models import config_from_architecture
from rmm.policies import make_policy

N_TOKENS = 48


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    model = tiny_model("llama")
    path = tmp_path_factory.mktemp("tiny")
    model.config.save_pretrained(path)  # the planner reads config.json only
    return path, model


def compose(path: Path, *overrides: str):
    return planner.compose_config(
        ["model=local", f"model.path={path}", "dtype=float32", f"dataset.max_tokens={N_TOKENS}", *overrides]
    )


def nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def allocated(
    model, policy, positions: str = "original", observed: bool = False, allocation: str = "uniform"
) -> tuple[int, int]:
    """(KV bytes, scratch bytes) the engine allocates for the first chunk of an N_TOKENS stream
    (``observed``: with an attention observer, as the reference pass)."""
    engine = StreamingEngine(model, policy, positions=positions, allocation=allocation)
    plan = engine.plan.observed() if observed else engine.plan
    memory = engine.new_memory(N_TOKENS, plan)
    logits_shapes = []
    if plan.record_attention:
        store = memory.store_attention
        memory.store_attention = lambda layer, probs: (logits_shapes.append(probs.shape), store(layer, probs))
    # a chunk past the budget: the steady state, where position rules re-rotate their sinks
    query_pos = torch.arange(plan.slots(N_TOKENS)[1]) + (policy.budget or 0)
    position_ids = memory.begin_chunk(query_pos)
    with integration.install(model):
        model(
            input_ids=query_pos[None] % model.config.vocab_size,
            position_ids=position_ids[None],
            kv_memory=memory,
            use_cache=False,
        )
    kv = nbytes(memory.keys, memory.values, memory.key_pos, *memory.state.values())
    scratch = nbytes(memory._allowed, memory._blocked, memory._other_bias, memory.attn, memory.utility)
    if logits_shapes:  # fp32 logits, masked logits and probabilities [n_heads, Q, S]: one layer's at a
        kv_heads, queries, slots = logits_shapes[0]  # time, every layer's for a backward pass
        kept_layers = len(memory._outputs) if memory.track_gradient else 1
        scratch += kept_layers * 3 * model.config.num_attention_heads * queries * slots * 4
    return kv, scratch


@pytest.mark.parametrize(
    ("overrides", "policy_cfg", "budget", "chunk", "positions"),
    [
        (["policy=window", "budget=16", "chunk=8"], {"name": "window"}, 16, 8, "original"),
        (
            ["policy=streaming_llm", "budget=16", "chunk=8", "positions=cache"],
            {"name": "streaming_llm"},
            16,
            8,
            "cache",
        ),
        (["policy=full", "chunk=8"], {"name": "full"}, None, 8, "original"),
        (["policy=h2o", "budget=16", "chunk=4"], {"name": "h2o"}, 16, 4, "original"),
        (["policy=rmm", "budget=16", "chunk=4", "lag=8"], {"name": "rmm", "lag": 8}, 16, 4, "original"),
        (["policy=tova", "budget=16", "chunk=4", "positions=cache"], {"name": "tova"}, 16, 4, "cache"),
        (
            ["policy=rmm", "budget=16", "chunk=4", "lag=8", "policy.weight=gradient"],
            {"name": "rmm", "lag": 8, "weight": "gradient"},
            16,
            4,
            "original",
        ),
    ],
    ids=["window", "streaming_llm-cache", "full", "h2o", "rmm", "tova-cache", "rmm-gradient"],
)
def test_kv_and_scratch_match_allocations(saved, overrides, policy_cfg, budget, chunk, positions):
    path, model = saved
    result = planner.plan(compose(path, *overrides))
    kv, scratch = allocated(model, make_policy(policy_cfg, budget, chunk), positions)
    assert result.kv_bytes == kv
    assert result.scratch_bytes == scratch
    assert result.weights_bytes == nbytes(*model.parameters())
    assert result.reference_pass_bytes == 0
    expected_total = result.weights_bytes + result.kv_bytes + result.scratch_bytes + result.activation_bytes
    assert result.total_bytes == expected_total


@pytest.mark.parametrize("allocation", ["adaptive", "pyramid"])
def test_allocations_plan_their_retained_slots(saved, allocation):
    """The planner counts R from the allocation (the largest per-head capacity), as the engine does."""
    path, model = saved
    result = planner.plan(compose(path, "policy=h2o", "budget=16", "chunk=4", f"allocation={allocation}"))
    policy = make_policy({"name": "h2o"}, 16, 4)
    kv, scratch = allocated(model, policy, allocation=allocation)
    assert result.kv_bytes == kv and result.scratch_bytes == scratch
    assert kv > allocated(model, policy)[0]  # more slots than uniform's B', masks carry the rest


def test_reference_pass_matches_the_oracle_window(saved):
    """The oracle's reference pass: a window of the whole stream, recording attention, chunk 256."""
    path, model = saved
    result = planner.plan(compose(path, "policy=oracle", "budget=16", "chunk=4"))
    window = make_policy({"name": "window"}, budget=N_TOKENS, chunk=min(256, N_TOKENS))
    kv, scratch = allocated(model, window, observed=True)
    activations = planner.activation_bytes(
        planner.model_architecture(compose(path).model), N_TOKENS, torch.float32
    )
    assert result.reference_pass_bytes == kv + scratch + activations


def test_largest_chunk_is_the_boundary(saved):
    path, _ = saved
    cfg = compose(path, "policy=h2o", "budget=32", "chunk=4")
    gpu = planner.plan(cfg, chunk=10).total_bytes
    assert planner.largest_chunk(cfg, gpu) == 10
    assert planner.largest_chunk(cfg, 10**15) == 32  # chunk <= budget
    assert planner.largest_chunk(cfg, 1000) is None


def test_cli_json(saved, capsys: pytest.CaptureFixture[str]):
    path, _ = saved
    planner.main(
        ["model=local", f"model.path={path}", f"dataset.max_tokens={N_TOKENS}", "--json", "--gpu-memory", "1"]
    )
    out = json.loads(capsys.readouterr().out)
    for key in ("weights_bytes", "kv_bytes", "scratch_bytes", "reference_pass_bytes", "total_bytes"):
        assert isinstance(out[key], int) and out[key] >= 0
    assert out["largest_chunk"] >= 1


def test_shipped_model_plans_offline():
    cfg = planner.compose_config(
        ["model=llama3_8b", "budget=4096", "chunk=256", "policy=rmm", "dataset.max_tokens=65536"]
    )
    result = planner.plan(cfg)
    arch = cfg.model.architecture
    slots = arch.num_hidden_layers * arch.num_key_value_heads * (4096 + 1)  # B - C + 1 retained + C
    assert result.kv_bytes == slots * (2 * arch.head_dim * 2 + 8 + 4)  # bf16 K/V, int64 position, fp32 DU
    assert 7.9e9 < result.weights_bytes / 2 < 8.1e9  # Llama-3-8B: 8.03 billion parameters


def test_needs_a_stream_length(saved):
    path, _ = saved
    with pytest.raises(ValueError, match="dataset.max_tokens"):
        planner.plan(compose(path, "dataset.max_tokens=null"))


def test_gradient_weight_plans_the_backward_pass(saved):
    """rmm(weight=gradient) keeps every layer's activations and attention for its backward pass."""
    path, _ = saved
    correct = planner.plan(compose(path, "policy=rmm", "budget=16", "chunk=4", "lag=8"))
    gradient = planner.plan(
        compose(path, "policy=rmm", "budget=16", "chunk=4", "lag=8", "policy.weight=gradient")
    )
    assert gradient.kv_bytes == correct.kv_bytes
    assert gradient.scratch_bytes > correct.scratch_bytes
    assert gradient.activation_bytes > correct.activation_bytes


@pytest.mark.parametrize("model", sorted(p.stem for p in (planner.CONF / "model").glob("*.yaml")))
def test_planner_and_runner_agree_on_the_reference_context(saved, model, monkeypatch):
    """Every shipped model config: the planner plans a reference pass of the window the runner builds,
    and refuses, with the runner's message, the streams and windows the runner refuses (for instance
    qwen2_5_7b's 65536-token streams, beyond its max_context 32768)."""
    local = [f"model.path={saved[0]}"] if model == "local" else []
    base = planner.compose_config(
        [f"model={model}", *local, "policy=oracle", "budget=16", "chunk=4", "device=cpu"]
    )
    arch = planner.model_architecture(base.model)
    limit = base.model.max_context or arch["max_position_embeddings"]
    monkeypatch.setattr(planner, "parameter_count", lambda arch: 0)  # no weights are built or loaded
    loaded = SimpleNamespace(config=config_from_architecture(arch))
    monkeypatch.setattr(runner, "load_model", lambda *args: (loaded, None))
    outcomes = set()
    for n_tokens in (limit, limit + 1):
        stream = Document("doc", torch.zeros(n_tokens, dtype=torch.long), {})
        monkeypatch.setattr(
            runner, "load_documents", lambda *a, s=stream: ([s], DatasetStats(1, 0, s.tokens.numel()))
        )
        for context in (None, limit - 1, limit + 1):
            cfg = copy.deepcopy(base)
            cfg.dataset.max_tokens, cfg.oracle.context = n_tokens, context
            try:
                planned = planner.plan(cfg).reference_context
            except ValueError as err:
                planned = str(err)
            try:
                ran = runner.build(cfg).reference.context
            except ValueError as err:
                ran = str(err)
            assert planned == ran, (model, n_tokens, context)
            outcomes.add(type(ran))
    assert outcomes == {int, str}, "the grid must hold runs and refusals"
