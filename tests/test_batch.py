"""Batched streams: several documents side by side in one forward pass per chunk.

A document's outcome must not depend on the batch beyond fp32 rounding: against the same document streamed
alone, per-token NLL within :data:`rmm.divergence.NLL_BOUND`, the same correctness and the same retained
set at every boundary until a near-tie flips (a batch blocks the matrix kernels differently, so the last
bits may differ; conftest's ``assert_agree``); and against the independent token-by-token reference
(rmm/reference.py) like every stream.
The documents have mixed lengths, one is much shorter (3 tokens), and there are more documents than the
batch holds, so finished documents are replaced mid-stream.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_agree, record_max
from test_policies import ARCHS, BUDGET, NLL_ATOL, fits

from checks.matrix import (
    CASES,
    case_id,
    distinct_stream,
    ranked_by_rounding,
    ranks_keys,
    runs_under,
    sampled_stream,
    tiny_model,
)
from rmm import api, selfcheck
from rmm.data import Document
from rmm.divergence import NLL_BOUND, Trace
from rmm.engine import StreamHooks, StreamingEngine, StreamRequest, StreamResult, retained_sets_recorder
from rmm.errors import UnsupportedModelError
from rmm.lookahead import ReferenceRunner, record_future, record_futures
from rmm.policies import make_policy
from rmm.reference import POSITION_RULES, ReferenceSpec, reference_stream

LENGTHS = (24, 17, 3, 30, 9)  # with BATCH 3: unequal lengths, a 3-token document, two replacements
BATCH = 3


def documents(model, name: str) -> list[torch.Tensor]:
    """The batch's documents: sampled from the model, or without repeated tokens for a key-ranking policy
    (conftest's rule for the matrix)."""
    if ranks_keys(name):
        return [distinct_stream(n, seed=i) for i, n in enumerate(LENGTHS)]
    return [sampled_stream(model, n, seed=i) for i, n in enumerate(LENGTHS)]


def stream(model, docs, name, params, chunk, positions="original", batch=BATCH, **options):
    """Results and retained sets per boundary of ``docs`` streamed ``batch`` per pass, each with its own
    policy copy prepared on its own future (the oracles)."""
    policy = make_policy({"name": name, **params}, budget=BUDGET, chunk=chunk)
    engine = StreamingEngine(model, policy, positions=positions, batch=batch, **options)
    requests, logs = [], []
    for doc in docs:
        own = copy.copy(policy)
        own.prepare(doc, lambda tokens: record_future(model, tokens, tau=0.02, context=1024))
        hook, sets = retained_sets_recorder()
        requests.append(StreamRequest(doc, own, StreamHooks(on_boundary=hook)))
        logs.append(sets)
    results: dict[int, StreamResult] = {index: result for index, result, _ in engine.stream_many(requests)}
    return [results[i] for i in range(len(docs))], logs


def assert_batch_independent(model, docs, name, params, chunk, positions="original", **options) -> None:
    alone = stream(model, docs, name, params, chunk, positions, batch=1, **options)
    batched = stream(model, docs, name, params, chunk, positions, **options)
    where = f"{name} {params} chunk={chunk} positions={positions} {options}"
    for i in range(len(docs)):
        one, many = Trace.of(alone[0][i], alone[1][i]), Trace.of(batched[0][i], batched[1][i])
        assert_agree(many, one, f"doc {i}: {where}")


def cases():
    """Every case on every architecture at chunk 5 (a partial last chunk) under both position modes; the
    fast loop runs Llama, the rest is slow."""
    for arch in ARCHS:
        for (name, params), ident in zip(CASES, map(lambda c: case_id(*c), CASES), strict=True):
            if ranked_by_rounding(arch, name, params) or not fits(name, params, 5):
                continue
            marks = () if arch == "llama" else pytest.mark.slow
            yield pytest.param(arch, name, params, id=f"{arch}-{ident}", marks=marks)


@pytest.fixture(scope="module")
def models() -> dict:
    return {}


@pytest.mark.parametrize(("arch", "name", "params"), list(cases()))
@pytest.mark.parametrize("positions", ["original", "cache"])
def test_a_document_streams_the_same_in_a_batch(models, arch, name, params, positions):
    if not runs_under(name, params, positions):
        pytest.skip(f"the case does not run under positions={positions}")
    model = models.setdefault(arch, tiny_model(arch))
    assert_batch_independent(model, documents(model, name), name, params, 5, positions)


@pytest.mark.parametrize(
    "options",
    [
        {"scope": "layer"},
        {"scope": "global"},
        {"allocation": "adaptive"},
        {"allocation": "pyramid"},
    ],
)
@pytest.mark.parametrize(("name", "params"), [("h2o", {}), ("rmm", {"lag": 3, "weight": "gradient"})])
def test_scopes_and_allocations_in_a_batch(models, name, params, options):
    model = models.setdefault("llama", tiny_model("llama"))
    assert_batch_independent(model, documents(model, name), name, params, 4, "original", **options)


@pytest.mark.parametrize(("name", "params"), [("h2o", {}), ("streaming_llm", {"sinks": 2})])
def test_global_layers_of_a_hybrid_model_in_a_batch(models, name, params):
    model = models.setdefault("gemma3", tiny_model("gemma3"))
    assert_batch_independent(model, documents(model, name), name, params, 4, "original", layers="global")


@pytest.mark.parametrize(
    ("name", "params", "chunk"),
    [
        ("h2o", {}, 5),
        ("rmm", {"lag": 3}, 5),
        ("rmm", {"lag": "auto", "step": 1}, 2),  # at chunk 2 its shadows have room, and its arms switch
        ("streaming_llm", {"sinks": 2}, 5),
        ("oracle", {}, 5),
        ("snapkv", {"window": 2}, 5),
    ],
)
@pytest.mark.parametrize("positions", ["original", "cache"])
def test_batched_streams_match_the_reference(models, name, params, chunk, positions):
    """The batched streams against the independent reference, document by document."""
    model = models.setdefault("llama", tiny_model("llama"))
    docs = documents(model, name)
    results, logs = stream(model, docs, name, params, chunk, positions)
    for i, (doc, result, sets) in enumerate(zip(docs, results, logs, strict=True)):
        spec = ReferenceSpec(
            policy=name,
            budget=BUDGET,
            chunk=1 if name in POSITION_RULES else chunk,
            positions=positions,
            **params,
        )
        nll, correct = reference_stream(model, doc, spec)
        record_max("per-token |NLL engine - reference|, fp32", float((result.nll - nll).abs().max()))
        torch.testing.assert_close(result.nll, nll, rtol=0, atol=NLL_ATOL, msg=f"doc {i} {name} {positions}")
        assert torch.equal(result.correct, correct)
        for now, retained in sets.items():
            assert retained == spec.retained_log[now], f"doc {i}: R_{now} differs from the reference"


def test_the_estimator_diagnostic_and_totals_do_not_depend_on_the_batch(models):
    """rmm.api.stream_documents: the same tokens, totals and estimator pairs at batch 1 and 4."""
    model = models.setdefault("llama", tiny_model("llama"))
    docs = [Document(f"d{i}", tokens, {}) for i, tokens in enumerate(documents(model, "rmm"))]
    totals = []
    for batch in (1, 4):
        engine = StreamingEngine(model, make_policy({"name": "rmm", "lag": 3}, BUDGET, 4), batch=batch)
        totals.append(api.stream_documents(engine, docs, ReferenceRunner(model, 0.02, 1024), estimator=True))
    alone, batched = totals
    assert [frame.doc_id.iloc[0] for frame in batched.token_frames] == [doc.doc_id for doc in docs]
    flipped = [
        assert_agree(Trace.of_frame(many), Trace.of_frame(one), "stream_documents at batch 4 and 1").first
        for one, many in zip(alone.token_frames, batched.token_frames, strict=True)
    ]
    assert alone.n_scored == batched.n_scored
    if any(f is not None for f in flipped):
        return  # a near-tie flipped: the later decisions, and so the estimator pairs, may differ
    pairs = [sorted(torch.cat([torch.stack(p, -1) for p in t.estimator_pairs]).tolist()) for t in totals]
    assert len(pairs[0]) == len(pairs[1]) and torch.allclose(
        torch.tensor(pairs[0]), torch.tensor(pairs[1]), atol=1e-5
    )


def test_the_look_ahead_pass_in_a_batch_equals_alone(models):
    """The oracles' reference pass, batched (rmm.lookahead.record_futures): the same requests and weights."""
    model = models.setdefault("llama", tiny_model("llama"))
    docs = documents(model, "oracle")
    batched = record_futures(model, docs, 0.02, 1024, batch=BATCH)
    for doc, many in zip(docs, batched, strict=True):
        one = record_future(model, doc, 0.02, 1024)
        assert torch.equal(one.codes, many.codes)
        torch.testing.assert_close(many.mass, one.mass, rtol=0, atol=1e-6)
        for name in ("correct", "prob"):
            torch.testing.assert_close(many.query_weights[name], one.query_weights[name], rtol=0, atol=1e-6)


def test_the_reference_runner_keeps_its_engine_and_checks_it_once(models, monkeypatch):
    """Prefetching batch after batch, the reference runner streams them through one engine per batch size,
    which checks itself once (its model is the same), with the futures of a new engine per call of the same
    streams (the same shapes: exactly)."""
    model = models.setdefault("llama", tiny_model("llama"))
    docs = documents(model, "oracle")
    checks = []
    run = selfcheck.self_check
    monkeypatch.setattr(selfcheck, "self_check", lambda engine, t: checks.append(engine) or run(engine, t))
    runner = ReferenceRunner(model, 0.02, 1024)
    runner.prefetch([docs[3], docs[0]], BATCH)  # the longest first: no later stream needs a longer probe
    runner.prefetch(docs[1:3], BATCH)
    assert len(checks) == 1
    runner(docs[4])  # not prefetched: alone, through the engine of batch 1
    assert len(checks) == 2 and checks[0] is not checks[1]
    batches = [[docs[3], docs[0]], docs[1:3], docs[4:]]
    fresh = [future for b in batches for future in record_futures(model, b, 0.02, 1024, batch=BATCH)]
    for doc, new in zip([doc for b in batches for doc in b], fresh, strict=True):
        kept = runner(doc)
        assert torch.equal(new.codes, kept.codes) and torch.equal(new.mass, kept.mass)


def test_evaluate_at_batch_1_and_4_agree(models):
    model = models.setdefault("llama", tiny_model("llama"))
    ids = documents(model, "h2o")
    one = api.evaluate(model, token_ids=ids, policy="h2o", budget=BUDGET, chunk=4, batch=1)
    four = api.evaluate(model, token_ids=ids, policy="h2o", budget=BUDGET, chunk=4, batch=4)
    frames = [{d: Trace.of_frame(f) for d, f in e.tokens.groupby("doc_id", sort=False)} for e in (one, four)]
    flipped = [assert_agree(frames[1][d], frames[0][d], f"evaluate {d}").first for d in frames[0]]
    if not any(flipped):  # the same decisions: the same evictions and perplexity to rounding
        assert one.metrics["evicted_age_mean"] == four.metrics["evicted_age_mean"]
        assert four.metrics["ppl"] == pytest.approx(one.metrics["ppl"], rel=NLL_BOUND)
    assert four.config["batch"] == 4


class _MixingRows(torch.nn.Module):
    """Adds a share of the batch's mean to every row: a model whose documents would see each other."""

    def forward(self, module, args, output):
        return output + 0.5 * output.mean(dim=0, keepdim=True)


def test_a_model_whose_batch_rows_interact_is_refused():
    model = tiny_model("llama")
    model.model.layers[0].mlp.register_forward_hook(_MixingRows())
    engine = StreamingEngine(model, make_policy({"name": "h2o"}, BUDGET, 4), batch=2)
    with pytest.raises(UnsupportedModelError, match="batch rows interact; run it with batch=1"):
        engine.self_check(sampled_stream(tiny_model("llama"), 24))
    StreamingEngine(model, make_policy({"name": "h2o"}, BUDGET, 4), batch=1).self_check(
        sampled_stream(tiny_model("llama"), 24)
    )


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_self_check_judges_the_model_alike_at_every_batch(arch):
    """Only the probe is held against the model's forward, at any batch (in a batch, beside its reverse,
    against itself streamed alone): the same statistic at batch 1 and 4, and a batch statistic."""
    model = tiny_model(arch)
    tokens = sampled_stream(model, 40)
    policy = make_policy({"name": "h2o"}, BUDGET, 4)
    one = StreamingEngine(model, policy, positions="cache", batch=1).self_check(tokens)
    four = StreamingEngine(model, policy, positions="cache", batch=4).self_check(tokens)
    assert one.batch_dnll is None and four.max_abs_dnll == one.max_abs_dnll
    assert four.batch_dnll is not None and 0 <= four.batch_dnll <= NLL_BOUND


def test_bad_batch_is_refused():
    model = tiny_model("llama")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="batch must be an integer >= 1"):
            StreamingEngine(model, make_policy({"name": "h2o"}, BUDGET, 4), batch=bad)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "params", "positions"),
    [
        ("h2o", {}, "original"),
        ("rmm", {"lag": 16}, "cache"),
        ("knorm", {}, "original"),
        ("tova", {}, "cache"),
    ],
)
def test_a_batch_on_smollm2_streams_each_play_as_alone(name, params, positions):
    """The real embedded model, where rounding can decide near ties: three plays of unequal length (400,
    250 and 120 tokens; a fourth pass shape at each play's end) at batch 3 against batch 1."""
    pytest.importorskip("gguf")
    from omegaconf import OmegaConf

    from rmm.data import load_documents
    from rmm.models import load_model

    model, tokenizer = load_model(
        OmegaConf.load("conf/model/smollm2_135m.yaml"), torch.device("cpu"), torch.float32
    )
    data = OmegaConf.merge(OmegaConf.load("conf/dataset/shakespeare.yaml"), {"n_docs": 3, "max_tokens": 400})
    docs = [
        doc.tokens[:n] for doc, n in zip(load_documents(data, tokenizer)[0], (400, 250, 120), strict=True)
    ]
    policy = make_policy({"name": name, **params}, budget=64, chunk=16)
    runs = []
    for batch in (1, 3):
        engine = StreamingEngine(model, policy, positions=positions, batch=batch)
        logs = [retained_sets_recorder() for _ in docs]
        requests = [
            StreamRequest(d, copy.copy(policy), StreamHooks(on_boundary=h))
            for d, (h, _) in zip(docs, logs, strict=True)
        ]
        results = {index: result for index, result, _ in engine.stream_many(requests)}
        runs.append(([results[i] for i in range(len(docs))], [sets for _, sets in logs]))
    (alone, alone_sets), (batched, batched_sets) = runs
    for i, (one, many) in enumerate(zip(alone, batched, strict=True)):
        where = f"SmolLM2 {name} play {i} at batch 3 against alone"
        assert_agree(Trace.of(many, batched_sets[i]), Trace.of(one, alone_sets[i]), where)


def test_a_padded_pass_past_the_position_table_is_refused():
    """A shorter chunk padded to its pass's widest continues its positions (rmm/memory.py); where that
    would reach past the model's table of positions (GPT-J's sin/cos table of 512) the pass is refused,
    naming the fix, instead of indexing past the table. C = 3: documents of 511 tokens, 2 tokens (it ends
    after one pass, and the third takes its row one pass late) and 512 tokens; the first's last chunk
    (position 510, 1 token) shares a pass with the third's 3-token chunk at 507, padded to reach 512."""
    from checks.architectures import tiny_model as registry_model

    model = registry_model("gptj")
    assert model.config.max_position_embeddings == 512
    docs = [torch.arange(n) % model.config.vocab_size for n in (511, 2, 512)]
    policy = make_policy({"name": "h2o"}, budget=8, chunk=3)
    requests = [StreamRequest(doc, copy.copy(policy)) for doc in docs]
    with pytest.raises(UnsupportedModelError, match="reaches position 512; cut the documents"):
        list(StreamingEngine(model, policy, batch=2).stream_many(requests))
    alone = [StreamRequest(doc, copy.copy(policy)) for doc in docs]  # one per pass: nothing is padded
    assert len(list(StreamingEngine(model, policy, batch=1).stream_many(alone))) == 3
