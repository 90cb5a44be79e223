"""Per-layer shapes (issue 37, item 3): Gemma 4's full-attention layers have wider heads and, with
``attention_k_eq_v``, fewer KV heads than its sliding layers; the memory holds each layer at its own
shape (zero-padded to the widest), the reference at its own. KV sharing across layers: an entry is stored
and evicted once, by the layer that stores it."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM, Gemma4TextConfig

import rmm
from checks.architectures import TOLERANCE
from rmm import runner
from rmm.engine import StreamingEngine
from rmm.errors import UnsupportedModelError
from rmm.files import config_dir
from rmm.model_config import kv_sources
from rmm.planning import check_shared
from rmm.policies import make_policy
from rmm.reference import ReferenceSpec, reference_stream

LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]  # one period of Gemma 4's pattern


def _model(**overrides) -> torch.nn.Module:
    """A tiny random Gemma 4: sliding layers of 2 KV heads x 16 channels, the full layer 1 x 32."""
    settings = {
        "vocab_size": 128,
        "vocab_size_per_layer_input": 128,
        "hidden_size": 64,
        "hidden_size_per_layer_input": 16,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 32,
        "attention_k_eq_v": True,
        "num_global_key_value_heads": 1,
        "sliding_window": 16,
        "layer_types": LAYER_TYPES,
        "initializer_range": 0.1,
        "pad_token_id": 127,
    }
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Gemma4TextConfig(**(settings | overrides)))
    return model.float().eval().requires_grad_(False)


def _tokens(n: int = 64) -> torch.Tensor:
    return torch.randint(3, 120, (n,), generator=torch.Generator().manual_seed(1))


def _nll(model: torch.nn.Module, tokens: torch.Tensor, **settings) -> torch.Tensor:
    run = rmm.evaluate(model, token_ids=[tokens], **settings)
    return torch.tensor(run.tokens["nll"].iloc[1:].to_numpy(dtype="float32"))


def test_the_memory_holds_each_layer_at_its_own_shape():
    model = _model()
    engine = StreamingEngine(model, make_policy({"name": "h2o"}, budget=12, chunk=4))
    assert engine.facts.layer_shapes == [(2, 16, 16)] * 5 + [(1, 32, 32)]
    memory = engine.new_memory(32, engine.plan.recording)
    assert (memory.keys.shape[2], memory.keys.shape[-1], memory.values.shape[-1]) == (2, 32, 32)
    memory.begin_chunk([0], [4])
    chunk = memory.key_pos[..., memory.retained :]  # [L, N, H, C]
    assert (chunk[5, :, 1] == -1).all() and (chunk[5, :, 0] >= 0).all() and (chunk[:5] >= 0).all()


def test_full_equals_the_model_and_h2o_the_reference():
    model, tokens = _model(), _tokens()
    with torch.no_grad():
        logits = model(input_ids=tokens[None], use_cache=False).logits[0]
    own = -torch.log_softmax(logits[:-1].float(), -1).gather(-1, tokens[1:, None])[:, 0]
    full = _nll(model, tokens, policy="full", budget=None, chunk=16)
    assert float((full - own).abs().max()) <= TOLERANCE
    for positions in ("original", "cache"):
        for scope in ("head", "layer"):
            got = _nll(model, tokens, policy="h2o", budget=12, chunk=4, positions=positions, scope=scope)
            spec = ReferenceSpec("h2o", budget=12, chunk=4, positions=positions, scope=scope)
            expected = reference_stream(model, tokens, spec)[0]
            assert float((got - expected).abs().max()) <= TOLERANCE, (positions, scope)


def test_kv_bytes_count_each_layer_at_its_shape():
    model, tokens = _model(), _tokens(32)
    run = rmm.evaluate(model, token_ids=[tokens], policy="h2o", budget=8, chunk=4)
    # five sliding layers of 2 heads x (16 + 16), the full layer 1 head x (32 + 32), fp32
    assert run.metrics["kv_cache_bytes"] == 8 * (5 * 2 * 32 + 64) * 4


@pytest.mark.parametrize(
    ("policy", "allocation", "says"),
    [("knorm", "uniform", "reads keys"), ("h2o", "adaptive", "allocation=adaptive")],
)
def test_what_padding_cannot_honour_is_refused(policy: str, allocation: str, says: str):
    with pytest.raises(UnsupportedModelError, match=says):
        StreamingEngine(_model(), make_policy({"name": policy}, budget=12, chunk=4), allocation=allocation)


def _shared() -> torch.nn.Module:
    """KV sharing: layers 2 (sliding) and 3 (full) attend the keys and values layers 0 and 1 store."""
    return _model(
        num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2
    )


def test_kv_sharing_stores_and_evicts_each_entry_once():
    """A shared entry lives in the layer that stores it (a reading layer holds none), the readers' attention
    adds to that layer's statistics, and one decision evicts it: full equals the model's own forward, and
    h2o and rmm equal the reference (which attends the storing layer's physical cache from the readers, as
    the model does), in both position modes; the KV bytes count the storing layers only."""
    model, tokens = _shared(), _tokens()
    assert kv_sources(model.config) == [0, 1, 0, 1]
    with torch.no_grad():
        logits = model(input_ids=tokens[None], use_cache=False).logits[0]
    own = -torch.log_softmax(logits[:-1].float(), -1).gather(-1, tokens[1:, None])[:, 0]
    assert float((_nll(model, tokens, policy="full", budget=None, chunk=16) - own).abs().max()) <= TOLERANCE
    for policy, params in (("h2o", {}), ("rmm", {"lag": 8})):
        for positions in ("original", "cache"):
            got = _nll(model, tokens, policy=policy, budget=12, chunk=4, positions=positions, **params)
            spec = ReferenceSpec(policy, budget=12, chunk=4, positions=positions, **params)
            expected = reference_stream(model, tokens, spec)[0]
            assert float((got - expected).abs().max()) <= TOLERANCE, (policy, positions)
    engine = StreamingEngine(model, make_policy({"name": "h2o"}, budget=12, chunk=4))
    memory = engine.new_memory(32, engine.plan.recording)
    memory.begin_chunk([0], [4])
    assert (memory.key_pos[2:] == -1).all() and (memory.key_pos[:2, :, :, memory.retained :] >= 0).any()
    run = rmm.evaluate(model, token_ids=[tokens[:32]], policy="h2o", budget=8, chunk=4)
    assert run.metrics["kv_cache_bytes"] == 8 * (2 * 32 + 64) * 4  # layers 0 and 1 only


@pytest.mark.slow
@pytest.mark.parametrize(
    ("policy", "params", "options"),
    [
        ("streaming_llm", {}, {"positions": "cache"}),
        ("tova", {}, {"scope": "layer"}),
        ("lru", {}, {}),
        ("observed_attention", {}, {}),
        ("h2o", {}, {"layers": "global"}),
        ("oracle", {}, {}),
        ("oracle", {"variant": "future_utility"}, {}),
    ],
)
def test_kv_sharing_against_the_reference(policy: str, params: dict, options: dict):
    """More rules under KV sharing: sinks under cache positions, a window left alone, and the look-ahead
    (whose future attention of an entry is every reading layer's too)."""
    model, tokens = _shared(), _tokens()
    got = _nll(model, tokens, policy=policy, budget=12, chunk=4, **params, **options)
    expected = reference_stream(
        model, tokens, ReferenceSpec(policy, budget=12, chunk=4, **params, **options)
    )[0]
    assert float((got - expected).abs().max()) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["knorm", "keydiff"])
def test_kv_sharing_with_policies_that_read_keys(policy: str):
    """Where every layer has one shape, policies that read the stored keys run under KV sharing too."""
    uniform = {"global_head_dim": 16, "attention_k_eq_v": False, "num_global_key_value_heads": 2}
    model = _model(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2,
        **uniform,
    )
    tokens = _tokens()
    got = _nll(model, tokens, policy=policy, budget=12, chunk=4)
    expected = reference_stream(model, tokens, ReferenceSpec(policy, budget=12, chunk=4))[0]
    assert float((got - expected).abs().max()) <= TOLERANCE


def test_kv_sharing_in_a_batch_equals_each_document_alone():
    model, tokens = _shared(), _tokens()
    docs = [tokens, tokens[7:50]]
    batched = rmm.evaluate(model, token_ids=docs, policy="h2o", budget=12, chunk=4, batch=2)
    for i, doc in enumerate(docs):
        alone = _nll(model, doc, policy="h2o", budget=12, chunk=4)
        rows = batched.tokens[batched.tokens["doc_id"] == batched.tokens["doc_id"].unique()[i]]
        got = torch.tensor(rows["nll"].iloc[1:].to_numpy(dtype="float32"))
        assert float((got - alone).abs().max()) <= TOLERANCE


@pytest.mark.parametrize(
    ("policy", "scope", "allocation", "says"),
    [
        ("h2o", "global", "uniform", "scope=global"),
        ("h2o", "head", "pyramid", "allocation=pyramid"),
        ("expected_attention", "head", "uniform", "reads queries"),
    ],
)
def test_what_kv_sharing_cannot_honour_is_refused(policy: str, scope: str, allocation: str, says: str):
    with pytest.raises(UnsupportedModelError, match=says):
        check_shared("X", [0, 1, 0, 1], make_policy({"name": policy}, budget=12, chunk=4), scope, allocation)
    check_shared("X", [0, 1, 0, 1], make_policy({"name": "window"}, budget=12, chunk=4), scope, allocation)
    check_shared("X", [0, 1, 2, 3], make_policy({"name": policy}, budget=12, chunk=4), scope, allocation)


def test_kv_sharing_refusals_come_before_the_weights_load(tmp_path, monkeypatch):
    """``run.py`` reads a local model's config.json first: scope=global with a score-based policy on a
    model with KV sharing is refused without the weights."""
    _shared().config.save_pretrained(tmp_path)  # config.json only
    monkeypatch.setattr(runner, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    overrides = ["model=local", f"model.path={tmp_path}", "policy=h2o", "scope=global", "device=cpu"]
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, "wandb.mode=disabled"])
    with pytest.raises(UnsupportedModelError, match=r"\(gemma4_text\) shares keys and values across layers"):
        runner.build(cfg, runner.check_run(cfg))


def test_a_pass_with_empty_head_pairs_makes_no_host_sync():
    """The full layer's one KV head leaves the memory's second head of that layer empty; a pass still
    waits for the device nowhere (checks/op_count.py's count), the model's forward included."""
    from checks import op_count

    assert not op_count.count(_model(), "h2o", batch=2, budget=16, chunk=4).sites
