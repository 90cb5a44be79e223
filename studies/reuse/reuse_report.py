"""The controlled-reuse study's report: collected runs, recall table, paired comparisons, figures, estimator.

    python studies/reuse/reuse_report.py results/cpu/reuse/runs --out results/cpu/reuse

Writes into ``--out``: ``runs.csv`` (one row per run, with per-run intervals of recall NLL and accuracy),
``recall_table.md`` (recall NLL and accuracy per setting, budget and policy), ``comparison.md`` (paired
per-token comparisons on the recall code tokens: every run against h2o at the same budget, rmm's weights
against the uniform weight and against the correct weight, freeze against accumulate), ``estimator.md``
(the estimator diagnostic here and on natural text, from ``--natural``), and ``figures/`` (recall NLL
against lag, against the decoy fraction).

Intervals over recall tokens resample documents as clusters and, within each, blocks of ``code_tokens``
tokens (one code); every interval is a 95 % percentile interval (rmm/analysis/bootstrap.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from rmm.analysis.bootstrap import doc_sizes, mean_interval, scored_tokens
from rmm.analysis.collect import collect, load_runs, natural_key, with_labels, write_csv
from rmm.analysis.compare import compare_sweep, comparison_table
from rmm.analysis.policy_table import WEIGHT_COLORS, policy_color, policy_sort_key
from rmm.storage import atomic_write_text, read_tokens

log = logging.getLogger(__name__)

SETTING = ["dataset.n_records", "dataset.n_decoys", "dataset.echo_gap", "dataset.recall_gap"]
MAIN = {"dataset.n_decoys": 4, "dataset.recall_gap": 192}  # the setting of reuse_cpu_refs, _rmm, _lags
REFERENCES = ("full", "window", "h2o", "oracle")  # horizontal lines in the recall figures


def recall_intervals(frame: pd.DataFrame) -> pd.DataFrame:
    """Add ``nll_recall_ci_low/high`` and ``acc_recall_ci_low/high`` per run (recall code tokens)."""
    frame = frame.copy()
    for column in ("nll_recall_ci_low", "nll_recall_ci_high", "acc_recall_ci_low", "acc_recall_ci_high"):
        frame[column] = np.nan
    for index, row in frame.iterrows():
        tokens = scored_tokens(read_tokens(row["run_dir"]), "recall")
        block = int(row["dataset.code_tokens"])
        sizes = doc_sizes(tokens)
        nll = mean_interval(tokens["nll"].to_numpy(np.float64), sizes, block=block)
        acc = mean_interval(tokens["correct"].to_numpy(np.float64), sizes, block=block)
        frame.loc[index, ["nll_recall_ci_low", "nll_recall_ci_high"]] = [nll.low, nll.high]
        frame.loc[index, ["acc_recall_ci_low", "acc_recall_ci_high"]] = [acc.low, acc.high]
    return frame


def decoy_fraction(frame: pd.DataFrame) -> pd.Series:
    return frame["dataset.n_decoys"] / (frame["dataset.n_decoys"] + frame["dataset.n_records"])


def _setting_name(row: pd.Series) -> str:
    return (
        f"{row['dataset.n_records']:g} records + {row['dataset.n_decoys']:g} decoys "
        f"(decoy fraction {row['decoy_fraction']:.2f}), echo_gap {row['dataset.echo_gap']:g}, "
        f"recall_gap {row['dataset.recall_gap']:g}"
    )


def _short_setting(row: pd.Series) -> str:
    """``reuse: 4 records + 4 decoys, recall_gap 192`` (one heading per setting in comparison.md)."""
    return (
        f"{row['dataset']}: {row['dataset.n_records']:g} records + {row['dataset.n_decoys']:g} decoys, "
        f"recall_gap {row['dataset.recall_gap']:g}"
    )


def recall_table(frame: pd.DataFrame) -> str:
    """Markdown: per setting, one row per (budget, policy configuration)."""
    frame = with_labels(frame).assign(decoy_fraction=decoy_fraction(frame))
    lines = [
        "Recall of the true records' codes (segment `recall`): mean NLL and accuracy over every code token "
        "[95 % interval: documents and one-code blocks resampled], and over the first code token of each "
        "recall (it cannot be copied from the cue) and the others; filler perplexity for context. "
        "Written by `studies/reuse/reuse_report.py`.",
        "",
    ]
    for _, group in frame.groupby(SETTING, sort=True):
        lines += [
            f"### {_setting_name(group.iloc[0])}",
            "",
            "| B | policy | recall NLL [CI] | recall acc [CI] | first NLL | first acc | rest acc "
            "| ppl filler |",
            "|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        order = sorted(
            group.index,
            key=lambda i: (
                -1 if group.at[i, "policy"] == "full" else group.at[i, "budget"],
                policy_sort_key(group.at[i, "policy"]),
                natural_key(group.at[i, "label"]),
            ),
        )
        for i in order:
            row = group.loc[i]
            budget = "–" if row["policy"] == "full" else f"{row['budget']:g}"
            lines.append(
                f"| {budget} | {row['label']} | {row['nll_recall']:.3f} [{row['nll_recall_ci_low']:.3f}, "
                f"{row['nll_recall_ci_high']:.3f}] | {row['acc_recall']:.3f} "
                f"[{row['acc_recall_ci_low']:.3f}, "
                f"{row['acc_recall_ci_high']:.3f}] | {row['nll_recall_first']:.3f} | "
                f"{row['acc_recall_first']:.3f} | {row['acc_recall_rest']:.3f} | {row['ppl_filler']:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def comparisons(frame: pd.DataFrame, block: int) -> pd.DataFrame:
    """Paired comparisons on the recall tokens: against h2o, rmm weights against uniform (accumulate) and
    against correct (same after_commit), freeze against accumulate (each only where the baseline run
    exists)."""
    options = {"segment": "recall", "block": block}
    frame = frame.assign(dataset=[_short_setting(row) for _, row in frame.iterrows()])
    parts = [compare_sweep(frame, "policy=h2o", **options)]
    rmm = frame[frame["policy"] == "rmm"]
    if not rmm.empty:
        parts.append(compare_sweep(rmm, "policy.weight=uniform,policy.after_commit=accumulate", **options))
        parts.append(compare_sweep(rmm, "policy.weight=correct", **options))
        parts.append(compare_sweep(rmm, "policy.after_commit=accumulate", **options))
    return pd.concat([p for p in parts if not p.empty], ignore_index=True)


def _errorbar(ax: plt.Axes, x: Any, rows: pd.DataFrame, **style: Any) -> None:
    low = rows["nll_recall"] - rows["nll_recall_ci_low"]
    high = rows["nll_recall_ci_high"] - rows["nll_recall"]
    ax.errorbar(x, rows["nll_recall"], yerr=[low, high], capsize=3, marker="o", **style)


# the oracle's variants as the reference lines name and dash them
ORACLE_LINES = {
    "next_use": ("oracle (Belady)", "--"),
    "future_mass": ("oracle (future mass)", "-."),
    "future_utility": ("smoother", (0, (1, 1))),
}


def _reference_lines(ax: plt.Axes, group: pd.DataFrame, budget: float) -> None:
    """A horizontal line (and its interval) for each reference run at ``budget`` (full: at any): one per
    oracle variant run there, each named."""
    for policy in REFERENCES:
        color = policy_color(policy)
        runs = group[(group["policy"] == policy) & ((group["budget"] == budget) | (policy == "full"))]
        if policy != "oracle":
            runs = runs.iloc[:1]
        for _, row in runs.iterrows():
            variant = row.get("policy.variant")  # absent or empty: the oracle's default, next_use
            label, dash = (
                ORACLE_LINES[variant if isinstance(variant, str) else "next_use"]
                if policy == "oracle"
                else (policy, "--")
            )
            ax.axhline(row["nll_recall"], color=color, linestyle=dash, linewidth=1, label=label)
            ax.axhspan(row["nll_recall_ci_low"], row["nll_recall_ci_high"], color=color, alpha=0.08)


def recall_vs_lag(frame: pd.DataFrame, out: Path) -> Path | None:
    """Recall NLL against rmm's lag, one line per weight (accumulate solid, freeze dashed), one panel per
    budget, with h2o, each oracle variant run at that budget, full and window as horizontal references
    (main setting)."""
    group = _main(frame)
    rmm = group[group["policy"] == "rmm"]
    if rmm.empty:
        return None
    budgets = sorted(rmm["budget"].unique())
    fig, axes = plt.subplots(1, len(budgets), figsize=(5.2 * len(budgets), 4.2), squeeze=False, sharey=True)
    for ax, budget in zip(axes[0], budgets, strict=True):
        _reference_lines(ax, group, budget)
        at_budget = rmm[rmm["budget"] == budget]
        for (weight, after), lines in at_budget.groupby(["policy.weight", "policy.after_commit"]):
            lines = lines.sort_values("lag")
            style = {"color": WEIGHT_COLORS.get(weight), "linestyle": "-" if after == "accumulate" else ":"}
            _errorbar(ax, lines["lag"], lines, label=f"rmm {weight}, {after}", **style)
        ax.set_title(f"B={budget:g}")
        ax.set_xlabel("lag H (tokens); grey line: echo_gap")
        ax.axvline(group["dataset.echo_gap"].iloc[0], color="0.6", linewidth=0.8)  # echo_gap
    axes[0][0].set_ylabel("recall NLL (nats per code token)")
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, bbox_to_anchor=(0.5, -0.02), frameon=False)
    fig.suptitle(f"{_setting_name(group.assign(decoy_fraction=decoy_fraction(group)).iloc[0])}", fontsize=9)
    fig.tight_layout(rect=(0, 0.2, 1, 1))  # the legend's three rows below the panels
    return _save(fig, out, "recall_vs_lag")


def recall_vs_decoys(frame: pd.DataFrame, out: Path) -> Path | None:
    """Recall NLL against the decoy fraction at B=128 (recall_gap of the main setting): h2o against rmm."""
    frame = frame.assign(decoy_fraction=decoy_fraction(frame))
    group = frame[(frame["dataset.recall_gap"] == MAIN["dataset.recall_gap"]) & (frame["budget"] == 128)]
    full = frame[(frame["policy"] == "full") & (frame["dataset.recall_gap"] == MAIN["dataset.recall_gap"])]
    group = pd.concat([group, full])
    group = with_labels(group.drop_duplicates("run_dir"))
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    drawn = 0
    for label, lines in group.groupby("label", sort=False):
        if lines["decoy_fraction"].nunique() < 2:
            continue
        lines = lines.sort_values("decoy_fraction")
        policy = lines["policy"].iloc[0]
        weight = lines.get("policy.weight", pd.Series([""])).iloc[0]
        color = policy_color(policy) if policy in REFERENCES else WEIGHT_COLORS.get(weight)
        style = {
            "linestyle": ":" if lines.get("policy.after_commit", pd.Series([""])).iloc[0] == "freeze" else "-"
        }
        _errorbar(ax, lines["decoy_fraction"], lines, color=color, label=label, **style)
        drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("decoy fraction (decoys / (records + decoys))")
    ax.set_ylabel("recall NLL (nats per code token)")
    ax.set_title(f"B=128, recall_gap {MAIN['dataset.recall_gap']}", fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8)
    fig.tight_layout()
    return _save(fig, out, "recall_vs_decoys")


def _main(frame: pd.DataFrame) -> pd.DataFrame:
    mask = pd.Series(True, index=frame.index)
    for key, value in MAIN.items():
        mask &= frame[key] == value
    return frame[mask]


def _save(fig: plt.Figure, out: Path, name: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for suffix in ("png", "pdf"):
        fig.savefig(out / f"{name}.{suffix}", dpi=150, bbox_inches="tight", metadata={"CreationDate": None})
    plt.close(fig)
    return out / f"{name}.png"


def _spearman_by_config(frame: pd.DataFrame) -> dict[str, float]:
    """``{"h2o": r, "rmm H=48 correct accumulate": r, ...}`` over runs with an estimator value."""
    out = {}
    for _, row in frame[frame["estimator_spearman"].notna()].iterrows():
        key = row["policy"]
        if key == "rmm":
            key = f"rmm H={row['lag']:g} {row['policy.weight']} {row['policy.after_commit']}"
        out[key] = float(row["estimator_spearman"])
    return out


def estimator_table(frame: pd.DataFrame, natural: pd.DataFrame | None) -> str:
    """Spearman(policy score at commit, oracle's future attention mass) at B=128, here and on natural text."""
    lines = [
        "Estimator diagnostic: Spearman correlation between a policy's score of a position when it commits "
        "(leaves the protected window) and the attention mass the oracle's reference pass gives it later, "
        "pooled over layers, heads and commits, at B=128. Written by `studies/reuse/reuse_report.py`.",
        "",
        "| policy | controlled reuse (main setting) | natural text (Shakespeare) |",
        "|---|---:|---:|",
    ]
    here = _main(frame)
    here = _spearman_by_config(here[here["budget"] == 128])
    there = _spearman_by_config(natural[natural["budget"] == 128]) if natural is not None else {}
    for key in sorted(set(here) | set(there), key=lambda k: (policy_sort_key(k.split()[0]), natural_key(k))):
        a = f"{here[key]:.3f}" if key in here else "–"
        b = f"{there[key]:.3f}" if key in there else "–"
        lines.append(f"| {key} | {a} | {b} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("roots", nargs="+", type=Path, help="folders searched for run directories")
    parser.add_argument("--out", type=Path, required=True, help="folder for the tables, CSV and figures")
    parser.add_argument(
        "--natural",
        type=Path,
        default=Path("results/cpu/estimator/runs.csv"),
        help="natural-text estimator runs",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    frame = collect(args.roots)
    if frame.empty or "nll_recall" not in frame.columns:
        print("no complete run of a labelled (dataset=reuse) study found")
        return 1
    frame = recall_intervals(frame)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(frame, args.out / "runs.csv")
    atomic_write_text(args.out / "recall_table.md", recall_table(frame))
    block = int(frame["dataset.code_tokens"].iloc[0])
    atomic_write_text(args.out / "comparison.md", comparison_table(comparisons(frame, block)))
    natural = load_runs(args.natural) if args.natural.is_file() else None
    atomic_write_text(args.out / "estimator.md", estimator_table(frame, natural))
    for figure in (recall_vs_lag, recall_vs_decoys):
        path = figure(frame, args.out / "figures")
        print(f"wrote {path}" if path else f"{figure.__name__}: no data")
    print(f"wrote {len(frame)} runs, recall_table.md, comparison.md, estimator.md to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
