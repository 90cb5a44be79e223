"""Paired comparisons and bootstrap intervals (rmm/analysis/compare.py, bootstrap.py) on SYNTHETIC runs."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from rmm.analysis import compare
from rmm.analysis.bootstrap import mean_interval, nll_interval, replicate_means
from rmm.analysis.collect import collect, load_runs, write_csv
from rmm.storage import read_tokens, write_run
from tests.fixtures.results.synthetic import make_synthetic_results

N_DOCS, DOC_LEN = 4, 600


def token_frame(nll: np.ndarray, token_ids: np.ndarray | None = None) -> pd.DataFrame:
    """Tokens of N_DOCS documents of DOC_LEN tokens; nll: (N_DOCS * DOC_LEN,); position 0 unscored."""
    positions = np.tile(np.arange(DOC_LEN), N_DOCS)
    nll = np.where(positions > 0, nll, np.nan).astype(np.float32)
    ids = np.arange(positions.size) % 997 if token_ids is None else token_ids
    return pd.DataFrame(
        {
            "doc_id": np.repeat([f"doc{i}" for i in range(N_DOCS)], DOC_LEN),
            "position": positions.astype(np.int32),
            "token_id": ids.astype(np.int32),
            "nll": pd.array(nll, dtype="Float32"),
            "correct": pd.array(np.where(positions > 0, nll < 1.0, False), dtype="boolean"),
        }
    )


def write(root: Path, name: str, tokens: pd.DataFrame) -> Path:
    """A run directory written by the repo's own storage writer."""
    nll = tokens["nll"].dropna().to_numpy(np.float64)
    metrics = {"ppl": math.exp(nll.mean()), "nll_mean": nll.mean(), "n_tokens": nll.size, "run_name": name}
    write_run(root / name, {"run_name": name}, metrics, tokens)
    return root / name


def base_nll(rng: np.random.Generator) -> np.ndarray:
    """Autocorrelated per-token NLL with a per-document level: (N_DOCS * DOC_LEN,)."""
    level = np.repeat(rng.normal(3.0, 0.4, N_DOCS), DOC_LEN)
    drift = np.repeat(rng.normal(0.0, 0.3, N_DOCS * DOC_LEN // 50), 50)  # 50-token stretches
    return level + drift + rng.gamma(2.0, 0.5, N_DOCS * DOC_LEN)


def test_known_shift_is_covered_and_zero_excluded(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    nll = base_nll(rng)
    shift = 0.05
    run_a = write(tmp_path, "a", token_frame(nll))
    run_b = write(tmp_path, "b", token_frame(nll + shift + rng.normal(0.0, 0.2, nll.size)))
    result = compare.compare_runs(run_a, run_b, block=64, n_resamples=1000)
    assert result["ci_low"] < shift < result["ci_high"] and result["ci_low"] > 0
    assert result["ppl_ratio"] == pytest.approx(math.exp(result["delta_nll"]))
    assert result["ppl_ratio"] == pytest.approx(result["ppl_b"] / result["ppl_a"])
    assert result["ppl_ratio_ci_low"] == pytest.approx(math.exp(result["ci_low"]))
    assert result["n_tokens"] == N_DOCS * (DOC_LEN - 1) and result["n_docs"] == N_DOCS
    assert result["docs_a_better"] == N_DOCS and result["docs_b_better"] == 0
    reverse = compare.compare_runs(run_b, run_a, block=64, n_resamples=1000)
    assert reverse["delta_nll"] == pytest.approx(-result["delta_nll"])
    assert reverse["docs_b_better"] == N_DOCS


def test_identical_runs_give_zero(tmp_path: Path) -> None:
    tokens = token_frame(base_nll(np.random.default_rng(2)))
    result = compare.compare_runs(write(tmp_path, "a", tokens), write(tmp_path, "b", tokens))
    assert result["delta_nll"] == 0.0 and result["ci_low"] == 0.0 and result["ci_high"] == 0.0
    assert result["ppl_ratio"] == 1.0 and result["docs_tied"] == N_DOCS


@pytest.mark.parametrize("change", ["token_id", "position", "missing_doc", "scored"])
def test_mismatched_tokens_are_refused(tmp_path: Path, change: str) -> None:
    tokens = token_frame(base_nll(np.random.default_rng(3)))
    other = tokens.copy()
    if change == "token_id":
        other.loc[700, "token_id"] += 1
    elif change == "position":
        other.loc[other["doc_id"] == "doc1", "position"] += 1
    elif change == "missing_doc":
        other = other[other["doc_id"] != "doc3"]
    else:
        other.loc[5, "nll"] = pd.NA
    run_a, run_b = write(tmp_path, "a", tokens), write(tmp_path, "b", other)
    with pytest.raises(compare.TokenMismatchError, match="different token sequences"):
        compare.compare_runs(run_a, run_b)
    assert compare.main([str(run_a), str(run_b)]) == 2


def test_doc_clusters_and_blocks_stay_inside_documents() -> None:
    sizes = np.array([37, 100, 250])
    levels = np.array([1.0, 10.0, 100.0])
    values = np.repeat(levels, sizes)  # constant within each document
    achievable = {
        round(float((counts * sizes * levels).sum() / (counts * sizes).sum()), 9)
        for counts in map(np.array, itertools.product(range(4), repeat=3))
        if counts.sum() == 3
    }
    for block in (1, 16, 64, 1000):
        replicates = replicate_means(values, sizes, block=block, n_resamples=500, seed=block)
        # a block crossing a boundary, or a rebuilt document of another length, gives another mean
        assert {round(float(r), 9) for r in replicates} <= achievable


def test_blocks_are_contiguous_and_circular() -> None:
    values = np.random.default_rng(4).normal(size=300)
    whole_doc = replicate_means(values, np.array([300]), block=300, n_resamples=200)
    assert np.allclose(whole_doc, values.mean())  # any rotation of the document has the same sum
    two_blocks = replicate_means(values, np.array([300]), block=150, n_resamples=200)
    assert np.unique(two_blocks.round(12)).size > 1  # while shorter blocks do vary


def test_block_one_single_doc_matches_scipy() -> None:
    values = np.random.default_rng(5).exponential(size=400)
    ours = mean_interval(values, np.array([400]), block=1, n_resamples=4000)
    theirs = stats.bootstrap(
        (values,), np.mean, n_resamples=4000, method="percentile", random_state=np.random.default_rng(0)
    ).confidence_interval
    width = theirs.high - theirs.low
    assert ours.low == pytest.approx(theirs.low, abs=0.05 * width)
    assert ours.high == pytest.approx(theirs.high, abs=0.05 * width)


def test_segment_restricts_the_comparison() -> None:
    nll = base_nll(np.random.default_rng(6))
    recall = np.tile(np.arange(DOC_LEN) >= DOC_LEN // 2, N_DOCS)
    a = token_frame(nll).assign(segment=np.where(recall, "recall", "text"))
    b = token_frame(nll + np.where(recall, 0.3, 0.0)).assign(segment=a["segment"])
    only = compare.compare_tokens(a, b, segment="recall")
    assert only["delta_nll"] == pytest.approx(0.3, abs=1e-5) and only["n_tokens"] == recall.sum()
    assert compare.compare_tokens(a, b, segment="text")["delta_nll"] == pytest.approx(0.0, abs=1e-6)
    assert compare.compare_tokens(a, b)["delta_nll"] < only["delta_nll"]
    with pytest.raises(compare.TokenMismatchError, match="segment"):
        compare.compare_tokens(a, b.assign(segment="text"))
    with pytest.raises(ValueError, match="no 'segment' column"):
        compare.compare_tokens(token_frame(nll), token_frame(nll), segment="recall")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    make_synthetic_results(root / "runs")
    write_csv(collect([root / "runs"], block=32, n_resamples=300), root / "runs.csv")
    return root


def test_csv_intervals_agree_with_compare(sweep: Path, tmp_path: Path) -> None:
    frame = load_runs(sweep / "runs.csv")
    assert (frame["ppl_ci_low"] < frame["ppl"]).all() and (frame["ppl"] < frame["ppl_ci_high"]).all()
    for row in frame.iloc[[0, 5, len(frame) - 1]].itertuples():
        tokens = read_tokens(row.run_dir)
        zero = write(tmp_path, f"zero{row.Index}", tokens.assign(nll=tokens["nll"] * 0))  # nll 0, same tokens
        result = compare.compare_runs(zero, row.run_dir, block=32, n_resamples=300)
        assert result["ppl_ratio"] == pytest.approx(row.ppl, rel=1e-5)
        assert result["ppl_ratio_ci_low"] == pytest.approx(row.ppl_ci_low, rel=1e-5)
        assert result["ppl_ratio_ci_high"] == pytest.approx(row.ppl_ci_high, rel=1e-5)
        direct = nll_interval(tokens, block=32, n_resamples=300)
        assert math.exp(direct.low) == pytest.approx(row.ppl_ci_low, rel=1e-6)


def test_sweep_against_baselines(sweep: Path) -> None:
    frame = load_runs(sweep / "runs.csv")
    h2o = compare.compare_sweep(frame, "policy=h2o", n_resamples=200)
    assert len(h2o) == len(frame) - 1 - 2  # every run but full (no budget match) and the h2o runs
    assert set(h2o["baseline_label"]) == {"h2o"} and (h2o["budget"] == h2o["budget"].sort_values()).all()
    for row in h2o.itertuples():
        assert f"B{row.budget:g}_" in row.a and f"B{row.budget:g}_" in row.b
        ppl = frame.set_index("run_dir")["ppl"]
        assert row.ppl_ratio == pytest.approx(ppl[row.run_b] / ppl[row.run_a], rel=1e-5)
    weights = compare.compare_sweep(frame, {"policy.weight": "prob"}, n_resamples=200)
    assert len(weights) == 4 and (weights["label"].str.contains("weight=correct")).all()
    for row in weights.itertuples():
        assert row.a.replace("weightprob", "weightcorrect") == row.b
    full = compare.compare_sweep(frame, "policy=full", n_resamples=200)
    assert len(full) == len(frame) - 1  # full has no budget: every run is paired with it
    table = compare.comparison_table(pd.concat([h2o, weights]))
    assert "### baseline `policy=h2o`" in table and "### baseline `policy.weight=prob`" in table
    assert table.count("| 64 | rmm (lag=16, weight=correct) | h2o |") == 1


def test_ambiguous_or_unknown_baseline_is_refused(sweep: Path) -> None:
    frame = load_runs(sweep / "runs.csv")
    with pytest.raises(ValueError, match="ambiguous.*pin one"):
        compare.compare_sweep(frame, "policy=rmm")  # four rmm runs per budget
    with pytest.raises(ValueError, match="not in the runs"):
        compare.compare_sweep(frame, "policy.nope=1")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        compare.parse_baseline("h2o")
    pinned = compare.compare_sweep(frame, "policy=rmm,lag=64,policy.weight=correct", n_resamples=100)
    assert set(pinned["baseline_label"]) == {"rmm (lag=64, weight=correct)"}


def test_cli_json_and_table(sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "comparison.md"
    args = [str(sweep / "runs.csv"), "--json", "--n-resamples", "100", "--table", str(out)]
    assert compare.main(args) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    keys = {"delta_nll", "ci_low", "ci_high", "ppl_ratio", "n_tokens", "n_docs", "docs_b_better"}
    assert records and all(keys <= set(r) for r in records)
    assert out.read_text().startswith("Paired per-token comparisons")
    runs = sorted(str(p) for p in (sweep / "runs").glob("*/*/h2o*"))
    assert compare.main([*runs, "--json", "--n-resamples", "50"]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["run_a"] == runs[0] and record["run_b"] == runs[1]
    assert compare.main([str(sweep / "runs")]) == 0  # a folder of runs is collected first
