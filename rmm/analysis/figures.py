"""Figures from collected runs, each saved as PNG and PDF.

    python -m rmm.analysis.figures results/cpu/runs.csv --out results/cpu/figures [--budget 256]

Every figure function takes the collected frame (see ``collect.py``) and an output folder, returns the
matplotlib Figure, or prints a note and returns None when the runs it needs are absent. Figures are drawn
for one (model, dataset, device, dtype) setting: the most common one unless chosen with
:func:`select_setting`. Perplexities are averaged over seeds.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib import colors as mcolors
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullLocator

from rmm.analysis.collect import load_runs, with_labels
from rmm.analysis.compare import DEFAULT_BASELINE, compare_runs, compare_sweep
from rmm.analysis.policy_table import WEIGHT_COLORS, policy_color, policy_sort_key
from rmm.storage import read_tokens
from rmm.tracking import position_perplexity

FIGURE_SETTINGS = ("model", "dataset", "device", "dtype")  # one value of each per figure
COMMIT_STYLES = {"accumulate": "-", "freeze": "--"}


def _note(name: str, reason: str) -> None:
    print(f"[figures] skipping {name}: {reason}")


def select_setting(frame: pd.DataFrame, **fixed: Any) -> pd.DataFrame:
    """Keep one value of each setting column (model, dataset, device, dtype).

    The value is ``fixed[column]`` when given, else the most common one. Prints a note when runs of other
    settings are dropped.
    """
    kept = frame
    for column in FIGURE_SETTINGS:
        if column not in kept.columns or kept.empty:
            continue
        value = fixed.get(column)
        if value is None:
            counts = kept[column].value_counts(dropna=False)
            value = sorted(counts.index[counts == counts.max()], key=str)[0]
        kept = kept[kept[column].isna()] if pd.isna(value) else kept[kept[column] == value]
    if len(kept) < len(frame):
        chosen = ", ".join(f"{c}={kept[c].iloc[0]}" for c in FIGURE_SETTINGS if c in kept and not kept.empty)
        print(f"[figures] using {len(kept)} of {len(frame)} runs ({chosen})")
    return kept


def _matches(frame: pd.DataFrame, column: str, value: Any) -> pd.Series:
    """Rows whose ``column`` equals ``value`` (all rows when the column is absent or value is None)."""
    if value is None or column not in frame.columns:
        return pd.Series(True, index=frame.index)
    return frame[column] == value


def _rmm_default(frame: pd.DataFrame, weight: str | None, after_commit: str | None) -> pd.DataFrame:
    """Drop rmm runs other than the given weight / after_commit; other policies pass through."""
    is_rmm = frame["policy"] == "rmm"
    keep = _matches(frame, "policy.weight", weight) & _matches(frame, "policy.after_commit", after_commit)
    return frame[~is_rmm | keep]


def _shades(color: str, count: int) -> list[tuple[float, float, float]]:
    """``count`` variants of ``color`` from darker to lighter."""
    rgb = np.array(mcolors.to_rgb(color))
    if count == 1:
        return [tuple(rgb)]
    shades = []
    for t in np.linspace(-0.45, 0.45, count):
        target = np.zeros(3) if t < 0 else np.ones(3)
        shades.append(tuple(rgb + abs(t) * (target - rgb)))
    return shades


def _natural_key(label: str) -> list[Any]:
    """Sort key comparing the numbers inside a label numerically: ``lag=8`` < ``lag=16`` < ``lag=128``."""
    parts = re.split(r"(\d+(?:\.\d+)?)", label)  # text, number, text, ...
    return [(0, float(part), "") if i % 2 else (1, 0.0, part) for i, part in enumerate(parts)]


def _label_colors(labelled: pd.DataFrame) -> dict[str, Any]:
    """A color per label: the policy's color, shaded when the policy has several labels."""
    result: dict[str, Any] = {}
    for policy, group in labelled.groupby("policy"):
        labels = sorted(group["label"].unique(), key=_natural_key)
        base = policy_color(str(policy))
        result.update(zip(labels, _shades(base, len(labels)), strict=True))
    return result


def _ordered_labels(labelled: pd.DataFrame) -> list[str]:
    policy_of = labelled.groupby("label")["policy"].first()
    return sorted(
        policy_of.index, key=lambda label: (policy_sort_key(str(policy_of[label])), _natural_key(label))
    )


def _log2_xaxis(ax: Axes, values: Any) -> None:
    """Log-2 x scale with a tick at each value."""
    ticks = sorted({float(v) for v in values})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())


def _setting_title(frame: pd.DataFrame) -> str:
    parts = [str(frame[c].iloc[0]) for c in ("model", "dataset") if c in frame.columns and not frame.empty]
    return " / ".join(parts)


def _new_figure(ncols: int = 1, width: float = 6.4) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(width * ncols, 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def _save(fig: Figure, out_dir: str | Path, name: str) -> Figure:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / f"{name}.png", dpi=150)
    fig.savefig(out_dir / f"{name}.pdf", metadata={"CreationDate": None})
    return fig


def _full_ppl(frame: pd.DataFrame) -> float | None:
    full = frame.loc[frame["policy"] == "full", "ppl"]
    return None if full.empty else float(full.mean())


def _by_budget(labelled: pd.DataFrame, value: str) -> pd.DataFrame:
    """Mean of ``value`` over seeds per (label, budget), sorted by budget."""
    return labelled.groupby(["label", "budget"], as_index=False)[value].mean().sort_values("budget")


def _intervals(runs: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Per ``keys`` group: ``ppl_ci_low`` / ``ppl_ci_high`` of its run, NaN for a group of several runs
    (intervals of single runs do not average over seeds) or without the columns."""
    columns = ["ppl_ci_low", "ppl_ci_high"]
    if not set(columns) <= set(runs.columns):
        return runs[keys].drop_duplicates().assign(ppl_ci_low=np.nan, ppl_ci_high=np.nan)
    grouped = runs.groupby(keys, as_index=False, dropna=False)
    bounds = grouped[columns].first().merge(grouped.size(), on=keys)
    bounds.loc[bounds["size"] != 1, columns] = np.nan
    return bounds.drop(columns="size")


def _band(ax: Axes, x: Any, low: Any, high: Any, color: Any) -> None:
    """A translucent band between ``low`` and ``high`` (gaps where they are NaN)."""
    x, low, high = (np.asarray(v, float) for v in (x, low, high))
    ax.fill_between(x, low, high, color=color, alpha=0.18, lw=0)


def _error_bars(ax: Axes, x: Any, low: Any, high: Any, color: Any, slot: int, slots: int) -> None:
    """Vertical bars from ``low`` to ``high``, dodged sideways by ``slot`` of ``slots`` on a log-2 x axis."""
    x, low, high = (np.asarray(v, float) for v in (x, low, high))
    keep = np.isfinite(low) & np.isfinite(high)
    dodge = 2.0 ** (0.035 * (slot - (slots - 1) / 2))
    ax.vlines(x[keep] * dodge, low[keep], high[keep], color=color, lw=1.2, alpha=0.8)


def _lines_by_budget(
    ax: Axes, points: pd.DataFrame, order: list[str], colors: dict[str, Any], value: str, low: str, high: str
) -> None:
    """One line per label of ``points`` (in ``order``) of ``value`` over the budget, with its ``low`` to
    ``high`` interval as bars dodged side by side."""
    for slot, label in enumerate(order):
        line = points[points["label"] == label].sort_values("budget")
        ax.plot(line["budget"], line[value], marker="o", color=colors[label], label=label)
        _error_bars(ax, line["budget"], line[low], line[high], colors[label], slot, len(order))


def _paired_ppl_bounds(base_runs: pd.Series, runs: pd.Series) -> tuple[float, float]:
    """Interval of the perplexity of the run in ``runs`` measured against the run in ``base_runs``:
    ppl_base x the paired ppl-ratio bounds of ``rmm/analysis/compare.py`` (NaN unless one run on each
    side)."""
    if len(base_runs) != 1 or len(runs) != 1:
        return (np.nan, np.nan)
    result = compare_runs(base_runs.iloc[0], runs.iloc[0])
    return (result["ppl_a"] * result["ppl_ratio_ci_low"], result["ppl_a"] * result["ppl_ratio_ci_high"])


def _legend(fig: Figure, ax: Axes, handles: list[Any] | None = None, labels: list[str] | None = None) -> None:
    """The legend below the axes, outside them, so that it never covers data; the figure grows to hold it."""
    if handles is None or labels is None:
        handles, labels = ax.get_legend_handles_labels()
    ncols = 2 if max((len(label) for label in labels), default=0) > 28 else 3
    rows = -(-len(labels) // ncols)
    fig.set_figheight(fig.get_figheight() + 0.17 * rows)
    fig.legend(handles, labels, loc="outside lower center", ncols=ncols, fontsize=7, frameon=False)


PER_RUN_NOTE = "bars: 95 % bootstrap interval of each run (ppl_ci_low/high)"


def _budget_lines(frame: pd.DataFrame, rmm_weight: str | None, rmm_after_commit: str | None) -> pd.DataFrame:
    """Labelled runs of the evicting policies, rmm restricted to one weight / after_commit."""
    evicting = frame[frame["policy"] != "full"]
    return with_labels(_rmm_default(evicting, rmm_weight, rmm_after_commit))


def _rmm_note(labelled: pd.DataFrame, rmm_weight: str | None, rmm_after_commit: str | None) -> str:
    """Second title line saying which rmm runs are drawn (empty without rmm runs)."""
    if not (labelled["policy"] == "rmm").any():
        return ""
    return f"\nrmm: weight={rmm_weight or 'all'}, after_commit={rmm_after_commit or 'all'}, one line per lag"


def ppl_vs_budget(
    frame: pd.DataFrame,
    out_dir: str | Path,
    rmm_weight: str | None = "correct",
    rmm_after_commit: str | None = "accumulate",
) -> Figure | None:
    """Perplexity vs budget, one line per policy configuration (rmm: one line per lag at the given weight and
    after_commit); full as a horizontal reference."""
    name = "ppl_vs_budget"
    frame = select_setting(frame)
    labelled = _budget_lines(frame, rmm_weight, rmm_after_commit) if not frame.empty else frame
    if labelled.empty:
        _note(name, "no runs of an evicting policy")
        return None
    fig, (ax,) = _new_figure()
    colors = _label_colors(labelled)
    points = _by_budget(labelled, "ppl").merge(
        _intervals(labelled, ["label", "budget"]), on=["label", "budget"]
    )
    _lines_by_budget(ax, points, _ordered_labels(labelled), colors, "ppl", "ppl_ci_low", "ppl_ci_high")
    full = _full_ppl(frame)
    if full is not None:
        ax.axhline(full, color="black", linestyle="--", linewidth=1, label="full (no eviction)")
    _log2_xaxis(ax, labelled["budget"])
    ax.set_xlabel("KV budget B (entries per head)")
    ax.set_ylabel("perplexity")
    ax.set_yscale("log")
    ax.set_title(
        f"Perplexity vs budget — {_setting_title(frame)}{_rmm_note(labelled, rmm_weight, rmm_after_commit)}"
        f"\n{PER_RUN_NOTE}",
        fontsize=10,
    )
    _legend(fig, ax)
    return _save(fig, out_dir, name)


def ratio_vs_budget(
    frame: pd.DataFrame,
    out_dir: str | Path,
    baseline: str = DEFAULT_BASELINE,
    rmm_weight: str | None = "correct",
    rmm_after_commit: str | None = "accumulate",
) -> Figure | None:
    """Each run's perplexity over its baseline's at the same budget, paired per token, with the 95 %
    interval of :func:`rmm.analysis.compare.compare_sweep` (documents, then blocks); one line per
    policy configuration (rmm as in :func:`ppl_vs_budget`). Below 1: better than the baseline."""
    name = "ratio_vs_budget"
    frame = select_setting(frame)
    labelled = _budget_lines(frame, rmm_weight, rmm_after_commit) if not frame.empty else frame
    comparisons = compare_sweep(labelled, baseline) if not labelled.empty else pd.DataFrame()
    if comparisons.empty:
        _note(name, f"no run with a baseline {baseline}")
        return None
    fig, (ax,) = _new_figure()
    colors = _label_colors(labelled)
    order = [label for label in _ordered_labels(labelled) if label in set(comparisons["label"])]
    _lines_by_budget(ax, comparisons, order, colors, "ppl_ratio", "ppl_ratio_ci_low", "ppl_ratio_ci_high")
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label=f"baseline ({baseline})")
    _log2_xaxis(ax, comparisons["budget"])
    ax.set_xlabel("KV budget B (entries per head)")
    ax.set_ylabel("perplexity / baseline's (paired per token)")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda y, _: f"{y:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_title(
        f"Perplexity ratio to {baseline} — {_setting_title(frame)}"
        f"{_rmm_note(labelled, rmm_weight, rmm_after_commit)}\nbars: 95 % paired bootstrap interval",
        fontsize=10,
    )
    _legend(fig, ax)
    return _save(fig, out_dir, name)


def _lag_budget(rmm: pd.DataFrame, budget: float | None) -> float | None:
    """The given budget, else the budget with the most rmm configurations (lags x weights x
    after_commit; the largest such budget on ties)."""
    if budget is not None:
        return budget if (rmm["budget"] == budget).any() else None
    keys = [c for c in ("lag", "policy.weight", "policy.after_commit") if c in rmm.columns]
    configs = rmm.groupby("budget")[keys].apply(lambda group: len(group.drop_duplicates()))
    return float(configs[configs == configs.max()].index.max())


def _lag_points(
    frame: pd.DataFrame, rmm: pd.DataFrame, keys: list[str], chosen: float
) -> tuple[pd.DataFrame, str]:
    """Mean perplexity per (line keys, lag) of ``rmm`` at budget ``chosen`` with 95 % bounds (paired against
    h2o's tokens when one h2o run shares the budget), sorted by lag; and the note naming the bounds."""
    points = rmm.groupby(keys, as_index=False, dropna=False)["ppl"].mean()
    h2o_runs = frame.loc[(frame["policy"] == "h2o") & (frame["budget"] == chosen)]
    if len(h2o_runs) == 1 and "run_dir" in frame.columns:  # paired against h2o: the reading that matters
        run_dirs = rmm.groupby(keys, dropna=False)["run_dir"]
        bounds = [_paired_ppl_bounds(h2o_runs["run_dir"], runs) for _, runs in run_dirs]
        paired = (
            run_dirs.size()
            .reset_index()[keys]
            .assign(ppl_ci_low=[b[0] for b in bounds], ppl_ci_high=[b[1] for b in bounds])
        )
        points, note = points.merge(paired, on=keys), "bands: 95 % interval paired against h2o's tokens"
    else:
        points, note = points.merge(_intervals(rmm, keys), on=keys), "bands: 95 % interval of each run"
    return points.sort_values("lag"), note


def _plot_lag_lines(ax: Axes, points: pd.DataFrame, line_keys: list[str], show_commit: bool) -> None:
    """One line with its band per (weight, after_commit) of ``points``, perplexity vs lag."""
    groups = points.groupby(line_keys, dropna=False) if line_keys else [((), points)]
    for key, line in groups:
        values = dict(zip(line_keys, key if isinstance(key, tuple) else (key,), strict=True))
        weight = values.get("policy.weight")
        commit = values.get("policy.after_commit")
        label = f"rmm weight={weight}" + (f", {commit}" if show_commit else "")
        color = WEIGHT_COLORS.get(str(weight), policy_color("rmm"))
        ax.plot(
            line["lag"],
            line["ppl"],
            marker="o",
            label=label,
            color=color,
            linestyle=COMMIT_STYLES.get(str(commit), "-"),
        )
        _band(ax, line["lag"], line["ppl_ci_low"], line["ppl_ci_high"], color)


def _lag_references(ax: Axes, frame: pd.DataFrame, chosen: float) -> None:
    """Horizontal lines at the mean perplexity of each h2o and oracle configuration at budget ``chosen``."""
    references = with_labels(frame[frame["policy"].isin(["h2o", "oracle"]) & (frame["budget"] == chosen)])
    styles = {"h2o": ":", "oracle": "-."}
    if not references.empty:
        colors = _label_colors(references)
        for label, ppl in references.groupby("label")["ppl"].mean().items():
            policy = references.loc[references["label"] == label, "policy"].iloc[0]
            ax.axhline(ppl, color=colors[label], linestyle=styles[policy], linewidth=1.2, label=label)


def ppl_vs_lag(frame: pd.DataFrame, out_dir: str | Path, budget: float | None = None) -> Figure | None:
    """rmm perplexity vs lag, one line per weight (dashed: after_commit=freeze) at one budget, with h2o and
    oracle at that budget as horizontal references."""
    name = "ppl_vs_lag"
    frame = select_setting(frame)
    rmm = frame[frame["policy"] == "rmm"] if not frame.empty else frame
    if rmm.empty:
        _note(name, "no rmm runs")
        return None
    chosen = _lag_budget(rmm, budget)
    if chosen is None:
        _note(name, f"no rmm runs at budget {budget}")
        return None
    rmm = rmm[rmm["budget"] == chosen]
    line_keys = [c for c in ("policy.weight", "policy.after_commit") if c in rmm.columns]
    fig, (ax,) = _new_figure()
    points, note = _lag_points(frame, rmm, [*line_keys, "lag"], chosen)
    show_commit = "policy.after_commit" in rmm.columns and rmm["policy.after_commit"].nunique() > 1
    _plot_lag_lines(ax, points, line_keys, show_commit)
    _lag_references(ax, frame, chosen)
    _log2_xaxis(ax, rmm["lag"])
    ax.set_xlabel("lag H (provisional buffer, tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(
        f"rmm perplexity vs lag at B={chosen:g} — {_setting_title(frame)}\n{note} (compare.py)", fontsize=10
    )
    _legend(fig, ax)
    return _save(fig, out_dir, name)


def _position_budget(evicting: pd.DataFrame, budget: float | None) -> float | None:
    """The given budget, else the budget run by the most policies (the smallest among ties)."""
    if budget is not None:
        return budget if (evicting["budget"] == budget).any() else None
    coverage = evicting.groupby("budget")["policy"].nunique()
    return float(coverage[coverage == coverage.max()].index.min())


def _pooled_tokens(run_dirs: list[str]) -> pd.DataFrame | None:
    """Concatenated token tables of ``run_dirs`` (unreadable ones skipped with a note)."""
    frames = []
    for run_dir in run_dirs:
        try:
            frames.append(read_tokens(run_dir)[["position", "nll"]])
        except (OSError, ValueError) as error:
            print(f"[figures] cannot read tokens of {run_dir}: {error}")
    return pd.concat(frames, ignore_index=True) if frames else None


def _cumulative_curves(
    frame: pd.DataFrame, at_budget: pd.DataFrame, bins: int
) -> dict[str, tuple[str, pd.DataFrame, pd.DataFrame]]:
    """label -> (policy, binned cumulative perplexity, its runs) for full and each policy's best
    configuration in ``at_budget`` (by mean perplexity); labels without readable tokens left out."""
    best = at_budget.groupby(["policy", "label"], as_index=False)["ppl"].mean()
    best = best.loc[best.groupby("policy")["ppl"].idxmin()]
    full_runs = frame.loc[frame["policy"] == "full", "run_dir"].tolist()
    selections = [("full", "full", full_runs)] if full_runs else []
    for row in best.itertuples(index=False):
        runs = at_budget.loc[at_budget["label"] == row.label, "run_dir"].tolist()
        selections.append((str(row.policy), str(row.label), runs))
    curves: dict[str, tuple[str, pd.DataFrame, pd.DataFrame]] = {}
    for policy, label, runs in selections:
        tokens = _pooled_tokens(runs)
        if tokens is not None:
            curves[label] = (
                policy,
                position_perplexity(tokens, bins=bins),
                frame[frame["run_dir"].isin(runs)],
            )
    return curves


def _plot_cumulative(ax: Axes, curves: dict[str, tuple[str, pd.DataFrame, pd.DataFrame]]) -> None:
    """One line per curve (dashed: full), in policy order, each ending in a bar of its runs' 95 % interval."""
    ordered = sorted(curves, key=lambda lab: (policy_sort_key(curves[lab][0]), lab))
    for i, label in enumerate(ordered):
        policy, curve, runs = curves[label]
        color = policy_color(policy)
        ax.plot(
            curve["position_bin_end"],
            curve["cum_ppl"],
            color=color,
            linestyle="--" if policy == "full" else "-",
            label=label,
        )
        bounds = _intervals(runs, ["policy"])
        if len(bounds) == 1 and bounds["ppl_ci_low"].notna().all():  # the last point is the run's ppl
            end = float(curve["position_bin_end"].iloc[-1]) * (1.0 + 0.012 * (i + 1))  # staggered
            ax.vlines(end, bounds["ppl_ci_low"].iloc[0], bounds["ppl_ci_high"].iloc[0], color=color, lw=1.5)


def cumulative_ppl(
    frame: pd.DataFrame, out_dir: str | Path, budget: float | None = None, bins: int = 64
) -> Figure | None:
    """Cumulative perplexity vs stream position at one budget: one line per policy (its best configuration
    at that budget, by mean perplexity) and full, from the runs' token files."""
    name = "cumulative_ppl"
    frame = select_setting(frame)
    if frame.empty or "run_dir" not in frame.columns:
        _note(name, "no runs with a run_dir")
        return None
    evicting = frame[frame["policy"] != "full"]
    chosen = _position_budget(evicting, budget) if not evicting.empty else None
    if chosen is None:
        _note(name, "no runs of an evicting policy" + (f" at budget {budget}" if budget is not None else ""))
        return None
    curves = _cumulative_curves(frame, with_labels(evicting[evicting["budget"] == chosen]), bins)
    if not curves:
        _note(name, "no readable token files")
        return None
    fig, (ax,) = _new_figure()
    _plot_cumulative(ax, curves)
    ax.set_xlabel("position in stream (tokens)")
    ax.set_ylabel("cumulative perplexity")
    ax.set_yscale("log")
    ax.set_title(
        f"Cumulative perplexity at B={chosen:g} — {_setting_title(frame)}\n"
        "each policy's best configuration: its lowest ppl on these tokens\n"
        "bars: 95 % interval of each run's ppl",
        fontsize=10,
    )
    _legend(fig, ax)
    return _save(fig, out_dir, name)


def throughput_memory(
    frame: pd.DataFrame,
    out_dir: str | Path,
    rmm_weight: str | None = "correct",
    rmm_after_commit: str | None = "accumulate",
) -> Figure | None:
    """Two panels vs budget: tokens/s and peak memory (MiB), per policy configuration; full as reference."""
    name = "throughput_memory"
    frame = select_setting(frame)
    labelled = _budget_lines(frame, rmm_weight, rmm_after_commit) if not frame.empty else frame
    if labelled.empty:
        _note(name, "no runs of an evicting policy")
        return None
    fig, axes = _new_figure(ncols=2, width=5.2)
    colors = _label_colors(labelled)
    full = frame[frame["policy"] == "full"]
    panels = [("tokens_per_s", 1.0, "tokens / s"), ("peak_memory_bytes", 2.0**20, "peak memory (MiB)")]
    for ax, (column, scale, ylabel) in zip(axes, panels, strict=True):
        if column not in labelled.columns or labelled[column].isna().all():
            ax.text(0.5, 0.5, f"{column} not recorded", ha="center", va="center", transform=ax.transAxes)
            continue
        points = _by_budget(labelled, column)
        for label in _ordered_labels(labelled):
            line = points[points["label"] == label]
            ax.plot(line["budget"], line[column] / scale, marker="o", color=colors[label], label=label)
        if column in full.columns and full[column].notna().any():
            ax.axhline(
                full[column].mean() / scale,
                color="black",
                linestyle="--",
                linewidth=1,
                label="full (no eviction)",
            )
        _log2_xaxis(ax, labelled["budget"])
        ax.set_xlabel("KV budget B (entries per head)")
        ax.set_ylabel(ylabel)
    _legend(fig, axes[0])
    fig.suptitle(
        f"Throughput and memory — {_setting_title(frame)}{_rmm_note(labelled, rmm_weight, rmm_after_commit)}",
        fontsize=10,
    )
    return _save(fig, out_dir, name)


def _gaps_to_h2o(rmm: pd.DataFrame, h2o: pd.DataFrame) -> pd.DataFrame:
    """Per (lag, budget): rmm's mean perplexity minus the best h2o configuration's at that budget, with
    95 % bounds paired against that h2o's tokens (columns gap, gap_low, gap_high); shared budgets only."""
    h2o_means = _by_budget(h2o, "ppl")
    h2o_best = h2o_means.loc[h2o_means.groupby("budget")["ppl"].idxmin()].set_index("budget")
    gaps = rmm.groupby(["lag", "budget"])["ppl"].mean().reset_index()
    gaps["gap"] = gaps["ppl"] - gaps["budget"].map(h2o_best["ppl"])
    gaps = gaps.dropna(subset=["gap"])
    if gaps.empty:
        return gaps
    bounds = []
    for lag, budget in zip(gaps["lag"], gaps["budget"], strict=True):
        base = h2o.loc[(h2o["budget"] == budget) & (h2o["label"] == h2o_best.at[budget, "label"])]
        runs = rmm.loc[(rmm["budget"] == budget) & (rmm["lag"] == lag)]
        low, high = _paired_ppl_bounds(
            base.get("run_dir", base.iloc[0:0]), runs.get("run_dir", runs.iloc[0:0])
        )
        bounds.append((low - base["ppl"].mean(), high - base["ppl"].mean()))
    gaps[["gap_low", "gap_high"]] = bounds
    return gaps


def _twin_correct_frac(ax: Axes, rmm: pd.DataFrame, budgets: pd.Series) -> tuple[list[Any], list[str]]:
    """Legend handles and labels of ``ax``, plus those of rmm's correct_frac (mean over lags, at
    ``budgets``) drawn on a twin axis when recorded."""
    handles, labels = ax.get_legend_handles_labels()
    if "correct_frac" in rmm.columns and rmm["correct_frac"].notna().any():
        twin = ax.twinx()
        frac = rmm[rmm["budget"].isin(budgets)].groupby("budget")["correct_frac"].mean()
        twin.plot(
            frac.index,
            frac.to_numpy(),
            color="tab:gray",
            linestyle=":",
            marker="s",
            label="correct_frac (rmm, mean over lags)",
        )
        twin.set_ylabel("correct_frac")
        more_handles, more_labels = twin.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    return handles, labels


def measure_vs_accumulate(
    frame: pd.DataFrame,
    out_dir: str | Path,
    rmm_weight: str | None = "correct",
    rmm_after_commit: str | None = "accumulate",
) -> Figure | None:
    """rmm minus h2o perplexity vs budget, one line per lag (h2o: its best configuration at each budget),
    with rmm's correct_frac (mean over lags) on a twin axis."""
    name = "measure_vs_accumulate"
    frame = select_setting(frame)
    if frame.empty:
        _note(name, "no runs")
        return None
    rmm = _rmm_default(frame[frame["policy"] == "rmm"], rmm_weight, rmm_after_commit)
    h2o = with_labels(frame[frame["policy"] == "h2o"])
    if rmm.empty or h2o.empty:
        _note(name, "needs both rmm and h2o runs")
        return None
    gaps = _gaps_to_h2o(rmm, h2o)
    if gaps.empty:
        _note(name, "rmm and h2o share no budget")
        return None
    fig, (ax,) = _new_figure()
    lags = sorted(gaps["lag"].unique())
    for lag, color in zip(lags, _shades(policy_color("rmm"), len(lags)), strict=True):
        line = gaps[gaps["lag"] == lag].sort_values("budget")
        ax.plot(line["budget"], line["gap"], marker="o", color=color, label=f"rmm − h2o, lag={lag:g}")
        _band(ax, line["budget"], line["gap_low"], line["gap_high"], color)
    ax.axhline(0.0, color="black", linewidth=0.8)
    _log2_xaxis(ax, gaps["budget"])
    ax.set_xlabel("KV budget B (entries per head)")
    ax.set_ylabel("perplexity difference (rmm − h2o; < 0: rmm better)")
    _legend(fig, ax, *_twin_correct_frac(ax, rmm, gaps["budget"]))
    ax.set_title(
        f"Measure vs accumulate: rmm − best h2o — {_setting_title(frame)}"
        f"{_rmm_note(rmm, rmm_weight, rmm_after_commit)}\n"
        "bands: 95 % interval paired against h2o's tokens (compare.py)",
        fontsize=10,
    )
    return _save(fig, out_dir, name)


def make_all(
    frame: pd.DataFrame, out_dir: str | Path, budget: float | None = None
) -> dict[str, Figure | None]:
    """Draw every figure into ``out_dir``; ``budget`` fixes the budget of ppl_vs_lag and cumulative_ppl."""
    return {
        "ppl_vs_budget": ppl_vs_budget(frame, out_dir),
        "ratio_vs_budget": ratio_vs_budget(frame, out_dir),
        "ppl_vs_lag": ppl_vs_lag(frame, out_dir, budget=budget),
        "cumulative_ppl": cumulative_ppl(frame, out_dir, budget=budget),
        "throughput_memory": throughput_memory(frame, out_dir),
        "measure_vs_accumulate": measure_vs_accumulate(frame, out_dir),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("csv", type=Path, help="runs CSV written by rmm/analysis/collect.py")
    parser.add_argument("--out", type=Path, required=True, help="folder for the PNG and PDF files")
    parser.add_argument(
        "--budget", type=float, help="budget of ppl_vs_lag and cumulative_ppl (default: auto)"
    )
    parser.add_argument("--model", help="model to plot (default: the most common)")
    parser.add_argument("--dataset", help="dataset to plot (default: the most common)")
    args = parser.parse_args(argv)
    frame = select_setting(load_runs(args.csv), model=args.model, dataset=args.dataset)
    drawn = [name for name, fig in make_all(frame, args.out, budget=args.budget).items() if fig is not None]
    print(f"wrote {len(drawn)} figures to {args.out}: {', '.join(drawn) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
