"""Paired comparisons of runs that score the same tokens: NLL difference, perplexity ratio, 95 % interval.

    python -m rmm.analysis.compare RUN_A RUN_B [RUN_C ...]            # each later run against RUN_A
    python -m rmm.analysis.compare results/cpu/runs.csv               # every run against h2o, same settings
    python -m rmm.analysis.compare results/cpu/runs.csv --baseline policy.weight=uniform --json
    python -m rmm.analysis.compare results/cpu/runs.csv --baseline policy=h2o \\
        --baseline policy.after_commit=accumulate --table results/cpu/comparison.md

For runs A (the baseline) and B, ``delta_nll`` is the mean over the paired tokens of NLL_B - NLL_A
(< 0: B predicts better), ``ppl_ratio`` = exp(delta_nll) = ppl_B / ppl_A, and the interval comes from
the bootstrap of ``rmm/analysis/bootstrap.py``: documents resampled as clusters, ``--block``-token blocks
within
each drawn document. ``docs_b_better`` / ``docs_a_better`` count documents by the sign of their own mean
difference. Runs whose token sequences differ (doc_id, position, token_id, scored or not) are refused.

A sweep (a runs CSV written by ``collect.py``, or a folder of run directories) is compared against a
baseline given as ``KEY=VALUE[,KEY=VALUE]`` over the collected columns: each run is paired with the one
run that has these values and equals it in every other setting (model, dataset, budget, lag, chunk,
positions, scope, seed, dtype and policy parameters). Naming ``policy`` frees the policy's parameters
(and ``lag``); a setting the baseline does not have (null, or the budget of ``full``) is free too.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from rmm.analysis.bootstrap import (
    BLOCK,
    CONFIDENCE,
    N_RESAMPLES,
    SEED,
    TokenMismatchError,
    compare_tokens,
)
from rmm.analysis.collect import PARAM_EXCLUDE, SETTING_COLUMNS, collect, load_runs, natural_key, with_labels
from rmm.analysis.policy_table import policy_sort_key
from rmm.storage import atomic_write_text, read_metrics, read_tokens, run_is_complete

log = logging.getLogger(__name__)

DEFAULT_BASELINE = "policy=h2o"


def _run_name(run_dir: Path) -> str:
    return str(read_metrics(run_dir).get("run_name", run_dir.name))


def compare_runs(run_a: str | Path, run_b: str | Path, **options: Any) -> dict[str, Any]:
    """:func:`compare_tokens` of two run directories, plus their names and paths (``run_a``, ``run_b``).

    ``options``: segment, block, n_resamples, confidence, seed.
    """
    run_a, run_b = Path(run_a), Path(run_b)
    for run in (run_a, run_b):
        if not run_is_complete(run):
            raise ValueError(
                f"{run} is not a complete run directory (config.yaml, token_nll.parquet, metrics.json)"
            )
    try:
        result = compare_tokens(read_tokens(run_a), read_tokens(run_b), **options)
    except TokenMismatchError as error:
        raise TokenMismatchError(f"{run_a} vs {run_b}: {error}") from None
    return {"a": _run_name(run_a), "b": _run_name(run_b), "run_a": str(run_a), "run_b": str(run_b), **result}


def parse_baseline(spec: str) -> dict[str, Any]:
    """``"policy=h2o,policy.rho=0.5"`` -> ``{"policy": "h2o", "policy.rho": 0.5}`` (values read as YAML)."""
    baseline: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ValueError(f"baseline {spec!r}: expected KEY=VALUE[,KEY=VALUE], e.g. policy=h2o")
        baseline[key.strip()] = yaml.safe_load(value.strip())
    if not baseline:
        raise ValueError("empty baseline: give KEY=VALUE, e.g. policy=h2o")
    return baseline


def _equal(column: pd.Series, value: Any) -> pd.Series:
    """Element-wise ``column == value`` where NaN equals NaN."""
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return column.isna()
    return (column == value).fillna(False).astype(bool)


def baseline_pairs(frame: pd.DataFrame, baseline: Mapping[str, Any]) -> list[tuple[int, int]]:
    """(baseline row, compared row) index pairs of a collected frame (see the module docstring).

    Rows without a baseline are left out; a row with several candidate baselines raises a ValueError
    that names the columns to pin.
    """
    missing = [key for key in baseline if key not in frame.columns]
    if missing:
        raise ValueError(f"baseline columns {missing} are not in the runs (columns: {sorted(frame.columns)})")
    params = [c for c in frame.columns if c.startswith("policy.") and c not in PARAM_EXCLUDE]
    free = set(baseline) | (set(params) | {"lag"} if "policy" in baseline else set())
    dataset_params = [c for c in frame.columns if c.startswith("dataset.")]  # e.g. a generator's settings
    match = [c for c in [*SETTING_COLUMNS, *params, *dataset_params] if c in frame.columns and c not in free]
    is_base = pd.Series(True, index=frame.index)
    for key, value in baseline.items():
        is_base &= _equal(frame[key], value)
    bases = frame[is_base]
    pairs = []
    for index, row in frame[~is_base].iterrows():
        candidates = bases
        for column in match:
            free_here = candidates[column].isna()
            if column == "budget" and "policy" in candidates.columns:
                free_here |= candidates["policy"] == "full"  # full keeps everything, whatever its budget says
            candidates = candidates[_equal(candidates[column], row[column]) | free_here]
        if len(candidates) > 1:
            varying = [c for c in match + sorted(free) if candidates[c].nunique(dropna=False) > 1]
            raise ValueError(
                f"baseline {dict(baseline)} is ambiguous for {row.get('run_name', index)}: {len(candidates)} "
                f"runs match, differing in {varying}; pin one in the baseline, e.g. "
                f"{varying[0] if varying else 'KEY'}={candidates[varying[0]].iloc[0] if varying else 'VALUE'}"
            )
        if len(candidates) == 1:
            pairs.append((candidates.index[0], index))
    return pairs


def compare_sweep(
    frame: pd.DataFrame, baseline: Mapping[str, Any] | str = DEFAULT_BASELINE, **options: Any
) -> pd.DataFrame:
    """One row per (run, its baseline) of a collected frame: :func:`compare_runs`' fields plus the
    setting columns, ``label`` / ``baseline_label`` (as in the main table) and ``baseline`` (the spec).

    ``options``: segment, block, n_resamples, confidence, seed. Sorted like the main table, by budget first.
    """
    if isinstance(baseline, str):
        baseline = parse_baseline(baseline)
    labelled = with_labels(frame.reset_index(drop=True))
    cache: dict[str, pd.DataFrame] = {}

    def tokens(run_dir: str) -> pd.DataFrame:
        if run_dir not in cache:
            cache[run_dir] = read_tokens(run_dir)
        return cache[run_dir]

    spec = ",".join(f"{k}={v}" for k, v in baseline.items())
    rows = []
    for base, other in baseline_pairs(labelled, baseline):
        a, b = labelled.loc[base], labelled.loc[other]
        try:
            result = compare_tokens(tokens(a["run_dir"]), tokens(b["run_dir"]), **options)
        except TokenMismatchError as error:
            raise TokenMismatchError(f"{a['run_dir']} vs {b['run_dir']}: {error}") from None
        settings = {c: b[c] for c in SETTING_COLUMNS if c in labelled.columns}
        rows.append({**settings, **_pair_fields(a, b, spec), **result})
    result_frame = pd.DataFrame(rows)
    if result_frame.empty:
        log.warning("no run has a baseline %s", spec)
        return result_frame
    return _sorted_like_table(result_frame)


def _pair_fields(a: pd.Series, b: pd.Series, spec: str) -> dict[str, Any]:
    """The labels, names and directories of baseline run ``a`` and compared run ``b`` under ``spec``."""
    return {
        "label": b["label"],
        "baseline_label": a["label"],
        "baseline": spec,
        "a": a.get("run_name", a["run_dir"]),
        "b": b.get("run_name", b["run_dir"]),
        "run_a": a["run_dir"],
        "run_b": b["run_dir"],
    }


def _sorted_like_table(comparisons: pd.DataFrame) -> pd.DataFrame:
    """``comparisons`` in the main table's order: model, dataset, budget (none last), policy, label."""
    order = sorted(
        comparisons.index,
        key=lambda i: (
            *(str(comparisons.at[i, c]) for c in ("model", "dataset") if c in comparisons.columns),
            comparisons.at[i, "budget"] if pd.notna(comparisons.at[i, "budget"]) else np.inf,
            policy_sort_key(str(comparisons.at[i, "policy"])),
            natural_key(str(comparisons.at[i, "label"])),
        ),
    )
    return comparisons.loc[order].reset_index(drop=True)


def _signed(value: float, digits: int) -> str:
    return f"{value:+.{digits}f}".replace("-", "−")


def comparison_table(comparisons: pd.DataFrame) -> str:
    """Markdown: one table per baseline spec (and model/dataset), one row per compared run."""
    if comparisons.empty:
        return "_no comparisons_\n"
    first = comparisons.iloc[0]
    pct = f"{100 * first['confidence']:g} %"
    lines = [
        f"Paired per-token comparisons of each run (B) against its baseline (A) over the same tokens. "
        f"Δ NLL = mean of NLL_B − NLL_A (< 0: B better); ppl ratio = ppl_B / ppl_A = exp(Δ NLL); "
        f"[{pct} interval] from a bootstrap over documents and {first['block']}-token blocks within "
        f"them ({first['n_resamples']} resamples, seed {first['seed']}); docs: documents where B has the "
        f"lower mean NLL, of all. Written by `rmm/analysis/compare.py`.",
        "",
    ]
    groups = [c for c in ("baseline", "model", "dataset") if c in comparisons.columns]
    for key, group in comparisons.groupby(groups, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        lines.append(f"### baseline `{key[0]}`" + (f" ({' / '.join(map(str, key[1:]))})" if key[1:] else ""))
        if group["segment"].notna().any():
            lines.append(f"\nsegment: {group['segment'].iloc[0]}")
        lines += [
            "",
            "| B | run | baseline | ppl | ppl baseline | ppl ratio [CI] | Δ NLL [CI] | docs |",
            "|---:|---|---|---:|---:|---:|---:|---:|",
        ]
        for row in group.itertuples(index=False):
            budget = "–" if pd.isna(row.budget) else f"{row.budget:g}"
            lines.append(
                f"| {budget} | {row.label} | {row.baseline_label} | {row.ppl_b:.2f} | {row.ppl_a:.2f} | "
                f"{row.ppl_ratio:.4f} [{row.ppl_ratio_ci_low:.4f}, {row.ppl_ratio_ci_high:.4f}] | "
                f"{_signed(row.delta_nll, 4)} [{_signed(row.ci_low, 4)}, {_signed(row.ci_high, 4)}] | "
                f"{row.docs_b_better}/{row.n_docs} |"
            )
        lines.append("")
    return "\n".join(lines)


def compare_pairs(run_dirs: Sequence[str | Path], **options: Any) -> pd.DataFrame:
    """Each run directory after the first against the first: one row of :func:`compare_runs` per run,
    labelled by directory name (``options`` as there)."""
    first, *others = map(Path, run_dirs)
    rows = []
    for other in others:
        result = compare_runs(first, other, **options)
        labels = {"label": other.name, "baseline_label": first.name, "baseline": f"run {first.name}"}
        rows.append({"budget": read_metrics(other).get("budget"), **labels, **result})
    return pd.DataFrame(rows)


def _load_sweep(path: Path) -> pd.DataFrame:
    if path.is_file():
        return load_runs(path)
    frame = collect([path], intervals=False)
    if frame.empty:
        raise ValueError(f"no complete run under {path}")
    return frame


def _json_ready(record: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in record.items():
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, float) and np.isnan(value):
            value = None
        out[key] = value
    return out


def _parser() -> argparse.ArgumentParser:
    """The command line of ``python -m rmm.analysis.compare``."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "inputs",
        nargs="+",
        type=Path,
        help="two or more run directories (each compared with the first), or one runs CSV / folder of runs",
    )
    parser.add_argument(
        "--baseline",
        action="append",
        help=f"for a sweep: KEY=VALUE[,KEY=VALUE] selecting the baseline runs; repeat for several "
        f"(default {DEFAULT_BASELINE})",
    )
    parser.add_argument(
        "--segment", help="compare only the tokens of this segment (files with a segment column)"
    )
    parser.add_argument("--block", type=int, default=BLOCK, help=f"bootstrap block, tokens ({BLOCK})")
    parser.add_argument("--n-resamples", type=int, default=N_RESAMPLES, help=f"({N_RESAMPLES})")
    parser.add_argument("--confidence", type=float, default=CONFIDENCE, help=f"({CONFIDENCE})")
    parser.add_argument("--seed", type=int, default=SEED, help=f"({SEED})")
    parser.add_argument("--json", action="store_true", help="print one JSON object per comparison")
    parser.add_argument("--table", type=Path, help="also write the markdown table to this file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    options = dict(
        segment=args.segment,
        block=args.block,
        n_resamples=args.n_resamples,
        confidence=args.confidence,
        seed=args.seed,
    )
    try:
        if len(args.inputs) >= 2:
            if args.baseline:
                parser.error("--baseline applies to a sweep (one runs CSV or folder), not to run directories")
            comparisons = compare_pairs(args.inputs, **options)
        elif run_is_complete(args.inputs[0]):
            parser.error("one run directory: give two or more to compare, or a runs CSV / folder of runs")
        else:
            frame = _load_sweep(args.inputs[0])
            specs = args.baseline or [DEFAULT_BASELINE]
            comparisons = pd.concat(
                [compare_sweep(frame, spec, **options) for spec in specs], ignore_index=True
            )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    table = comparison_table(comparisons)
    if args.json:
        for record in comparisons.to_dict(orient="records"):
            print(json.dumps(_json_ready(record)))
    else:
        print(table)
    if args.table:
        atomic_write_text(args.table, table)
        print(f"wrote {args.table}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
