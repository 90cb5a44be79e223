"""The regime map's ratio rows under a per-seed t-interval: how many the bootstrap resolves stay resolved.

    python studies/regimes/regimes_t.py results/cpu/regimes/runs --out results/cpu/regimes/t_intervals.md

For every ratio row of ``comparisons.csv`` (``studies/regimes/regimes.py``: cell x comparison b / a, pooled
over the generator seeds 1, 2, 3), the per-seed paired log-ratio of recall perplexity (each seed's recall
code tokens, its streams pooled: mean NLL_b - NLL_a) and their mean with a 95 % t-interval on
n_seeds - 1 = 2 degrees of freedom (``rmm.analysis.seeds.t_summary``, the analysis the confirmatory
study registered). A row is *resolved* by the bootstrap where the nested bootstrap interval of
``comparisons.csv`` excludes 1, by the t-interval where that excludes 1. Prints the counts and writes the
table; ``comparisons.csv`` and ``cells.md`` are not changed.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from rmm.analysis.collect import collect
from rmm.analysis.seeds import SEED_COLUMN, pooled_pairs, t_summary
from rmm.storage import atomic_write_text
from studies.regimes.regimes import COMPARISONS, FACTORS, cell_name, cell_runs

CELL = [*FACTORS, "lag"]


def seed_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Per (cell, ratio comparison) with both arms for every seed: per-seed ratios and the t-interval."""
    seeds = sorted(int(s) for s in frame[SEED_COLUMN].unique())
    rows = []
    for key, runs in sorted(cell_runs(frame).items()):
        for b, a, name in COMPARISONS:
            if not all(seed in runs.get(x, {}) for x in (a, b) for seed in seeds):
                continue
            tokens = pooled_pairs([(seed, runs[a][seed], runs[b][seed]) for seed in seeds])
            per_seed = (tokens["nll_b"] - tokens["nll_a"]).groupby(tokens["seed"]).mean()
            summary = t_summary(per_seed.to_numpy())
            rows.append(
                {
                    **dict(zip(CELL, key, strict=True)),
                    "comparison": name,
                    "seed_ratios": ", ".join(f"{np.exp(v):.2f}" for v in per_seed.to_numpy()),
                    "t_ratio": summary["ratio"],
                    "t_low": summary["ratio_low95"],
                    "t_high": summary["ratio_high95"],
                    "n_seeds": len(seeds),
                }
            )
    return pd.DataFrame(rows)


def joined(comparisons: pd.DataFrame, t_rows: pd.DataFrame) -> pd.DataFrame:
    """The ratio rows of ``comparisons.csv`` with their t-intervals and both resolutions."""
    ratios = comparisons[comparisons["ratio"].notna()]
    table = ratios.merge(t_rows, on=[*CELL, "comparison"], how="left", validate="one_to_one")
    if table["t_low"].isna().any():
        raise ValueError("a ratio row of comparisons.csv has no per-seed runs")
    table["boot_resolved"] = (table["ratio_ci_low"] > 1) | (table["ratio_ci_high"] < 1)
    table["t_resolved"] = (table["t_low"] > 1) | (table["t_high"] < 1)
    return table


def markdown(table: pd.DataFrame, command: str) -> str:
    boot = int(table["boot_resolved"].sum())
    lost = int((table["boot_resolved"] & ~table["t_resolved"]).sum())
    gained = int((~table["boot_resolved"] & table["t_resolved"]).sum())
    lines = [
        "# Regime map: per-seed t-intervals beside the nested bootstrap",
        "",
        f"Written by `{command}` from `results/cpu/regimes/comparisons.csv` and the runs. Per ratio row: the "
        "per-seed recall-perplexity ratios b / a (seeds 1, 2, 3; each seed's recall code tokens pooled), "
        "their geometric mean with a 95 % t-interval on 2 degrees of freedom, and the nested bootstrap "
        "interval of `comparisons.csv`. `*`: the interval excludes 1.",
        "",
        f"**{len(table)} ratio rows; {boot} resolved by the bootstrap, of which {lost} are unresolved by "
        f"the t-interval; {gained} unresolved by the bootstrap are resolved by the t-interval.**",
        "",
        "| cell | comparison | ratio | bootstrap 95 % | t 95 % (2 df) | per-seed ratios |",
        "|---|---|---:|---|---|---|",
    ]
    for _, row in table.iterrows():
        boot_mark = "*" if row["boot_resolved"] else ""
        t_mark = "*" if row["t_resolved"] else ""
        lines.append(
            f"| {cell_name(row)} | {row['comparison']} | {row['ratio']:.2f} "
            f"| [{row['ratio_ci_low']:.2f}, {row['ratio_ci_high']:.2f}]{boot_mark} "
            f"| [{row['t_low']:.2f}, {row['t_high']:.2f}]{t_mark} | {row['seed_ratios']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", type=Path, help="the runs' root (results/cpu/regimes/runs)")
    parser.add_argument(
        "--comparisons", type=Path, default=None, help="default: comparisons.csv beside the runs' root"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    comparisons = pd.read_csv(args.comparisons or args.runs.parent / "comparisons.csv")
    table = joined(comparisons, seed_rows(collect([args.runs], intervals=False)))
    command = f"python studies/regimes/regimes_t.py {args.runs} --out {args.out}"
    atomic_write_text(args.out, markdown(table, command))
    boot = int(table["boot_resolved"].sum())
    lost = int((table["boot_resolved"] & ~table["t_resolved"]).sum())
    print(
        f"{len(table)} ratio rows, {boot} resolved by the bootstrap, "
        f"{lost} of them unresolved by the t-interval"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
