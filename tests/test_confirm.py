"""The confirmatory study's analysis (studies/confirm/confirm.py): Holm, the verdict rules, and the verdict
table on synthetic runs over real generated streams (one registered cell; the others pending)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from rmm.analysis import seeds
from rmm.data import load_documents
from rmm.engine import StreamResult
from rmm.metrics import segment_metrics, token_frame
from rmm.storage import write_run
from studies.confirm import confirm
from tests.test_reuse import filler_dir, reuse_cfg, tok  # noqa: F401  (fixtures)

# (policy, lag, weight, after_commit, recall NLL offset) in cell W2: rmm(correct) recalls better than h2o and
# rmm(uniform); freeze recalls worse than accumulate (against its registered "win")
ARMS = [
    ("h2o", None, None, None, 2.0),
    ("rmm", 48, "correct", "accumulate", 1.0),
    ("rmm", 48, "uniform", "accumulate", 2.0),
    ("rmm", 48, "correct", "freeze", 1.6),
]


def test_holm_steps_down() -> None:
    assert seeds.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert seeds.holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])


@pytest.mark.parametrize(
    ("predicted", "row", "expected"),
    [
        ("win", {"p_holm": 0.01, "log_ratio": -0.3}, "confirmed"),
        ("win", {"p_holm": 0.01, "log_ratio": 0.3}, "refuted"),
        ("loss", {"p_holm": 0.2, "log_ratio": 0.3}, "unresolved"),
        ("tie", {"p_holm": 0.5, "ratio_low90": 0.9, "ratio_high90": 1.1}, "confirmed"),
        ("tie", {"p_holm": 0.5, "ratio_low90": 0.7, "ratio_high90": 1.1}, "unresolved"),
        ("tie", {"p_holm": 0.01, "ratio_low90": 1.3, "ratio_high90": 1.6}, "refuted"),
    ],
)
def test_verdict_rules(predicted: str, row: dict, expected: str) -> None:
    assert confirm.verdict(predicted, row) == expected


def test_t_summary_is_a_t_interval() -> None:
    d = np.array([-0.2, -0.1, -0.3, -0.2, -0.25, -0.15, -0.2, -0.1])
    out = seeds.t_summary(d)
    half = 2.364624 * d.std(ddof=1) / math.sqrt(8)  # t_{0.975, 7}
    assert out["ratio_low95"] == pytest.approx(math.exp(d.mean() - half), rel=1e-5)
    assert out["p"] == pytest.approx(2 * 6.12e-5, rel=0.01) and out["ratio"] < 1


def test_the_cells_are_the_registered_ones() -> None:
    lines = confirm.cell_overrides("gemma3_270m")
    assert [line.split()[0] for line in lines] == ["W2", "L2", "W4", "L6"]
    assert lines[1].split()[1] == "16" and "budget=128" in lines[1] and "lag" not in lines[1]
    assert len(confirm.cell_overrides("smollm2_135m")) == 16


@pytest.fixture
def study(tok, filler_dir, tmp_path) -> Path:  # noqa: F811
    root = tmp_path / "runs"
    rng = np.random.default_rng(0)
    for seed in confirm.SEEDS:
        cfg = reuse_cfg(filler_dir, n_decoys=4, recall_gap=192, n_records=4, echo_gap=32, seed=seed)
        docs, _ = load_documents(cfg, tok, cache_dir=tmp_path / "cache")
        for policy, lag, weight, after, offset in ARMS:
            frames = []
            for doc in docs:
                n = doc.tokens.numel()
                recall = torch.from_numpy(doc.segments[1:] == "recall")
                nll = torch.tensor(rng.gamma(2.0, 0.5, n - 1), dtype=torch.float32) + offset * recall
                frames.append(
                    token_frame(doc.doc_id, doc.tokens, StreamResult(nll, nll < 1.0, 0, 0, 0), doc.segments)
                )
            tokens = pd.concat(frames, ignore_index=True)
            name = f"s{seed}_{policy}_{lag}_{weight}_{after}"
            params = {"policy.weight": weight, "policy.after_commit": after}
            metrics = {
                "run_name": name,
                "model": "smollm2_135m",
                "policy": policy,
                "budget": 128,
                "lag": lag if lag is not None else 32,
                "ppl": math.exp(float(tokens["nll"].astype(float).mean())),
                **segment_metrics(tokens),
                **{k: v for k, v in params.items() if v is not None},
                **{f"dataset.{k}": v for k, v in cfg.items() if k not in ("name", "filler")},
            }
            write_run(root / name, {"run_name": name}, metrics, tokens)
    return root


def test_verdict_table_on_synthetic_runs(study: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    out.mkdir()
    assert confirm.main([str(study), "--out", str(out), "--n-resamples", "200"]) == 0
    table = pd.read_csv(out / "verdicts.csv")
    w2 = table[(table["cell"] == "W2") & (table["model"] == "smollm2_135m")].set_index("comparison")
    assert w2.loc["correct_vs_h2o", "verdict"] == "confirmed" and w2.loc["correct_vs_h2o", "ratio"] < 0.5
    assert w2.loc["correct_vs_uniform", "verdict"] == "confirmed"
    assert w2.loc["freeze_vs_accumulate", "verdict"] == "refuted"  # registered "win", synthetic freeze worse
    assert w2["seeds_b_better"].tolist() == [8, 8, 0]
    pending = table[table["cell"] != "W2"]
    assert len(table) == 60 and pending["verdict"].str.startswith("pending (0 of 8").all()
    text = (out / "verdicts.md").read_text()
    assert (
        "| win | smollm2_135m | W2 | correct_vs_h2o |" in text
        and "Verdicts, smollm2_135m (48 predictions): confirmed 2, refuted 1, pending 45." in text
        and "Verdicts, gemma3_270m (12 predictions): pending 12." in text
    )


def test_natural_lag_takes_the_lowest_perplexity_ties_to_the_smaller_lag(tmp_path: Path) -> None:
    root = tmp_path / "natural2048"
    ppls = {(256, 32): 30.0, (256, 64): 29.0, (256, 128): 29.0, (512, 32): 25.0, (512, 64): 26.0}
    tokens = pd.DataFrame(
        {"doc_id": ["a"], "position": [1], "token_id": [5], "nll": [1.0], "correct": [True]}
    )
    for (budget, lag), ppl in ppls.items():
        name = f"rmm_H{lag}_B{budget}"
        metrics = {
            "run_name": name,
            "policy": "rmm",
            "policy.weight": "correct",
            "budget": budget,
            "lag": lag,
        }
        write_run(root / name, {"run_name": name}, {**metrics, "ppl": ppl}, tokens)
    assert confirm.natural_lag(root, 256) == 64  # 64 and 128 tie: the smaller lag
    with pytest.raises(SystemExit, match="has not run all of lags"):
        confirm.natural_lag(root, 512)  # lag 128 missing
