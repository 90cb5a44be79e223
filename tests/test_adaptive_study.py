"""The adaptive-lag confirmation's analysis (studies/adaptive/adaptive.py): the registered design, the verdict
rules, and the verdict table on synthetic runs over real generated streams (setting R1 on SmolLM2; the rest
pending)."""

from __future__ import annotations

import json
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
from studies.adaptive import adaptive
from tests.test_reuse import filler_dir, reuse_cfg, tok  # noqa: F401  (fixtures)

# (policy, lag, variant, recall NLL offset) in R1: auto takes 0.9 of h2o's 2.0 - 1.0 = 1 nat gap to the fixed
# lag (P2: 0.9 >= 0.7), the smoother gains 1.5 (P4: 0.6)
ARMS = [
    ("h2o", None, None, 2.0),
    ("rmm", "auto", None, 1.1),
    ("rmm", 48, None, 1.0),
    ("oracle", None, "future_utility", 0.5),
]


def test_the_settings_are_the_registered_ones() -> None:
    lines = adaptive.setting_lines("gemma3_270m")
    assert [line.split()[0] for line in lines] == ["R1", "R2", "R5"]
    assert lines[0].split()[1] == "h2o,auto" and lines[1].split()[1] == "h2o,auto,fixed48,smoother"
    assert "budget=256" in lines[2] and "dataset.echo_gap=48" in lines[2] and "lag" not in lines[2]
    assert len(adaptive.setting_lines("smollm2_135m")) == 6
    assert adaptive.registered()["seeds"] == list(range(19, 27))


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"prediction": "P1", "p_holm": 0.01, "log_ratio": 0.2}, "refuted"),
        ({"prediction": "P1", "p_holm": 0.01, "log_ratio": -0.2}, "holds"),
        ({"prediction": "P1", "p_holm": 0.3, "log_ratio": 0.2}, "holds"),
        ({"prediction": "P2", "p_holm": 0.01, "log_ratio": -0.1}, "confirmed"),
        ({"prediction": "P2", "p_holm": 0.01, "log_ratio": 0.1}, "refuted"),
        ({"prediction": "P3", "p_holm": 0.2, "log_ratio": 0.1}, "unresolved"),
        ({"prediction": "P4", "share": 0.5}, "reported"),
    ],
)
def test_verdict_rules(row: dict, expected: str) -> None:
    assert adaptive.verdict(pd.Series(row), 0.05) == expected


@pytest.fixture
def study(tok, filler_dir, tmp_path) -> Path:  # noqa: F811
    root = tmp_path / "runs"
    rng = np.random.default_rng(0)
    for seed in adaptive.registered()["seeds"]:
        cfg = reuse_cfg(filler_dir, n_decoys=4, recall_gap=192, n_records=4, echo_gap=32, seed=seed)
        docs, _ = load_documents(cfg, tok, cache_dir=tmp_path / "cache")
        for policy, lag, variant, offset in ARMS:
            frames = []
            for doc in docs:
                n = doc.tokens.numel()
                recall = torch.from_numpy(doc.segments[1:] == "recall")
                nll = torch.tensor(rng.gamma(2.0, 0.5, n - 1), dtype=torch.float32) + offset * recall
                frames.append(
                    token_frame(doc.doc_id, doc.tokens, StreamResult(nll, nll < 1.0, 0, 0, 0), doc.segments)
                )
            tokens = pd.concat(frames, ignore_index=True)
            name = f"s{seed}_{policy}_{lag}"
            metrics = {
                "run_name": name,
                "model": "smollm2_135m",
                "policy": policy,
                "budget": 128,
                "lag": None if lag == "auto" else (lag or 32),
                "ppl": math.exp(float(tokens["nll"].astype(float).mean())),
                **segment_metrics(tokens),
                **(
                    {"policy.weight": "correct", "policy.after_commit": "accumulate"}
                    if policy == "rmm"
                    else {}
                ),
                **({"policy.variant": variant, "policy.weight": "correct"} if variant else {}),
                **{f"dataset.{k}": v for k, v in cfg.items() if k not in ("name", "filler")},
            }
            if lag == "auto":  # the choices at two boundaries of each stream: 3 heads, arms h2o, 32, 48
                record = {
                    "boundaries": [[16, 32]] * len(docs),
                    "counts": [[[3, 0, 0], [0, 1, 2]]] * len(docs),
                }
                metrics["lag_auto"] = {"arms": ["h2o", 32, 48], **record}
            write_run(root / name, {"run_name": name}, metrics, tokens)
    return root


def test_verdict_table_on_synthetic_runs(study: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    natural = tmp_path / "no_natural_runs"
    assert (
        adaptive.main([str(study), "--out", str(out), "--natural", str(natural), "--n-resamples", "200"]) == 0
    )
    table = pd.read_csv(out / "verdicts.csv")
    r1 = table[(table["setting"] == "R1") & (table["model"] == "smollm2_135m")].set_index("prediction")
    assert r1.loc["P1", "verdict"] == "holds (provisional: family incomplete)"
    assert r1.loc["P1", "ratio"] == pytest.approx(math.exp(-0.9), rel=0.02)
    assert r1.loc["P2", "verdict"] == "confirmed" and r1.loc["P2", "share"] == pytest.approx(0.9, abs=0.1)
    assert r1.loc["P4", "verdict"] == "reported" and r1.loc["P4", "share"] == pytest.approx(0.6, abs=0.1)
    assert r1.loc["P4", "share_low"] < 0.6 < r1.loc["P4", "share_high"]
    rest = table[(table["setting"] != "R1") | (table["model"] != "smollm2_135m")]
    assert rest["verdict"].str.startswith("pending").all()
    assert len(table) == 20 + 12  # SmolLM2 16 tested + 4 P4, Gemma 3 9 tested + 3 P4
    text = (out / "verdicts.md").read_text()
    assert "Verdicts, smollm2_135m (20 predictions): pending 17, holds 1, confirmed 1, reported 1." in text
    assert (out / "figures" / "chosen_lag.png").stat().st_size > 0
    curve = adaptive.chosen_lag([str(next(study.glob("s19_rmm_auto")))], bin_tokens=16)
    assert curve.tolist() == [pytest.approx(0.0), pytest.approx((32 + 2 * 48) / 3)]


def test_lag_auto_runs_are_their_own_arm() -> None:
    auto = pd.Series({"policy": "rmm", "lag": float("nan"), "policy.weight": "correct"})
    fixed = pd.Series(
        {"policy": "rmm", "lag": 48.0, "policy.weight": "correct", "policy.after_commit": "accumulate"}
    )
    assert adaptive.run_arm(auto) == "auto" and adaptive.run_arm(fixed) == "fixed48"
    assert json.loads(json.dumps(adaptive.arms({"class": "every_lag_loses"}))) == ["h2o", "auto"]
