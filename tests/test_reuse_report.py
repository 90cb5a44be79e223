"""The controlled-reuse report (studies/reuse/reuse_report.py) on synthetic runs over real generated
streams."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from rmm.data import load_documents
from rmm.engine import StreamResult
from rmm.metrics import segment_metrics, token_frame
from rmm.storage import write_run
from studies.reuse import reuse_report
from tests.test_reuse import filler_dir, reuse_cfg, tok  # noqa: F401  (fixtures)

# (policy, budget, lag, weight, after_commit, n_decoys, recall NLL offset)
RUNS = [
    ("full", None, None, None, None, 4, 0.0),
    ("h2o", 128, None, None, None, 4, 2.0),
    ("oracle", 128, None, None, None, 4, 0.5),
    ("rmm", 128, 16, "correct", "accumulate", 4, 1.5),
    ("rmm", 128, 48, "correct", "accumulate", 4, 1.0),
    ("rmm", 128, 16, "uniform", "accumulate", 4, 2.0),
    ("rmm", 128, 48, "uniform", "accumulate", 4, 2.0),
    ("h2o", 128, None, None, None, 12, 2.5),
    ("rmm", 128, 48, "correct", "accumulate", 12, 1.2),
    ("full", None, None, None, None, 12, 0.0),
]


@pytest.fixture
def study(tok, filler_dir, tmp_path) -> Path:  # noqa: F811
    root = tmp_path / "runs"
    rng = np.random.default_rng(0)
    for policy, budget, lag, weight, after, n_decoys, offset in RUNS:
        cfg = reuse_cfg(filler_dir, n_decoys=n_decoys, recall_gap=192, n_records=4)
        docs, _ = load_documents(cfg, tok, cache_dir=tmp_path / "cache")
        frames = []
        for doc in docs:
            n = doc.tokens.numel()
            recall = torch.from_numpy(doc.segments[1:] == "recall")
            nll = torch.tensor(rng.gamma(2.0, 0.5, n - 1), dtype=torch.float32) + offset * recall
            correct = nll < 1.0
            frames.append(
                token_frame(doc.doc_id, doc.tokens, StreamResult(nll, correct, 0, 0, 0), doc.segments)
            )
        tokens = pd.concat(frames, ignore_index=True)
        name = f"{policy}_B{budget}_H{lag}_{weight}_{after}_d{n_decoys}"
        metrics = {
            "run_name": name,
            "model": "tiny",
            "dataset": "reuse",
            "policy": policy,
            "budget": budget,
            "lag": lag,
            "chunk": 16,
            "positions": "cache",
            "scope": "head",
            "seed": 0,
            "ppl": math.exp(float(tokens["nll"].astype(float).mean())),
            "estimator_spearman": None if policy in ("full", "oracle") else 0.1 * (lag or 1) / 48,
            **segment_metrics(tokens),
            **(
                {"policy.weight": weight, "policy.after_commit": after, "policy.lag": lag}
                if policy == "rmm"
                else {}
            ),
            **{f"dataset.{k}": v for k, v in cfg.items() if k not in ("name", "filler")},
        }
        write_run(root / name, {"run_name": name}, metrics, tokens)
    return root


def test_report_writes_tables_and_figures(study: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    assert reuse_report.main([str(study), "--out", str(out), "--natural", str(tmp_path / "none.csv")]) == 0
    for name in ("runs.csv", "recall_table.md", "comparison.md", "estimator.md"):
        assert (out / name).is_file()
    for figure in ("recall_vs_lag", "recall_vs_decoys"):
        assert (out / "figures" / f"{figure}.png").is_file()
    runs = pd.read_csv(out / "runs.csv")
    assert len(runs) == len(RUNS)
    assert (runs["nll_recall_ci_low"] <= runs["nll_recall"]).all()
    assert (runs["nll_recall"] <= runs["nll_recall_ci_high"]).all()
    table = (out / "recall_table.md").read_text()
    h2o = runs[(runs["policy"] == "h2o") & (runs["dataset.n_decoys"] == 4)].iloc[0]
    assert f"{h2o['nll_recall']:.3f} [{h2o['nll_recall_ci_low']:.3f}" in table
    assert "decoy fraction 0.75" in table and "decoy fraction 0.50" in table


def test_recall_comparisons_pair_only_recall_tokens(study: Path) -> None:
    frame = reuse_report.recall_intervals(reuse_report.collect([study]))
    result = reuse_report.comparisons(frame, block=4)
    against_h2o = result[result["baseline"] == "policy=h2o"]
    assert (against_h2o["n_tokens"] == 4 * 4 * 3).all()  # 4 true records x 4 code tokens x 3 streams
    assert set(against_h2o["dataset.n_decoys"] if "dataset.n_decoys" in against_h2o else []) <= {4, 12}
    correct48 = against_h2o["label"].str.contains("lag=48") & against_h2o["label"].str.contains("correct")
    rmm48 = against_h2o[correct48]
    assert len(rmm48) == 2 and (rmm48["delta_nll"] < 0).all()  # built with a lower recall NLL than h2o
    assert (rmm48["ci_high"] < 0).all()
    uniform = result[result["baseline"].str.startswith("policy.weight=uniform")]
    assert len(uniform) == 2  # correct at lags 16 and 48, decoy fraction 0.5 (no uniform run at 0.75)
