"""The 2026 baselines (restkv, expected_attention) on natural text, placed between h2o and the smoother.

    python studies/natural8k/baselines2026.py [--out results/cpu/baselines2026.md]

For each natural-text study and budget, every arm against h2o at the same budget, paired per token:

- the perplexity ratio arm / h2o with its 95 % interval (documents, then 256-token blocks within them,
  rmm/analysis/bootstrap.py) and the documents where the arm is better;
- its share of the gap from h2o (0) to the smoother (1): (NLL_h2o - NLL_arm) / (NLL_h2o - NLL_smoother),
  token-weighted means over the same tokens, numerator and denominator resampled together (the
  resampling depends only on the documents' sizes and the seed), 95 % percentile interval; left out
  where the smoother's own ratio to h2o does not exclude 1 (no resolved gap to take a share of).

Studies: ``results/cpu/runs`` (3 plays x 2048 tokens, B = 64 to 512) and ``results/cpu/natural8k/runs`` (8
plays x 8192 tokens, B = 256 and 512), both SmolLM2-135M, chunk 16, cache positions. Arms: restkv and
expected_attention at their config defaults, restkv as its authors' code computes it (``restkv_official``:
``policy.variant=official``, window 16, SmolLM2 with its KV heads repeated per query head, rmm/kv_heads.py),
rmm(correct, accumulate) at each study's registered lag (32, the config default, at 2048 tokens; 128 at
8192), and the smoother (oracle ``future_utility``, weight correct). A budget without h2o or the smoother is
left out. The regime map's cells with these baselines are in results/cpu/regimes/cells.md (``make
regimes``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from rmm.analysis.bootstrap import (
    BLOCK,
    CONFIDENCE,
    N_RESAMPLES,
    SEED,
    doc_sizes,
    paired_tokens,
    replicate_means,
)
from rmm.analysis.bootstrap import compare_tokens as compare
from rmm.analysis.collect import collect
from rmm.storage import atomic_write_text, read_tokens

REPO = Path(__file__).resolve().parents[2]
STUDIES = {  # study -> (runs root, rmm's registered lag)
    "natural text, 3 plays x 2048 tokens (make reproduce-cpu)": ("results/cpu/runs", 32),
    "natural text, 8 plays x 8192 tokens (make natural8k)": ("results/cpu/natural8k/runs", 128),
}
ARMS = ("restkv", "restkv_official", "expected_attention", "rmm", "smoother")


def arm(row: pd.Series, lag: int) -> str | None:
    """The arm a run belongs to (h2o, an entry of :data:`ARMS`), or None."""
    policy = row["policy"]
    if policy == "restkv" and row.get("policy.variant") == "official":
        return "restkv_official"
    if policy in ("h2o", "restkv", "expected_attention"):
        return policy
    if (
        policy == "oracle"
        and row.get("policy.variant") == "future_utility"
        and row.get("policy.weight") == "correct"
    ):
        return "smoother"
    if (
        policy == "rmm"
        and row.get("lag") == lag
        and (row.get("policy.weight"), row.get("policy.after_commit"))
        == (
            "correct",
            "accumulate",
        )
    ):
        return "rmm"
    return None


def share_of_gap(h2o: pd.DataFrame, run: pd.DataFrame, smoother: pd.DataFrame) -> tuple[float, float, float]:
    """(NLL_h2o - NLL_run) / (NLL_h2o - NLL_smoother) with its percentile interval."""
    gain = paired_tokens(h2o, run)
    gap = paired_tokens(h2o, smoother)
    if not gain[["doc_id", "position"]].equals(gap[["doc_id", "position"]]):
        raise ValueError("the runs do not score the same tokens")
    sizes = doc_sizes(gain)
    gains = replicate_means((gain["nll_a"] - gain["nll_b"]).to_numpy(), sizes, BLOCK, N_RESAMPLES, SEED)
    gaps = replicate_means((gap["nll_a"] - gap["nll_b"]).to_numpy(), sizes, BLOCK, N_RESAMPLES, SEED)
    alpha = (1.0 - CONFIDENCE) / 2.0
    low, high = np.quantile(gains / gaps, [alpha, 1.0 - alpha])
    point = (gain["nll_a"] - gain["nll_b"]).mean() / (gap["nll_a"] - gap["nll_b"]).mean()
    return float(point), float(low), float(high)


def study_rows(root: Path, lag: int) -> list[dict]:
    frame = collect([root], intervals=False)
    frame = frame.assign(arm=frame.apply(arm, axis=1, lag=lag)).dropna(subset=["arm"])
    rows = []
    for budget, runs in frame.groupby("budget", sort=True):
        by_arm = {name: read_tokens(group["run_dir"].iloc[0]) for name, group in runs.groupby("arm")}
        if not {"h2o", "smoother"} <= set(by_arm):
            continue
        for name in [a for a in ARMS if a in by_arm]:
            result = compare(by_arm["h2o"], by_arm[name])
            share = share_of_gap(by_arm["h2o"], by_arm[name], by_arm["smoother"])
            rows.append(
                {
                    "budget": int(budget),
                    "arm": name,
                    "ppl": result["ppl_b"],
                    "ppl_h2o": result["ppl_a"],
                    "ratio": result["ppl_ratio"],
                    "ratio_ci_low": result["ppl_ratio_ci_low"],
                    "ratio_ci_high": result["ppl_ratio_ci_high"],
                    "docs_better": result["docs_b_better"],
                    "n_docs": result["n_docs"],
                    "share": share[0],
                    "share_ci_low": share[1],
                    "share_ci_high": share[2],
                }
            )
        if {"restkv", "restkv_official"} <= set(by_arm):  # the two ReST-KVs paired directly
            result = compare(by_arm["restkv"], by_arm["restkv_official"])
            rows.append(
                {
                    "budget": int(budget),
                    "arm": "restkv_official / restkv",
                    "paired": True,
                    "ratio": result["ppl_ratio"],
                    "ratio_ci_low": result["ppl_ratio_ci_low"],
                    "ratio_ci_high": result["ppl_ratio_ci_high"],
                    "docs_better": result["docs_b_better"],
                    "n_docs": result["n_docs"],
                }
            )
    return rows


def markdown(tables: dict[str, list[dict]]) -> str:
    lines = [
        "# The 2026 baselines on natural text, between h2o and the smoother",
        "",
        "Written by `python studies/natural8k/baselines2026.py`. Ratio: perplexity of the arm / h2o's "
        "at the same "
        "budget, paired per token, [95 % interval] resampling documents then 256-token blocks; docs: "
        "documents where the arm is better. Share: (NLL h2o - NLL arm) / (NLL h2o - NLL smoother), 0 at h2o, "
        "1 at the smoother, negative below h2o, with the same resampling; given only where the smoother's "
        "own ratio to h2o excludes 1. `*`: the interval excludes 1 (ratio) or 0 (share). restkv: the "
        "harness variant; restkv_official: its authors' code (policy.variant=official, window 16 = the "
        "chunk), on SmolLM2 with its KV heads repeated per query head as that code does, so it keeps 3x the "
        "entries of the other arms at the same B (one selection per query head).",
    ]
    for study, rows in tables.items():
        lines += [
            "",
            f"## {study}",
            "",
            "| B | arm | ppl | ratio to h2o | docs | share of the gap h2o -> smoother |",
        ]
        lines += ["|---:|---|---:|---:|---:|---:|"]
        gap_resolved = {  # the smoother's ratio to h2o excludes 1: a gap to take a share of
            r["budget"]: r["ratio_ci_high"] < 1 for r in rows if r["arm"] == "smoother"
        }
        pairs = [r for r in rows if r.get("paired")]
        for r in (r for r in rows if not r.get("paired")):
            ratio_mark = "*" if r["ratio_ci_low"] > 1 or r["ratio_ci_high"] < 1 else ""
            share_mark = "*" if r["share_ci_low"] > 0 or r["share_ci_high"] < 0 else ""
            ratio = f"{r['ratio']:.3f} [{r['ratio_ci_low']:.3f}, {r['ratio_ci_high']:.3f}]{ratio_mark}"
            share = f"{r['share']:.2f} [{r['share_ci_low']:.2f}, {r['share_ci_high']:.2f}]{share_mark}"
            if r["arm"] == "smoother":
                share = "1 (by definition)"
            elif not gap_resolved[r["budget"]]:
                share = "no gap: the smoother does not resolve from h2o"
            docs = f"{r['docs_better']}/{r['n_docs']}"
            lines.append(f"| {r['budget']} | {r['arm']} | {r['ppl']:.2f} | {ratio} | {docs} | {share} |")
        if pairs:
            lines += ["", "| B | restkv_official / restkv (paired) | docs |", "|---:|---:|---:|"]
        for r in pairs:
            mark = "*" if r["ratio_ci_low"] > 1 or r["ratio_ci_high"] < 1 else ""
            ratio = f"{r['ratio']:.3f} [{r['ratio_ci_low']:.3f}, {r['ratio_ci_high']:.3f}]{mark}"
            lines.append(f"| {r['budget']} | {ratio} | {r['docs_better']}/{r['n_docs']} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "results/cpu/baselines2026.md")
    args = parser.parse_args(argv)
    tables = {study: study_rows(REPO / root, lag) for study, (root, lag) in STUDIES.items()}
    text = markdown(tables)
    atomic_write_text(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
