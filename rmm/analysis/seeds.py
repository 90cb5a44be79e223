"""Designs replicated over generator seeds: which arm a run is, recall tokens paired and pooled over seeds,
the nested bootstrap over (seed, stream, block) and the per-seed t-summary with Holm's correction.

Shared by the regime map (``studies/regimes``), the confirmation (``studies/confirm``) and any later
study with the same design: a study imports these from here, never from another study.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import stats

from rmm.analysis.bootstrap import CONFIDENCE, SEED, paired_tokens, replicate_means
from rmm.storage import read_tokens

SEED_COLUMN = "dataset.seed"
# a reuse cell's factors as a registered design names them -> their run config keys
FACTOR_KEYS = {
    "echo_gap": "dataset.echo_gap",
    "recall_gap": "dataset.recall_gap",
    "budget": "budget",
    "decoys": "dataset.n_decoys",
}
BASELINES_2026 = ("restkv", "expected_attention")  # at their config defaults


def arm(row: pd.Series) -> str | None:
    """The arm a run (a row of ``rmm.analysis.collect``) belongs to, or None for a run outside the design.

    restkv's runs are two arms: ``restkv`` (the harness variant, the default; runs written before the
    variant existed have none) and ``restkv_official`` (``policy.variant=official``)."""
    if row["policy"] == "h2o":
        return "h2o"
    if row["policy"] == "restkv" and row.get("policy.variant") == "official":
        return "restkv_official"
    if row["policy"] in BASELINES_2026:
        return row["policy"]
    if row["policy"] == "oracle":
        variant = row.get("policy.variant")
        if variant == "future_utility" and row.get("policy.weight") == "correct":
            return "smoother"
        return "future_mass" if variant == "future_mass" else None
    if row["policy"] == "rmm":
        weight, commit = row.get("policy.weight"), row.get("policy.after_commit")
        if commit == "freeze":
            return "rmm_freeze" if weight == "correct" else None
        return {"correct": "rmm_correct", "uniform": "rmm_uniform"}.get(weight)
    return None


def pooled_pairs(pairs: list[tuple[int, str, str]]) -> pd.DataFrame:
    """Recall tokens of (seed, run a, run b) pairs, concatenated: seed, doc, nll_a, nll_b (doc unique)."""
    frames = []
    for seed, run_a, run_b in pairs:
        paired = paired_tokens(read_tokens(run_a), read_tokens(run_b), "recall")
        frames.append(paired.assign(seed=seed, doc=[f"{seed}:{d}" for d in paired["doc_id"]]))
    return pd.concat(frames, ignore_index=True)


def seed_replicates(values: np.ndarray, frame: pd.DataFrame, block: int, n_resamples: int) -> np.ndarray:
    """Bootstrap replicate means [n_resamples] of per-token ``values`` [T] of ``frame`` (rows grouped by
    doc, in order): seeds drawn first, then streams within a drawn seed, then blocks within a stream."""
    docs = frame["doc"].to_numpy()
    starts = np.flatnonzero(np.r_[True, docs[1:] != docs[:-1]])
    sizes = np.diff(np.r_[starts, len(docs)])
    groups = frame["seed"].to_numpy()[starts]
    return replicate_means(values, sizes, block, n_resamples, SEED, groups)


def percentile_interval(replicates: np.ndarray) -> tuple[float, float]:
    """The :data:`~rmm.analysis.bootstrap.CONFIDENCE` percentile interval of ``replicates``."""
    alpha = (1.0 - CONFIDENCE) / 2.0
    low, high = np.quantile(replicates, [alpha, 1.0 - alpha])
    return float(low), float(high)


def t_summary(d: np.ndarray) -> dict[str, float]:
    """Mean, 95 % and 90 % t-intervals (as ratios) and the two-sided p-value of mean d = 0 over the
    per-seed log ratios ``d`` [n_seeds]."""
    n, mean, se = d.size, float(d.mean()), float(d.std(ddof=1) / np.sqrt(d.size))
    out = {"log_ratio": mean, "ratio": float(np.exp(mean))}
    for level in (95, 90):
        half = float(stats.t.ppf(1 - (1 - level / 100) / 2, n - 1)) * se
        out[f"ratio_low{level}"], out[f"ratio_high{level}"] = (
            float(np.exp(mean - half)),
            float(np.exp(mean + half)),
        )
    out["p"] = float(2 * stats.t.sf(abs(mean) / se, n - 1)) if se > 0 else (0.0 if mean else 1.0)
    return out


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (monotone, capped at 1)."""
    order = np.argsort(p_values)
    adjusted, running = np.empty(len(p_values)), 0.0
    for rank, index in enumerate(order):
        running = max(running, (len(p_values) - rank) * p_values[index])
        adjusted[index] = min(1.0, running)
    return adjusted.tolist()
