"""The regime map's report: paired recall comparisons pooled over generator seeds, per cell, and phase maps.

    python studies/regimes/regimes.py results/cpu/regimes/runs --out results/cpu/regimes

A *cell* is one setting of the factors (decoys, echo_gap, recall_gap, budget) and, for rmm, the lag. Its
*arms* are h2o, rmm(correct), rmm(uniform), rmm(correct, freeze), the smoother (oracle future_utility,
weight correct) and future_mass, and where they ran (the echo family at lag 48's cells) the 2026 baselines
restkv and expected_attention at their defaults, and restkv as its authors' code computes it
(``restkv_official``: SmolLM2 with its KV heads repeated per query head). Every comparison is paired on the
recall code tokens of the same streams and pooled over the generator seeds: the interval resamples seeds,
then streams within each drawn seed, then blocks of one code within each drawn stream
(rmm/analysis/bootstrap.py, 95 % percentile). A comparison is reported only where both arms ran for every
seed of the cell.

Writes into ``--out``: ``runs.csv`` (one row per run), ``comparisons.csv`` and ``cells.md`` (per cell:
rmm(correct)/h2o, rmm(correct)/rmm(uniform), freeze/accumulate as recall-perplexity ratios with intervals
and win counts over seeds and streams, and each arm's share of the gap from h2o to the smoother), and
``figures/phase_echo.png`` (echo_gap x lag) and ``figures/phase_gap.png`` (recall_gap x budget): each
cell coloured by the paired log ratio, marked ``*`` where its interval excludes 0.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from rmm.analysis.bootstrap import N_RESAMPLES
from rmm.analysis.collect import collect, write_csv
from rmm.analysis.seeds import SEED_COLUMN, arm, percentile_interval, pooled_pairs, seed_replicates
from rmm.storage import atomic_write_text

log = logging.getLogger(__name__)

FACTORS = ["dataset.n_decoys", "dataset.echo_gap", "dataset.recall_gap", "budget"]
BASE = {"dataset.n_decoys": 4, "dataset.echo_gap": 32, "dataset.recall_gap": 192, "budget": 128, "lag": 48}
# (arm b, arm a, name): ratio b / a of recall perplexity; below 1 means b recalls better
COMPARISONS = [
    ("rmm_correct", "h2o", "rmm(correct) / h2o"),
    ("rmm_correct", "rmm_uniform", "rmm(correct) / rmm(uniform)"),
    ("rmm_freeze", "rmm_correct", "freeze / accumulate"),
    ("smoother", "h2o", "smoother / h2o"),
    ("restkv", "h2o", "restkv / h2o"),
    ("expected_attention", "h2o", "expected_attention / h2o"),
    ("rmm_correct", "restkv", "rmm(correct) / restkv"),
    ("rmm_correct", "expected_attention", "rmm(correct) / expected_attention"),
    ("restkv_official", "h2o", "restkv official / h2o"),
    ("restkv_official", "restkv", "restkv official / restkv"),
    ("rmm_correct", "restkv_official", "rmm(correct) / restkv official"),
]
SHARE_ARMS = [
    "rmm_correct",
    "rmm_uniform",
    "rmm_freeze",
    "future_mass",
    "restkv",
    "expected_attention",
    "restkv_official",
]
LAGGED = {"rmm_correct", "rmm_uniform", "rmm_freeze"}
PHASE_PANELS = [name for _, _, name in COMPARISONS[:3]]


def compare_cell(
    runs: dict[str, dict[int, str]], seeds: list[int], block: int, n_resamples: int = N_RESAMPLES
) -> list[dict]:
    """Every comparison and gap share whose arms ran for all ``seeds`` (runs: arm -> seed -> run_dir)."""
    complete = {name for name, by_seed in runs.items() if all(seed in by_seed for seed in seeds)}
    rows = []
    for b, a, name in COMPARISONS:
        if not {a, b} <= complete:
            continue
        tokens = pooled_pairs([(seed, runs[a][seed], runs[b][seed]) for seed in seeds])
        diff = (tokens["nll_b"] - tokens["nll_a"]).to_numpy()
        low, high = percentile_interval(seed_replicates(diff, tokens, block, n_resamples))
        per_seed = pd.Series(diff).groupby(tokens["seed"].to_numpy()).mean()
        per_doc = pd.Series(diff).groupby(tokens["doc"].to_numpy()).mean()
        rows.append(
            {
                "comparison": name,
                "log_ratio": float(diff.mean()),
                "ci_low": low,
                "ci_high": high,
                "ratio": float(np.exp(diff.mean())),
                "ratio_ci_low": float(np.exp(low)),
                "ratio_ci_high": float(np.exp(high)),
                "seeds_b_better": int((per_seed < 0).sum()),
                "n_seeds": len(seeds),
                "docs_b_better": int((per_doc < 0).sum()),
                "n_docs": int(per_doc.size),
                "n_tokens": int(diff.size),
            }
        )
    if {"h2o", "smoother"} <= complete:
        gap = pooled_pairs([(seed, runs["h2o"][seed], runs["smoother"][seed]) for seed in seeds])
        gap_diff = (gap["nll_a"] - gap["nll_b"]).to_numpy()  # h2o - smoother: what is achievable
        gap_reps = seed_replicates(gap_diff, gap, block, n_resamples)
        for name in [arm_name for arm_name in SHARE_ARMS if arm_name in complete]:
            tokens = pooled_pairs([(seed, runs["h2o"][seed], runs[name][seed]) for seed in seeds])
            assert tokens[["doc", "position"]].equals(gap[["doc", "position"]]), "unaligned recall tokens"
            gain = (tokens["nll_a"] - tokens["nll_b"]).to_numpy()  # h2o - arm
            shares = seed_replicates(gain, tokens, block, n_resamples) / gap_reps
            low, high = percentile_interval(shares)
            rows.append(
                {
                    "comparison": f"share of gap h2o -> smoother: {name}",
                    "share": float(gain.mean() / gap_diff.mean()),
                    "ci_low": low,
                    "ci_high": high,
                    "gap_nats": float(gap_diff.mean()),
                    "n_seeds": len(seeds),
                    "n_tokens": int(gain.size),
                }
            )
    return rows


def cell_runs(frame: pd.DataFrame) -> dict[tuple, dict[str, dict[int, str]]]:
    """(factors..., lag) -> arm -> seed -> run_dir. Arms without a lag (h2o, the oracles) join every lag
    of their factor cell."""
    frame = frame.assign(arm=frame.apply(arm, axis=1)).dropna(subset=["arm"])
    lags = frame[frame["arm"].isin(LAGGED)].groupby(FACTORS)["lag"].unique()
    cells: dict[tuple, dict[str, dict[int, str]]] = {}
    for _, row in frame.iterrows():
        key = tuple(row[f] for f in FACTORS)
        row_lags = [row["lag"]] if row["arm"] in LAGGED else list(lags.get(key, []))
        for lag in row_lags:
            cells.setdefault((*key, int(lag)), {}).setdefault(row["arm"], {})[int(row[SEED_COLUMN])] = row[
                "run_dir"
            ]
    return cells


def comparisons(frame: pd.DataFrame, n_resamples: int = N_RESAMPLES) -> pd.DataFrame:
    """One row per (cell, comparison); seeds are those present in the runs."""
    seeds = sorted(int(s) for s in frame[SEED_COLUMN].unique())
    block = int(frame["dataset.code_tokens"].iloc[0])
    rows = []
    for key, runs in sorted(cell_runs(frame).items()):
        cell = dict(zip([*FACTORS, "lag"], key, strict=True))
        rows += [{**cell, **row} for row in compare_cell(runs, seeds, block, n_resamples)]
    return pd.DataFrame(rows)


def cell_name(row: pd.Series) -> str:
    return (
        f"decoys {row['dataset.n_decoys']:g}, echo_gap {row['dataset.echo_gap']:g}, "
        f"recall_gap {row['dataset.recall_gap']:g}, B={row['budget']:g}, lag {row['lag']:g}"
    )


def cells_markdown(table: pd.DataFrame) -> str:
    """Per cell, one line per comparison: ratio [interval], wins over seeds and streams; gap shares."""
    lines = [
        "# Regime map: paired recall comparisons per cell, pooled over generator seeds",
        "",
        "Ratios are recall-code-token perplexity ratios b / a (below 1: b recalls better) with 95 %",
        "intervals resampling seeds, then streams, then code blocks; wins count seeds and streams where b",
        "is better.",
        "Shares are (NLL h2o - NLL arm) / (NLL h2o - NLL smoother) with the same resampling.",
        "`*` marks an interval that excludes 1 (ratios) or 0 (shares).",
        "",
    ]
    for _, rows in table.groupby([*FACTORS, "lag"], sort=True):
        lines += [f"## {cell_name(rows.iloc[0])}", ""]
        for _, row in rows.iterrows():
            mark = "*" if row["ci_low"] > 0 or row["ci_high"] < 0 else ""
            if "share" in row and pd.notna(row.get("share")):
                interval = f"[{row['ci_low']:.2f}, {row['ci_high']:.2f}]{mark}"
                lines.append(
                    f"- {row['comparison']}: {row['share']:.2f} {interval} (gap {row['gap_nats']:.2f} nats)"
                )
            else:
                interval = f"[{row['ratio_ci_low']:.2f}, {row['ratio_ci_high']:.2f}]{mark}"
                seeds = f"{int(row['seeds_b_better'])}/{int(row['n_seeds'])} seeds"
                wins = f"{seeds}, {int(row['docs_b_better'])}/{int(row['n_docs'])} streams"
                lines.append(f"- {row['comparison']}: {row['ratio']:.2f} {interval}, b better in {wins}")
        lines.append("")
    return "\n".join(lines)


def phase_map(table: pd.DataFrame, rows: str, columns: str, fixed: dict, out: Path, title: str) -> bool:
    """Heatmaps of the paired log ratio over (rows x columns) at ``fixed`` factors, one panel per
    comparison; False (nothing drawn) when no cell of the map is complete."""
    if table.empty:
        return False
    sub = table[table["comparison"].isin(PHASE_PANELS)]
    for name, value in fixed.items():
        sub = sub[sub[name] == value]
    if sub.empty:
        return False
    row_values = sorted(sub[rows].unique())
    column_values = sorted(sub[columns].unique())
    limit = max(float(sub["log_ratio"].abs().max()), 0.1)
    fig, axes = plt.subplots(1, len(PHASE_PANELS), figsize=(4.2 * len(PHASE_PANELS), 3.6), squeeze=False)
    for ax, panel in zip(axes[0], PHASE_PANELS, strict=True):
        grid = np.full((len(row_values), len(column_values)), np.nan)
        for _, row in sub[sub["comparison"] == panel].iterrows():
            i, j = row_values.index(row[rows]), column_values.index(row[columns])
            grid[i, j] = row["log_ratio"]
            mark = "*" if row["ci_low"] > 0 or row["ci_high"] < 0 else ""
            ax.text(j, i, f"{row['ratio']:.2f}{mark}", ha="center", va="center", fontsize=9)
        image = ax.imshow(grid, cmap="RdBu_r", vmin=-limit, vmax=limit, origin="lower", aspect="auto")
        ax.set_xticks(range(len(column_values)), [f"{v:g}" for v in column_values])
        ax.set_yticks(range(len(row_values)), [f"{v:g}" for v in row_values])
        ax.set_xlabel(columns.removeprefix("dataset."))
        ax.set_ylabel(rows.removeprefix("dataset."))
        ax.set_title(panel, fontsize=10)
    fig.colorbar(image, ax=axes[0].tolist(), label="paired log ratio of recall ppl (blue: b better)")
    fig.suptitle(title, fontsize=10)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", type=Path, help="the runs' root (results/cpu/regimes/runs)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--n-resamples", type=int, default=N_RESAMPLES)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    frame = collect([args.runs], intervals=False)
    if frame.empty:
        raise SystemExit(f"no complete run under {args.runs}; run `make regimes` first")
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(frame, args.out / "runs.csv")
    table = comparisons(frame, args.n_resamples)
    atomic_write_text(args.out / "comparisons.csv", table.to_csv(index=False))
    atomic_write_text(
        args.out / "cells.md", cells_markdown(table) if not table.empty else "no complete cell\n"
    )
    base = {k: v for k, v in BASE.items() if k not in ("dataset.echo_gap", "lag")}
    phase_map(table, "dataset.echo_gap", "lag", base, args.out / "figures/phase_echo.png", "echo_gap x lag")
    base = {k: v for k, v in BASE.items() if k not in ("dataset.recall_gap", "budget")}
    phase_map(
        table, "dataset.recall_gap", "budget", base, args.out / "figures/phase_gap.png", "recall_gap x B"
    )
    print(f"{len(frame)} runs, {len(table)} comparisons -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
