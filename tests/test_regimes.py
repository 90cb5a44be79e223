"""The regime map's report (studies/regimes/regimes.py) on synthetic runs over real generated streams, and the
seed-level cluster of the bootstrap."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from rmm.analysis.bootstrap import replicate_means
from rmm.data import load_documents
from rmm.engine import StreamResult
from rmm.metrics import segment_metrics, token_frame
from rmm.storage import write_run
from studies.regimes import regimes, regimes_t
from tests.test_reuse import filler_dir, reuse_cfg, tok  # noqa: F401  (fixtures)

SEEDS = (1, 2, 3)
# (policy, lag, weight, after_commit, variant, recall NLL offset); the base cell only, echo_gap 32 and 64
ARMS = [
    ("h2o", None, None, None, None, 2.0),
    ("rmm", 48, "correct", "accumulate", None, 1.0),
    ("rmm", 48, "uniform", "accumulate", None, 2.0),
    ("rmm", 48, "correct", "freeze", None, 1.5),
    ("oracle", None, "correct", None, "future_utility", 0.0),
    ("oracle", None, "correct", None, "future_mass", 0.5),
]


def test_seed_clusters_widen_the_interval() -> None:
    """Two seeds of 4 documents each, one all 0 and one all 1: resampling seeds on top reaches both ends."""
    sizes = np.full(8, 10)
    values = np.repeat([0.0, 1.0], 40)
    groups = np.repeat([1, 2], 4)
    grouped = replicate_means(values, sizes, block=5, n_resamples=400, groups=groups)
    plain = replicate_means(values, sizes, block=5, n_resamples=400)
    assert grouped.min() == 0.0 and grouped.max() == 1.0
    assert ((grouped == 0.0) | (grouped == 1.0)).mean() > 0.3  # both copies of one seed, about half the time
    assert plain.std() < grouped.std()
    with pytest.raises(ValueError, match="one label per document"):
        replicate_means(values, sizes, groups=groups[:3])


@pytest.fixture
def study(tok, filler_dir, tmp_path) -> Path:  # noqa: F811
    root = tmp_path / "runs"
    rng = np.random.default_rng(0)
    for seed in SEEDS:
        for echo_gap in (32, 64):
            cfg = reuse_cfg(filler_dir, n_decoys=4, recall_gap=192, n_records=4, echo_gap=echo_gap, seed=seed)
            docs, _ = load_documents(cfg, tok, cache_dir=tmp_path / "cache")
            for policy, lag, weight, after, variant, offset in ARMS:
                frames = []
                for doc in docs:
                    n = doc.tokens.numel()
                    recall = torch.from_numpy(doc.segments[1:] == "recall")
                    nll = torch.tensor(rng.gamma(2.0, 0.5, n - 1), dtype=torch.float32) + offset * recall
                    result = StreamResult(nll, nll < 1.0, 0, 0, 0)
                    frames.append(token_frame(doc.doc_id, doc.tokens, result, doc.segments))
                tokens = pd.concat(frames, ignore_index=True)
                name = f"s{seed}_e{echo_gap}_{policy}_{lag}_{weight}_{after}_{variant}"
                params = {"policy.weight": weight, "policy.after_commit": after, "policy.variant": variant}
                metrics = {
                    "run_name": name,
                    "policy": policy,
                    "budget": 128,
                    "lag": lag,
                    "ppl": math.exp(float(tokens["nll"].astype(float).mean())),
                    **segment_metrics(tokens),
                    **{k: v for k, v in params.items() if v is not None},
                    **{f"dataset.{k}": v for k, v in cfg.items() if k not in ("name", "filler")},
                }
                write_run(root / name, {"run_name": name}, metrics, tokens)
    return root


def test_report_pools_seeds_and_draws_phase_maps(study: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    assert regimes.main([str(study), "--out", str(out), "--n-resamples", "300"]) == 0
    table = pd.read_csv(out / "comparisons.csv")
    assert set(table["dataset.echo_gap"]) == {32, 64} and set(table["lag"]) == {48}
    rows = table[table["dataset.echo_gap"] == 32].set_index("comparison")
    n_recall = 4 * 4 * 3 * len(SEEDS)  # records x code tokens x streams x seeds
    versus_h2o = rows.loc["rmm(correct) / h2o"]
    assert versus_h2o["n_tokens"] == n_recall and versus_h2o["n_seeds"] == len(SEEDS)
    assert versus_h2o["ci_high"] < 0 and versus_h2o["seeds_b_better"] == len(SEEDS)  # built 1 nat lower
    assert rows.loc["rmm(correct) / rmm(uniform)", "ci_high"] < 0
    assert rows.loc["freeze / accumulate", "ci_low"] > 0
    share = rows.loc["share of gap h2o -> smoother: rmm_correct"]
    assert share["ci_low"] < share["share"] < share["ci_high"]
    assert 0.3 < share["share"] < 0.7  # built as 1 of a 2-nat gap, diluted by the noise
    assert "seeds" in (out / "cells.md").read_text()
    assert (out / "figures" / "phase_echo.png").is_file()


def test_incomplete_cells_are_not_compared(study: Path, tmp_path: Path) -> None:
    frame = regimes.collect([study], intervals=False)
    missing = frame[~((frame[regimes.SEED_COLUMN] == 3) & (frame["policy"] == "h2o"))]
    table = regimes.comparisons(missing, n_resamples=100)
    assert not table["comparison"].str.contains("h2o").any()
    assert (table["comparison"] == "freeze / accumulate").sum() == 2
    only_h2o = regimes.comparisons(frame[frame["policy"] == "h2o"], n_resamples=100)
    assert only_h2o.empty
    assert not regimes.phase_map(only_h2o, "dataset.echo_gap", "lag", {}, tmp_path / "map.png", "none")


def test_per_seed_t_intervals_beside_the_bootstrap(study: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    assert regimes.main([str(study), "--out", str(out), "--n-resamples", "300"]) == 0
    t_out = out / "t_intervals.md"
    args = [str(study), "--comparisons", str(out / "comparisons.csv"), "--out", str(t_out)]
    assert regimes_t.main(args) == 0
    comparisons = pd.read_csv(out / "comparisons.csv")
    table = regimes_t.joined(comparisons, regimes_t.seed_rows(regimes.collect([study], intervals=False)))
    assert len(table) == comparisons["ratio"].notna().sum()  # every ratio row, no share row
    versus_h2o = table[table["comparison"] == "rmm(correct) / h2o"]
    assert versus_h2o["t_resolved"].all() and (versus_h2o["t_high"] < 1).all()  # built 1 nat lower per seed
    assert np.allclose(versus_h2o["t_ratio"], versus_h2o["ratio"])  # equal seed sizes: same mean
    assert f"{len(table)} ratio rows" in t_out.read_text()


def test_restkv_variants_are_two_arms() -> None:
    """The official ReST-KV's runs sit beside the harness variant's in the same cells: two arms, never one
    arm with two runs per seed (runs written before the variant existed are the harness variant's)."""
    from rmm.analysis.seeds import arm

    assert arm(pd.Series({"policy": "restkv", "policy.variant": "official"})) == "restkv_official"
    assert arm(pd.Series({"policy": "restkv", "policy.variant": "harness"})) == "restkv"
    assert arm(pd.Series({"policy": "restkv", "policy.variant": float("nan")})) == "restkv"
    assert arm(pd.Series({"policy": "expected_attention"})) == "expected_attention"
