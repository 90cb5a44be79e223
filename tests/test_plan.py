"""The memory planner's figures against the tensors the engine actually allocates."""

from __future__ import annotations

import copy
import json
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from checks import plan as planner
from rmm import integration, runner
from rmm.data import DatasetStats, Document
from rmm.engine import StreamingEngine
from rmm.model_config import describe_model
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


class LiveBytes(TorchDispatchMode):
    """Inside the block: the peak bytes of the storages that operations allocate (an operation's output
    whose storage is not one of its inputs'), each counted until its last reference is gone, so that a
    forward pass's activations and temporaries are measured, not its views or in-place writes."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.counted: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {
            t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self.counted:
                continue
            self.counted.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out

    def _freed(self, key: int, n: int) -> None:
        self.live -= n
        self.counted.discard(key)


@dataclass
class Allocated:
    """What the engine allocates for the first chunk of ``batch`` N_TOKENS streams: the memories' KV
    slots and scratch (the attention logits counted from the shapes the attention recorded), and the
    peak bytes the batched forward pass allocated beyond the memories (activations, logits, attention
    temporaries)."""

    kv: int
    scratch: int
    persistent_scratch: int
    forward_peak: int


def allocated(
    model,
    policy,
    positions: str = "original",
    observed: bool = False,
    allocation: str = "uniform",
    batch: int = 1,
) -> Allocated:
    """The engine's allocations for the first chunk of ``batch`` N_TOKENS streams in one forward pass
    (``observed``: with an attention observer, as the reference pass)."""
    engine = StreamingEngine(model, policy, positions=positions, allocation=allocation)
    plan = engine.plan.recording.observed() if observed else engine.plan.recording
    memory = engine.new_memory(N_TOKENS, plan, rows=batch)
    logits_shapes = []
    if plan.record_attention:
        store = memory.store_attention
        memory.store_attention = lambda layer, probs, rows=slice(None), store=store: (
            logits_shapes.append(probs.shape),
            store(layer, probs, rows),
        )
    # a chunk past the budget: the steady state, where position rules re-rotate their sinks
    n_q = plan.slots(N_TOKENS)[1]
    query_pos = torch.arange(n_q) + (policy.budget or 0)
    # the last of several rows a token short: a padded pass, the case the planner counts
    lengths = [n_q] * batch if batch == 1 else [n_q] * (batch - 1) + [n_q - 1]
    position_ids = memory.begin_chunk([policy.budget or 0] * batch, lengths)
    tokens = torch.stack([query_pos + i for i in range(batch)]) % model.config.vocab_size  # N streams
    live = LiveBytes()
    with integration.install(model), torch.enable_grad() if plan.track_gradient else torch.no_grad():
        with live:
            logits = engine.forward(memory, tokens, position_ids)
            assert logits.shape == (batch, query_pos.numel(), model.config.vocab_size)
            scored = torch.log_softmax(logits, dim=-1)  # every stream at once (rmm.engine)
            del logits, scored
            outputs = memory.take_outputs() if plan.track_gradient else []
            del outputs  # the graph, as the backward pass releases it
    m = memory
    kv = nbytes(m.keys, m.values, m.key_pos, *m.state.values())
    mk = m.masks
    persistent = nbytes(
        mk._allowed,
        mk.blocked,
        mk.other_bias,
        mk.slot_bias,
        mk.chunk_bias,
        m.attn,
        m.utility,
        *mk.folded.values(),
    )
    scratch = persistent
    if logits_shapes:  # fp32 logits, masked logits and probabilities [N, n_heads, Q, S]: one layer's of
        rows, kv_heads, _, queries, slots = logits_shapes[0]  # every stream at a time, every layer's for a
        per_layer = 3 * rows * model.config.num_attention_heads * queries * slots * 4  # backward pass, where
        per_layer += rows * kv_heads * queries * slots * 4  # the layer's additive mask (the eager path)
        if plan.track_gradient:  # the graph also keeps each layer's attended keys and values [N, H, S, D]
            keys = memory.keys
            per_layer += 2 * rows * kv_heads * slots * keys.shape[-1] * keys.element_size()
        scratch += (len(logits_shapes) if plan.track_gradient else 1) * per_layer
    return Allocated(kv, scratch, persistent, live.peak)


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
@pytest.mark.parametrize("batch", [1, 3])
def test_kv_and_scratch_match_allocations(saved, overrides, policy_cfg, budget, chunk, positions, batch):
    """Byte for byte: the memories of ``batch`` streams (KV slots, masks, recorded attention); as a bound:
    the batched forward pass's activations, logits and attention temporaries, measured as the peak of
    what its operations allocate, lie between half the planned figure and the planned figure."""
    path, model = saved
    result = planner.plan(compose(path, *overrides, f"batch={batch}"))
    real = allocated(model, make_policy(policy_cfg, budget, chunk), positions, batch=batch)
    assert result.batch == batch
    assert result.kv_bytes == real.kv
    assert result.scratch_bytes == real.scratch
    assert result.weights_bytes == nbytes(*model.parameters())
    assert result.reference_pass_bytes == 0
    expected_total = result.weights_bytes + result.kv_bytes + result.scratch_bytes + result.activation_bytes
    assert result.total_bytes == expected_total
    planned_forward = result.activation_bytes + result.scratch_bytes - real.persistent_scratch
    assert planned_forward / 2 <= real.forward_peak <= planned_forward, (real.forward_peak, planned_forward)


def test_batch_multiplies_the_streams_not_the_weights(saved):
    """batch=3: three memories, three streams' activations and attention scratch (the attention runs every
    stream at once), one set of weights."""
    path, _ = saved
    one, three = (
        planner.plan(compose(path, "policy=h2o", "budget=16", "chunk=4", f"batch={n}")) for n in (1, 3)
    )
    assert three.weights_bytes == one.weights_bytes
    assert three.kv_bytes == 3 * one.kv_bytes
    assert three.scratch_bytes == 3 * one.scratch_bytes
    assert 2 * one.activation_bytes < three.activation_bytes <= 3 * one.activation_bytes


def test_batched_logits_are_planned(tmp_path: Path):
    """A vocabulary large enough for the logits [N, C, V] to dominate the pass: the measured peak still
    lies within the bound at batch 3 (a plan counting one stream's logits would fall below it)."""
    model = tiny_model("llama", vocab_size=4096)
    model.config.save_pretrained(tmp_path)
    for batch in (1, 3):
        result = planner.plan(compose(tmp_path, "policy=h2o", "budget=16", "chunk=4", f"batch={batch}"))
        real = allocated(model, make_policy({"name": "h2o"}, 16, 4), batch=batch)
        assert result.kv_bytes == real.kv and result.scratch_bytes == real.scratch
        planned_forward = result.activation_bytes + result.scratch_bytes - real.persistent_scratch
        assert planned_forward / 2 <= real.forward_peak <= planned_forward, (batch, real.forward_peak)


@pytest.mark.parametrize("allocation", ["adaptive", "pyramid"])
def test_allocations_plan_their_retained_slots(saved, allocation):
    """The planner counts R from the allocation (the largest per-head capacity), as the engine does."""
    path, model = saved
    result = planner.plan(compose(path, "policy=h2o", "budget=16", "chunk=4", f"allocation={allocation}"))
    policy = make_policy({"name": "h2o"}, 16, 4)
    real = allocated(model, policy, allocation=allocation, batch=result.batch)  # conf/config.yaml's batch
    assert result.kv_bytes == real.kv and result.scratch_bytes == real.scratch
    assert real.kv > allocated(model, policy, batch=result.batch).kv  # more slots than uniform's B'


def test_reference_pass_matches_the_oracle_window(saved):
    """The oracle's reference pass: a window of the whole stream, recording attention, chunk 256. At
    batch 3 the three documents' passes run side by side (rmm.lookahead.ReferenceRunner.prefetch) when a
    wave is drawn, while up to two unfinished streams of the wave before still hold their memories."""
    path, model = saved
    result = planner.plan(compose(path, "policy=oracle", "budget=16", "chunk=4", "batch=3"))
    rows = 3
    window = make_policy({"name": "window"}, budget=N_TOKENS, chunk=min(256, N_TOKENS))
    real = allocated(model, window, observed=True, batch=rows)
    activations = planner.activation_bytes(
        planner.model_architecture(compose(path).model), N_TOKENS, torch.float32, batch=rows
    )
    assert result.reference_pass_bytes == real.kv + real.scratch + activations
    assert real.forward_peak <= activations + real.scratch - real.persistent_scratch
    memory = allocated(model, make_policy({"name": "oracle"}, 16, 4))
    others = 2 * (memory.kv + memory.persistent_scratch)
    beside = result.weights_bytes + result.reference_pass_bytes + others
    streams = result.weights_bytes + result.kv_bytes + result.scratch_bytes + result.activation_bytes
    assert result.total_bytes == max(beside, streams)


def test_largest_chunk_is_the_boundary(saved):
    path, _ = saved
    cfg = compose(path, "policy=h2o", "budget=32", "chunk=4")
    gpu = planner.plan(cfg, chunk=10).total_bytes
    assert planner.largest_chunk(cfg, gpu) == 10
    assert planner.largest_chunk(cfg, gpu - 1) == 9
    assert planner.largest_chunk(cfg, 10**15) == 32  # chunk <= budget
    assert planner.largest_chunk(cfg, 1000) is None


def test_largest_batch_is_the_boundary(saved):
    path, _ = saved
    cfg = compose(path, "policy=h2o", "budget=32", "chunk=4", "batch=2")
    gpu = planner.plan(cfg, batch=5).total_bytes
    assert planner.largest_batch(cfg, gpu) == 5
    assert planner.largest_batch(cfg, gpu - 1) == 4
    assert planner.largest_batch(cfg, 10**15) == planner.MAX_BATCH
    assert planner.largest_batch(cfg, 1000) is None


def test_cli_json(saved, capsys: pytest.CaptureFixture[str]):
    path, _ = saved
    planner.main(
        ["model=local", f"model.path={path}", f"dataset.max_tokens={N_TOKENS}", "--json", "--gpu-memory", "1"]
    )
    out = json.loads(capsys.readouterr().out)
    for key in ("weights_bytes", "kv_bytes", "scratch_bytes", "reference_pass_bytes", "total_bytes"):
        assert isinstance(out[key], int) and out[key] >= 0
    assert out["largest_chunk"] >= 1
    assert out["batch"] == 4 and out["largest_batch"] >= 1  # conf/config.yaml's batch


def test_shipped_model_plans_offline():
    cfg = planner.compose_config(
        ["model=llama3_8b", "budget=4096", "chunk=256", "policy=rmm", "dataset.max_tokens=65536"]
    )
    result = planner.plan(cfg)
    arch = cfg.model.architecture
    slots = arch.num_hidden_layers * arch.num_key_value_heads * (4096 + 1)  # B - C + 1 retained + C
    per_stream = slots * (2 * arch.head_dim * 2 + 8 + 4)  # bf16 K/V, int64 position, fp32 DU
    assert result.batch == cfg.batch == 4 and result.kv_bytes == 4 * per_stream  # conf/config.yaml's batch
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
    facts = SimpleNamespace(dims=describe_model(loaded))  # what the runner reads of the engine's facts
    monkeypatch.setattr(runner, "StreamingEngine", lambda *args: SimpleNamespace(facts=facts))
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
                ran = runner.build(cfg, runner.check_run(cfg)).reference.context
            except ValueError as err:
                ran = str(err)
            assert planned == ran, (model, n_tokens, context)
            outcomes.add(type(ran))
    assert outcomes == {int, str}, "the grid must hold runs and refusals"
