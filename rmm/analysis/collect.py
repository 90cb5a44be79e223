"""Collect complete run directories into one table (one row per run), and the main perplexity table.

python -m rmm.analysis.collect runs multirun --out results/cpu/runs.csv --table results/cpu/main_table.md
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from rmm.analysis.bootstrap import BLOCK, N_RESAMPLES, nll_interval
from rmm.analysis.policy_table import policy_label, policy_sort_key
from rmm.files import atomic_write_text
from rmm.storage import CONFIG_FILE, METRICS_FILE, TOKENS_FILE, read_metrics, read_tokens, run_is_complete

log = logging.getLogger(__name__)

RUN_FILES = (CONFIG_FILE, METRICS_FILE, TOKENS_FILE)
SKIP_DIRS = ("wandb",)  # W&B keeps its own config.yaml files; hidden dirs (.hydra) are skipped too
# What one run's setting is: two runs of one policy that agree on these (and on ``policy.*``) are the same
# configuration; a paired comparison (rmm/analysis/compare.py) pairs runs that agree on them.
SETTING_COLUMNS = [
    "model",
    "dataset",
    "policy",
    "budget",
    "lag",
    "chunk",
    "positions",
    "scope",
    "allocation",
    "layers",
    "seed",
    "dtype",
]
ID_COLUMNS = ["run_name", *SETTING_COLUMNS]
SORT_COLUMNS = [*SETTING_COLUMNS, "run_dir"]
# Columns that tell apart configurations of one policy within a model/dataset besides ``policy.*``.
VARIANT_COLUMNS = ["chunk", "positions", "scope", "allocation", "layers"]
PARAM_EXCLUDE = ("policy.name", "policy.tag")


def flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested mappings into dot-separated keys (``{"a": {"b": 1}}`` -> ``{"a.b": 1}``)."""
    flat: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _candidate_dirs(root: Path) -> Iterator[tuple[Path, bool]]:
    """Yield (directory, complete) for every directory under ``root`` holding any run file.

    Does not descend into complete runs, hidden directories or W&B directories.
    """
    for current, dirs, files in os.walk(root):
        path = Path(current)
        if any(name in files for name in RUN_FILES):
            complete = run_is_complete(path)
            yield path, complete
            if complete:
                dirs.clear()
                continue
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)


def collect(
    paths: Iterable[str | Path], intervals: bool = True, block: int = BLOCK, n_resamples: int = N_RESAMPLES
) -> pd.DataFrame:
    """One row per complete run found under ``paths``: every metric (nested dicts flattened) and ``run_dir``.

    Incomplete directories are skipped and reported in one warning. Rows are sorted by the swept
    parameters and then ``run_dir`` (an absolute path). With ``intervals``, ``ppl_ci_low`` and
    ``ppl_ci_high`` follow ``ppl`` (see :func:`with_ppl_intervals`).
    """
    rows: dict[Path, dict[str, Any]] = {}
    incomplete: set[Path] = set()
    for root in paths:
        root = Path(root).resolve()
        if not root.exists():
            log.warning("results root %s does not exist", root)
            continue
        for path, complete in _candidate_dirs(root):
            if complete:
                rows[path] = {**flatten(read_metrics(path)), "run_dir": str(path)}
            else:
                incomplete.add(path)
    if incomplete:
        shown = ", ".join(str(p) for p in sorted(incomplete)[:5])
        log.warning(
            "ignored %d incomplete run directories: %s%s",
            len(incomplete),
            shown,
            " ..." if len(incomplete) > 5 else "",
        )
    frame = pd.DataFrame(list(rows.values()))
    if frame.empty:
        return pd.DataFrame(columns=["run_dir"])
    if "allocation" in frame.columns:  # runs written before the allocation axis kept B' per head
        frame["allocation"] = frame["allocation"].fillna("uniform")
    if "layers" in frame.columns:  # runs written before the layers axis decided in every layer
        frame["layers"] = frame["layers"].fillna("all")
    params = sorted(c for c in frame.columns if c.startswith("policy."))
    leading = [c for c in ID_COLUMNS if c in frame.columns] + params
    rest = [c for c in frame.columns if c not in leading and c != "run_dir"]
    frame = frame[[*leading, *rest, "run_dir"]]
    keys = [c for c in SORT_COLUMNS if c in frame.columns]
    frame = frame.sort_values(keys, kind="stable", na_position="last").reset_index(drop=True)
    return with_ppl_intervals(frame, block=block, n_resamples=n_resamples) if intervals else frame


def with_ppl_intervals(
    frame: pd.DataFrame, block: int = BLOCK, n_resamples: int = N_RESAMPLES
) -> pd.DataFrame:
    """Add ``ppl_ci_low`` / ``ppl_ci_high`` after ``ppl``: the 95 % interval of each run's perplexity.

    exp of :func:`rmm.analysis.bootstrap.nll_interval` over the run's token file (documents and
    ``block``-token
    blocks within them resampled, seed 0): the same code as ``rmm/analysis/compare.py``.
    """
    bounds = []
    for run_dir in frame["run_dir"]:
        interval = nll_interval(read_tokens(run_dir), block=block, n_resamples=n_resamples)
        bounds.append((math.exp(interval.low), math.exp(interval.high)))
    low, high = zip(*bounds, strict=True) if bounds else ((), ())
    frame = frame.drop(columns=["ppl_ci_low", "ppl_ci_high"], errors="ignore")
    at = frame.columns.get_loc("ppl") + 1 if "ppl" in frame.columns else len(frame.columns) - 1
    frame.insert(at, "ppl_ci_low", list(low))
    frame.insert(at + 1, "ppl_ci_high", list(high))
    return frame


def write_csv(frame: pd.DataFrame, out: str | Path) -> None:
    """Write the collected runs atomically, with ``run_dir`` relative to the CSV's folder."""
    out = Path(out).resolve()
    rel = frame.assign(run_dir=[os.path.relpath(p, out.parent) for p in frame["run_dir"]])
    atomic_write_text(out, rel.to_csv(index=False))


def load_runs(csv: str | Path) -> pd.DataFrame:
    """Read a CSV written by :func:`write_csv`, turning ``run_dir`` back into absolute paths."""
    csv = Path(csv).resolve()
    frame = pd.read_csv(csv)
    if "run_dir" in frame.columns:
        frame["run_dir"] = [str((csv.parent / p).resolve()) for p in frame["run_dir"]]
    return frame


def _format_value(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def with_labels(frame: pd.DataFrame) -> pd.DataFrame:
    """Add ``label``: the policy name plus the parameters that vary among that policy's runs.

    E.g. ``rmm (lag=16, weight=prob)``; a policy run in a single configuration is labelled by its name.
    """
    frame = frame.copy()
    frame["label"] = frame["policy"].astype(str).map(policy_label)
    candidates = [c for c in frame.columns if c.startswith("policy.") and c not in PARAM_EXCLUDE]
    candidates += [c for c in VARIANT_COLUMNS if c in frame.columns]
    for policy, group in frame.groupby("policy", sort=False):
        varying = [c for c in candidates if group[c].nunique(dropna=True) > 1]
        if not varying:
            continue
        parts = group[varying].apply(
            lambda row, keys=varying: ", ".join(
                f"{k.removeprefix('policy.')}={_format_value(row[k])}" for k in keys if pd.notna(row[k])
            ),
            axis=1,
        )
        frame.loc[group.index, "label"] = policy_label(str(policy)) + " (" + parts + ")"
    return frame


def _markdown(table: pd.DataFrame) -> str:
    header = "| " + " | ".join(str(c) for c in table.columns) + " |"
    rule = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(table.columns))) + "|"
    body = ["| " + " | ".join(str(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join([header, rule, *body])


def main_table(frame: pd.DataFrame, digits: int = 2, intervals: bool = False) -> str:
    """Markdown table of perplexity (mean over seeds): policy configurations (rows) x budgets (columns).

    ``full`` does not depend on the budget: its own first row repeats its perplexity in every column.
    One table per (model, dataset), each under a heading when there are several. With ``intervals`` a
    cell of one run reads ``ppl [ppl_ci_low, ppl_ci_high]`` (a cell averaging several seeds shows the mean).
    """
    if frame.empty or "ppl" not in frame.columns:
        return "_no runs_\n"
    settings = [c for c in ("model", "dataset") if c in frame.columns]
    groups = frame.groupby(settings, sort=True) if settings else [((), frame)]
    sections = []
    for key, group in groups:
        labelled = with_labels(group)
        evicting = labelled[labelled["policy"] != "full"]
        budgets = sorted(evicting["budget"].dropna().unique()) if not evicting.empty else []
        columns = [f"B={_format_value(b)}" for b in budgets]
        rows = []
        full = labelled[labelled["policy"] == "full"]
        if not full.empty:
            rows.append(["full"] + [_ppl_cell(full, digits, intervals)] * max(len(budgets), 1))
        policy_of = evicting.groupby("label")["policy"].first()
        for label in sorted(
            policy_of.index, key=lambda lab: (policy_sort_key(policy_of[lab]), natural_key(lab))
        ):
            runs = evicting[evicting["label"] == label]
            rows.append([label] + [_ppl_cell(runs[runs["budget"] == b], digits, intervals) for b in budgets])
        table = pd.DataFrame(rows, columns=["policy", *(columns or ["ppl"])])
        heading = " / ".join(str(k) for k in (key if isinstance(key, tuple) else (key,)))
        sections.append((f"### {heading}\n\n" if len(groups) > 1 else "") + _markdown(table))
    return "\n\n".join(sections) + "\n"


def _ppl_cell(runs: pd.DataFrame, digits: int, intervals: bool) -> str:
    """Mean perplexity of ``runs`` ("–" if none); with ``intervals`` and a single run, its interval too."""
    if runs.empty:
        return "–"
    cell = f"{runs['ppl'].mean():.{digits}f}"
    if intervals and len(runs) == 1 and {"ppl_ci_low", "ppl_ci_high"} <= set(runs.columns):
        cell += f" [{runs['ppl_ci_low'].iloc[0]:.{digits}f}, {runs['ppl_ci_high'].iloc[0]:.{digits}f}]"
    return cell


def natural_key(label: str) -> list:
    """Sort key that orders the numbers inside a label by value (lag=8 before lag=16)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", label)]


def summary(frame: pd.DataFrame) -> str:
    """A few lines describing a collected frame."""
    if frame.empty:
        return "no complete runs"
    lines = [f"{len(frame)} complete runs"]
    for column in ("model", "dataset", "policy", "budget"):
        if column in frame.columns:
            values = sorted(frame[column].dropna().unique(), key=lambda v: (isinstance(v, str), v))
            lines.append(f"  {column}: {', '.join(_format_value(v) for v in values)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "roots", nargs="+", type=Path, help="folders searched recursively for run directories"
    )
    parser.add_argument("--out", type=Path, help="CSV to write (one row per complete run)")
    parser.add_argument("--table", type=Path, help="markdown file for the main perplexity table")
    parser.add_argument(
        "--intervals", action="store_true", help="show each run's 95 %% interval in the table: ppl [lo, hi]"
    )
    parser.add_argument(
        "--block", type=int, default=BLOCK, help=f"bootstrap block length of the intervals, tokens ({BLOCK})"
    )
    parser.add_argument(
        "--n-resamples", type=int, default=N_RESAMPLES, help=f"bootstrap resamples ({N_RESAMPLES})"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    frame = collect(args.roots, block=args.block, n_resamples=args.n_resamples)
    print(summary(frame))
    if frame.empty:
        return 1
    if args.out:
        write_csv(frame, args.out)
        print(f"wrote {args.out}")
    if args.table:
        atomic_write_text(args.table, main_table(frame, intervals=args.intervals))
        print(f"wrote {args.table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
