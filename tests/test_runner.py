"""Runs end to end: the runner's wiring on saved tiny models and textdir data, and the embedded default
(SmolLM2-135M over Shakespeare, slow)."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import BF16_UNDER_EMULATED_KERNELS, SENTENCES, assert_agree, tiny_model, tiny_tokenizer
from hydra import compose, initialize_config_dir

from checks.matrix import CASES
from rmm import lookahead, provenance, runner, sharing
from rmm.data import load_documents
from rmm.divergence import Trace, diverge
from rmm.engine import StreamingEngine
from rmm.lookahead import record_future, stream_futures
from rmm.models import load_model
from rmm.policies import POLICIES, make_policy
from rmm.runner import run
from rmm.storage import (
    CONFIG_FILE,
    DIFF_FILE,
    TOKEN_SCHEMA,
    read_config,
    read_metrics,
    read_tokens,
    write_run,
)

CONF = str(Path(__file__).resolve().parents[1] / "conf")
CPU = torch.device("cpu")
PROTOCOL_METRICS = {
    "ppl",
    "nll_mean",
    "n_tokens",
    "n_docs",
    "tokens_per_s",
    "wall_s",
    "peak_memory_bytes",
    "kv_cache_bytes",
    "attended_mean",
    "correct_frac",
    "policy",
    "budget",
    "lag",
    "chunk",
    "positions",
    "model",
    "dataset",
    "seed",
    "git_revision",
    "package_versions",
    "evicted_age_mean",
    "reference_wall_s",
    "estimator_spearman",
}
N_DOCS, MAX_TOKENS, BUDGET, CHUNK = 3, 40, 12, 4
# each policy with its first case of the reference matrix
# (sized for its B = 8 at chunks up to 5, so they fit here)
FIRST_CASES = {name: params for name, params in reversed(CASES)}


@pytest.fixture(autouse=True)
def identified_code(monkeypatch):
    """The code these runs record: a clean commit, whether or not the suite runs in a git checkout (a copy
    without .git, as the mutation check makes, or an unpacked archive), so that what depends on known code
    (reusing a run, the reference cache) is tested everywhere."""
    code = provenance.Provenance("c0de" * 10, b"", provenance.package_versions())
    monkeypatch.setattr(provenance, "_captured", code)


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory) -> dict[str, Path]:
    """Saved tiny Llama and GPT-NeoX with a local tokenizer, a textdir of three documents, and a
    temporary harness cache (RMM_CACHE) for the token cache."""
    root = tmp_path_factory.mktemp("tiny_run")
    tokenizer = tiny_tokenizer()
    paths = {}
    for arch in ("llama", "gpt_neox"):
        paths[arch] = root / arch
        tiny_model(arch, vocab_size=len(tokenizer)).save_pretrained(paths[arch])
        tokenizer.save_pretrained(paths[arch])
    texts = root / "texts"
    texts.mkdir()
    words = " ".join(SENTENCES).split()
    rng = random.Random(0)
    for i in range(N_DOCS):
        (texts / f"doc{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(60)))
    paths["texts"] = texts
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RMM_CACHE", str(root / "cache"))
        yield paths


def config(setup: dict, *overrides: str, arch: str = "llama"):
    base = [
        "model=local",
        f"model.path={setup[arch]}",
        f"model.name=tiny_{arch}",
        "dataset=textdir",
        f"dataset.path={setup['texts']}",
        f"dataset.max_tokens={MAX_TOKENS}",
        f"budget={BUDGET}",
        f"chunk={CHUNK}",
        "lag=3",
        "device=cpu",
        "dtype=float32",
        "wandb.mode=disabled",
        "progress=false",
    ]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", overrides=[*base, *overrides])


def direct_streams(cfg, context: int | None = None) -> dict[str, Trace]:
    """Per document, the trace of StreamingEngine.stream with the run's options, each document alone in its
    passes with a new policy and engine (so no state carries over), the oracle with that document's
    reference pass."""
    model, tokenizer = load_model(cfg.model, CPU, torch.float32)
    docs, _ = load_documents(cfg.dataset, tokenizer)
    out = {}
    for doc in docs:
        policy = make_policy(cfg.policy, budget=cfg.budget, chunk=cfg.chunk)
        window = context or doc.tokens.numel()
        policy.prepare(doc.tokens, lambda stream, w=window: record_future(model, stream, cfg.oracle.tau, w))
        engine = StreamingEngine(model, policy, positions=cfg.positions, scope=cfg.scope)
        out[doc.doc_id] = Trace.of(engine.stream(doc.tokens))
    return out


def run_nll(run_dir: Path) -> dict[str, torch.Tensor]:
    tokens = read_tokens(run_dir)
    return {
        doc_id: torch.tensor(doc.nll.to_numpy(dtype=float, na_value=math.nan)[1:], dtype=torch.float32)
        for doc_id, doc in tokens.groupby("doc_id", sort=False)
    }


def assert_same_streams(run_dir: Path, expected: dict[str, Trace]) -> None:
    """The run's documents (batched: the config's ``batch``) against each streamed alone: kernels may
    block a batch differently, so equal to the stated bound, near-tie flips explained (conftest)."""
    tokens = read_tokens(run_dir)
    got = {doc_id: Trace.of_frame(doc) for doc_id, doc in tokens.groupby("doc_id", sort=False)}
    assert list(got) == list(expected)
    for doc_id, trace in expected.items():
        assert_agree(got[doc_id], trace, f"{doc_id}: the run against a direct stream")


@pytest.mark.parametrize(
    ("arch", "positions", "scope"),
    [("llama", "cache", "layer"), pytest.param("gpt_neox", "original", "head", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_run_equals_direct_engine(tiny_setup, tmp_path, policy, arch, positions, scope):
    """run() gives every document the per-token NLL of a direct StreamingEngine.stream with the same
    policy, budget, chunk, positions and scope (and, for the oracle, that document's own future)."""
    sized = [f"policy.{key}={value}" for key, value in FIRST_CASES[policy].items()]
    options = [f"policy={policy}", *sized, f"positions={positions}", f"scope={scope}"]
    cfg = config(tiny_setup, *options, arch=arch)
    metrics = run(cfg, tmp_path)
    assert metrics["n_docs"] == N_DOCS
    assert_same_streams(tmp_path, direct_streams(cfg))


def test_oracle_uses_each_documents_own_future(tiny_setup, tmp_path):
    """run() matches fresh reference passes per document, and this test can tell: the first document's
    future, reused for the next documents, would change their NLL."""
    cfg = config(tiny_setup, "policy=oracle", "oracle.tau=0.1")  # sparse requests: few ties
    run(cfg, tmp_path)
    fresh = direct_streams(cfg)
    assert_same_streams(tmp_path, fresh)
    model, tokenizer = load_model(cfg.model, CPU, torch.float32)
    docs, _ = load_documents(cfg.dataset, tokenizer)
    first = record_future(model, docs[0].tokens, cfg.oracle.tau, docs[0].tokens.numel())
    changed = []
    for doc in docs[1:]:
        policy = make_policy(cfg.policy, budget=cfg.budget, chunk=cfg.chunk)
        policy.prepare(doc.tokens, lambda stream: first)
        reused = StreamingEngine(model, policy, positions=cfg.positions, scope=cfg.scope).stream(doc.tokens)
        changed.append(diverge(Trace.of(reused), fresh[doc.doc_id]).first is not None)
    assert all(changed), "a reused future must change the later documents here"


def test_oracle_windowed_context_through_the_runner(tiny_setup, tmp_path):
    cfg = config(tiny_setup, "policy=oracle", "oracle.context=6")
    metrics = run(cfg, tmp_path)
    assert metrics["reference_context"] == 6
    windowed = direct_streams(cfg, context=6)
    assert_same_streams(tmp_path, windowed)
    full = direct_streams(cfg)
    assert any(diverge(windowed[d], full[d]).first is not None for d in full), "the window must matter here"


def test_concat_stream_through_the_runner(tiny_setup, tmp_path):
    cfg = config(tiny_setup, "policy=h2o", "dataset.stream=concat", "dataset.max_tokens=100")
    metrics = run(cfg, tmp_path)
    assert metrics["n_docs"] == 1 and metrics["n_tokens"] == 99
    model, tokenizer = load_model(cfg.model, CPU, torch.float32)
    per_doc, _ = load_documents({**cfg.dataset, "stream": "per_doc", "max_tokens": None}, tokenizer)
    joined = torch.cat([d.tokens for d in per_doc])[:100]
    assert read_tokens(tmp_path).token_id.tolist() == joined.tolist()
    engine = StreamingEngine(model, make_policy(cfg.policy, budget=BUDGET, chunk=CHUNK))
    assert_agree(Trace.of_frame(read_tokens(tmp_path)), Trace.of(engine.stream(joined)), "concat")


def test_full_run_reports_the_plain_forward_perplexity(tiny_setup, tmp_path):
    metrics = run(config(tiny_setup, "policy=full"), tmp_path)
    assert PROTOCOL_METRICS <= set(metrics)
    assert metrics == read_metrics(tmp_path)
    tokens = read_tokens(tmp_path)
    assert list(tokens.columns) == TOKEN_SCHEMA.names
    assert tokens["decision_margins"].isna().all()  # full decides nothing
    assert tokens["segment"].isna().all()  # plain text carries no segment labels
    assert tokens.groupby("doc_id")["position"].min().eq(0).all()
    assert tokens.loc[tokens.position == 0, "nll"].isna().all()
    assert metrics["n_tokens"] == int(tokens.nll.notna().sum()) == N_DOCS * (MAX_TOKENS - 1)
    assert metrics["ppl"] == pytest.approx(math.exp(tokens.nll.astype(float).mean()), rel=1e-6)
    model = tiny_model("llama", vocab_size=len(tiny_tokenizer()))
    model.set_attn_implementation("sdpa")
    for doc_id, nll in run_nll(tmp_path).items():
        ids = torch.tensor(tokens[tokens.doc_id == doc_id].token_id.to_numpy(), dtype=torch.long)
        log_probs = torch.log_softmax(model(ids[None]).logits[0, :-1].float(), -1)
        expected = -log_probs.gather(-1, ids[1:, None])[:, 0]
        torch.testing.assert_close(nll, expected, rtol=0, atol=5e-6)
    assert metrics["attended_mean"] == pytest.approx(sum(range(MAX_TOKENS)) / MAX_TOKENS)


def test_bounded_run_records_what_protocol_asks(tiny_setup, tmp_path):
    options = ["policy=rmm", "policy.weight=prob", "positions=cache", "diagnostics.estimator=true"]
    cfg = config(tiny_setup, *options)
    metrics = run(cfg, tmp_path)
    assert metrics["policy"] == "rmm" and metrics["lag"] == 3 and metrics["policy.weight"] == "prob"
    window = sum(min(t, BUDGET - CHUNK + 1 + t % CHUNK) for t in range(MAX_TOKENS)) / MAX_TOKENS
    assert metrics["attended_mean"] == pytest.approx(window)  # B' retained plus the chunk so far
    assert metrics["evicted_age_mean"] > 3  # the provisional buffer is never evicted
    assert metrics["estimator_spearman"] is not None and -1.0 <= metrics["estimator_spearman"] <= 1.0
    assert metrics["reference_wall_s"] > 0 and metrics["reference_context"] == MAX_TOKENS
    assert metrics["kv_cache_bytes"] == BUDGET * 2 * 2 * 16 * 2 * 4
    tokens = read_tokens(tmp_path)
    assert metrics["correct_frac"] == pytest.approx(tokens.correct.astype(float).mean())


def test_estimator_of_the_future_mass_oracle_is_exact(tiny_setup, tmp_path):
    """The estimator diagnostic pairs each committing position's score with the oracle's remaining reference
    mass; oracle(future_mass) scores by exactly that mass, so its Spearman correlation must be 1."""
    options = ["policy=oracle", "policy.variant=future_mass", "diagnostics.estimator=true"]
    metrics = run(config(tiny_setup, *options), tmp_path)
    assert metrics["estimator_spearman"] == pytest.approx(1.0, abs=1e-12)


def test_resume_skips_a_complete_run(tiny_setup, tmp_path):
    run(config(tiny_setup, "policy=window"), tmp_path)
    stamp = (tmp_path / "metrics.json").stat().st_mtime_ns
    run(config(tiny_setup, "policy=window", "progress=true", "wandb.mode=offline"), tmp_path)
    assert (tmp_path / "metrics.json").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match=r"different configuration \(differs in: dataset.max_tokens\)"):
        run(config(tiny_setup, "policy=window", "dataset.max_tokens=32"), tmp_path)


def test_resume_refuses_results_of_another_resolved_device_or_dtype(tiny_setup, tmp_path):
    """device=auto and dtype=auto resolve per machine: complete results made on another device or in
    another dtype are not taken as this run's."""
    cfg = config(tiny_setup, "policy=window", "device=auto", "dtype=auto")
    run(cfg, tmp_path)
    stamp = (tmp_path / "metrics.json").stat().st_mtime_ns
    run(cfg, tmp_path)  # the same machine: resumed
    assert (tmp_path / "metrics.json").stat().st_mtime_ns == stamp
    stored = json.loads((tmp_path / "metrics.json").read_text())
    elsewhere = ("cuda:0", "bfloat16") if stored["device"] == "cpu" else ("cpu", "float32")
    (tmp_path / "metrics.json").write_text(
        json.dumps({**stored, "device": elsewhere[0], "dtype": elsewhere[1]})
    )
    with pytest.raises(ValueError, match=f"computed on {elsewhere[0].split(':')[0]} in {elsewhere[1]}, but"):
        run(cfg, tmp_path)
    (tmp_path / "metrics.json").write_text(json.dumps({k: v for k, v in stored.items() if k != "device"}))
    run(cfg, tmp_path)  # a run older than its device field: resumed (nothing to compare)


def test_a_run_completed_meanwhile_by_another_configuration_is_not_overwritten(
    tiny_setup, tmp_path, monkeypatch
):
    """Two configurations that share a run name, run by a parallel launcher: the one that finishes second
    finds the other's complete results and refuses rather than replacing them."""
    other, target = tmp_path / "other", tmp_path / "target"
    run(config(tiny_setup, "policy=window", "dataset.max_tokens=32"), other)
    streamed = runner.api.run_engine

    def racing(*args, **kwargs):
        result = streamed(*args, **kwargs)
        shutil.copytree(other, target, dirs_exist_ok=True)  # the parallel job finished meanwhile
        return result

    monkeypatch.setattr(runner.api, "run_engine", racing)
    with pytest.raises(
        ValueError, match=r"completed meanwhile by a run of another configuration \(differs in: data"
    ):
        run(config(tiny_setup, "policy=window"), target)
    assert read_config(target) == read_config(other)


@pytest.mark.parametrize("policy", ["h2o", "streaming_llm", "oracle"])
def test_a_batched_run_equals_batch_1(tiny_setup, tmp_path, policy):
    """``batch=N`` changes a document's results only by fp32 rounding (rmm.divergence's bound, near-tie
    flips explained), the documents keep their order in the token file, and a complete run resumes at any
    batch."""
    alone, batched = tmp_path / "b1", tmp_path / "b2"
    run(config(tiny_setup, f"policy={policy}", "batch=1"), alone)
    metrics = run(config(tiny_setup, f"policy={policy}", "batch=2"), batched)
    one, two = (
        {doc_id: Trace.of_frame(doc) for doc_id, doc in read_tokens(d).groupby("doc_id", sort=False)}
        for d in (alone, batched)
    )
    assert list(one) == list(two) and metrics["n_docs"] == N_DOCS
    for doc_id in one:
        assert_agree(two[doc_id], one[doc_id], f"{policy} {doc_id}: batch 2 against batch 1")
    stamp = (alone / "metrics.json").stat().st_mtime_ns
    run(config(tiny_setup, f"policy={policy}", "batch=3"), alone)  # batch is no result key: resumed
    assert (alone / "metrics.json").stat().st_mtime_ns == stamp


def _drop_stored_key(run_dir: Path, dotted: str) -> None:
    import yaml

    stored = yaml.safe_load((run_dir / CONFIG_FILE).read_text())
    *parents, last = dotted.split(".")
    node = stored
    for key in parents:
        node = node[key]
    del node[last]
    (run_dir / CONFIG_FILE).write_text(yaml.safe_dump(stored, sort_keys=False))


def test_resume_with_a_key_on_one_side_only(tiny_setup, tmp_path, monkeypatch):
    """A key the stored run lacks: fine when registered with the value it now has, else a change."""
    cfg = config(tiny_setup, "policy=window")
    run(cfg, tmp_path)
    stamp = (tmp_path / "metrics.json").stat().st_mtime_ns
    _drop_stored_key(tmp_path, "oracle.context")  # as if the run predates oracle.context
    with pytest.raises(ValueError, match=r"differs in: oracle.context\)"):
        run(cfg, tmp_path)
    monkeypatch.setitem(runner.ADDED_KEY_DEFAULTS, "oracle.context", None)
    run(cfg, tmp_path)  # added with the value that reproduces the old results: still complete
    assert (tmp_path / "metrics.json").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match=r"differs in: oracle.context\)"):
        run(config(tiny_setup, "policy=window", "oracle.context=8"), tmp_path)  # added, not at its default
    _drop_stored_key(tmp_path, "scope")  # a result-affecting key that is not registered
    with pytest.raises(ValueError, match=r"differs in: scope\)"):
        run(cfg, tmp_path)


def test_oracle_context_beyond_the_model_is_refused(tiny_setup, tmp_path):
    with pytest.raises(ValueError, match="exceeds the model's context"):
        run(config(tiny_setup, "policy=oracle", "oracle.context=100000"), tmp_path)


@pytest.mark.slow
def test_smollm2_run_reports_the_plain_forward_perplexity(tmp_path):
    """The embedded default end to end: SmolLM2-135M over two Shakespeare plays."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                "policy=full",
                "dataset.n_docs=2",
                "dataset.max_tokens=96",
                "chunk=8",
                "wandb.mode=disabled",
                "progress=false",
            ],
        )
    metrics = run(cfg, tmp_path)
    model, _ = load_model(cfg.model, CPU, torch.float32)
    model.set_attn_implementation("sdpa")
    tokens = read_tokens(tmp_path)
    total = 0.0
    for _, doc in tokens.groupby("doc_id", sort=False):
        ids = torch.tensor(doc.token_id.to_numpy(), dtype=torch.long)[None]
        total += model(ids, labels=ids).loss.item() * (ids.numel() - 1)
    assert metrics["n_tokens"] == 2 * 95
    assert metrics["ppl"] == pytest.approx(math.exp(total / metrics["n_tokens"]), rel=1e-5)


def _no_streaming(*args, **kwargs):
    raise AssertionError("this run should have reused another's results")


def test_full_at_another_budget_reuses_the_run_beside_it(tiny_setup, tmp_path, monkeypatch):
    """``full`` ignores the budget: at B=16 it writes the B=12 run's per-token file and metrics (with
    ``reused_from``) without streaming, and resumes like any run."""
    first, second = tmp_path / "B12", tmp_path / "B16"
    computed = run(config(tiny_setup, "policy=full", "budget=12"), first)
    monkeypatch.setattr(runner.api, "run_engine", _no_streaming)
    reused = run(config(tiny_setup, "policy=full", "budget=16"), second)
    assert reused[sharing.REUSED_FROM] == str(first) and sharing.REUSED_FROM not in computed
    assert reused == {**computed, "run_name": reused["run_name"], sharing.REUSED_FROM: str(first)}
    assert reused == read_metrics(second) and read_config(second)["budget"] == 16
    pd.testing.assert_frame_equal(read_tokens(second), read_tokens(first))
    third = run(config(tiny_setup, "policy=full", "budget=20"), tmp_path / "B20")  # a reused run's origin
    assert third[sharing.REUSED_FROM] == str(first)
    stamp = (second / "metrics.json").stat().st_mtime_ns
    run(config(tiny_setup, "policy=full", "budget=16"), second)  # complete: resumed
    assert (second / "metrics.json").stat().st_mtime_ns == stamp


def _change_metric(run_dir: Path, key: str, value) -> None:
    metrics = read_metrics(run_dir)
    (run_dir / "metrics.json").write_text(json.dumps({**metrics, key: value}))


def _change_a_token(run_dir: Path) -> None:
    tokens = read_tokens(run_dir)
    tokens.loc[5, "token_id"] += 1
    diff = run_dir / DIFF_FILE
    code_diff = diff.read_bytes() if diff.exists() else None
    write_run(run_dir, read_config(run_dir), read_metrics(run_dir), tokens, code_diff)


@pytest.mark.parametrize(
    ("first", "second", "edit"),
    [
        (["dataset.max_tokens=32"], [], None),
        (["chunk=8"], [], None),
        (["batch=2"], [], None),
        (["seed=1"], [], None),
        pytest.param(["dtype=bfloat16"], [], None, marks=BF16_UNDER_EMULATED_KERNELS),
        ([], ["reuse=false"], None),
        ([], [], lambda run_dir: _change_metric(run_dir, "torch_threads", 99)),  # another machine's
        ([], [], lambda run_dir: _change_metric(run_dir, "git_revision", "0" * 40)),  # other code's
        ([], [], _change_a_token),  # other documents under the same config
        (["policy=h2o"], ["policy=h2o"], None),  # a policy that keeps its budget
    ],
    ids=["max_tokens", "chunk", "batch", "seed", "dtype", "reuse=false", "threads", "code", "tokens", "h2o"],
)
def test_a_changed_setting_prevents_reuse(tiny_setup, tmp_path, first, second, edit):
    """Anything but the budget that may change results makes the second run stream its documents."""
    source = tmp_path / "B12"
    run(config(tiny_setup, "policy=full", "budget=12", *first), source)
    if edit is not None:
        edit(source)
    metrics = run(config(tiny_setup, "policy=full", "budget=16", *second), tmp_path / "B16")
    assert sharing.REUSED_FROM not in metrics


def test_the_reference_pass_runs_once_across_budgets(tiny_setup, tmp_path, monkeypatch):
    """The oracle at two budgets runs its reference pass once (read from the cache beside the runs the
    second time); its results equal those of a run without the cache."""
    calls = []

    def counted(engine, streams, tau):
        calls.append(len(streams))
        return stream_futures(engine, streams, tau)

    monkeypatch.setattr(lookahead, "stream_futures", counted)
    for budget in (12, 16):
        metrics = run(config(tiny_setup, "policy=oracle", f"budget={budget}"), tmp_path / f"B{budget}")
        assert metrics["reference_wall_s"] > 0
    assert calls == [N_DOCS]  # one pass of the three documents side by side (batch 4), at B=12 only
    assert len(list((tmp_path / sharing.CACHE_DIR).glob("*.pt"))) == 1
    fresh = tmp_path / "uncached" / "B16"
    run(config(tiny_setup, "policy=oracle", "budget=16", "reuse=false"), fresh)
    assert calls == [N_DOCS, N_DOCS] and not (fresh.parent / sharing.CACHE_DIR).exists()
    pd.testing.assert_frame_equal(read_tokens(tmp_path / "B16"), read_tokens(fresh))
    run(config(tiny_setup, "policy=oracle", "budget=16", "oracle.tau=0.05"), tmp_path / "tau")
    assert calls == [N_DOCS] * 3  # other reference settings: another pass
