#!/usr/bin/env bash
# The CPU reproduction (docs/results.md): every reproduce_cpu_* sweep into results/cpu/runs, then the
# collected table with intervals, the paired comparisons (comparison.md) and the figures. Resumable: runs
# whose directory is complete are skipped (resume=true).
#   make reproduce-cpu                    # or: bash studies/natural2048/reproduce_cpu.sh [extra Hydra overrides]
# PY selects the interpreter (default .venv/bin/python); OUT the results folder (default results/cpu);
# SWEEPS a subset of the sweeps (names without the reproduce_cpu_ prefix, space-separated;
# default all); extra arguments go to every sweep; REPORT_ONLY=1 only rewrites the tables and figures.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
source studies/sweeps.sh
OUT=${OUT:-results/cpu}  # another folder for other settings, e.g. OUT=results/cpu8 ... dataset.n_docs=8
# Order: the cheap references first, the budget-512 rmm lag grid last (the first thing to drop if too slow).
read -r -a SWEEPS <<<"${SWEEPS:-full baselines rmm_b128 rmm_b128_freeze rmm_b64 rmm_b256_512 rmm_gradient smoother restkv_official}"

if [ -z "${REPORT_ONLY:-}" ]; then
    run_sweeps reproduce_cpu_ "${SWEEPS[@]}" -- "hydra.sweep.dir=$OUT/runs" "$@"
    rm -f "$OUT/runs/multirun.yaml"  # Hydra's record of the last sweep only; each run keeps its own config.yaml
fi

# runs.csv with each run's 95 % perplexity interval (ppl_ci_low/high), the table as "ppl [lo, hi]".
"$PY" -m rmm.analysis.collect "$OUT/runs" --out "$OUT/runs.csv" --table "$OUT/main_table.md" --intervals
# Paired comparisons with intervals and per-document wins (docs/results.md quotes them): every run against
# h2o at the same budget, rmm's commit weights against uniform and against correct (the gradient utility's
# comparison), freeze against accumulate.
"$PY" -m rmm.analysis.compare "$OUT/runs.csv" --baseline policy=h2o --baseline policy.weight=uniform \
    --baseline policy.weight=correct --baseline policy.after_commit=accumulate \
    --table "$OUT/comparison.md" >/dev/null
# Budget 128 for ppl_vs_lag and cumulative_ppl: the budget with the weight and after_commit ablations.
"$PY" -m rmm.analysis.figures "$OUT/runs.csv" --out "$OUT/figures" --budget 128
# window and random (ppl up to 292) squeeze the other policies into a thin band on a linear axis:
# the same two figures without them.
"$PY" - "$OUT" <<'PYTHON'
import sys

from rmm.analysis import figures
from rmm.analysis.collect import load_runs

out = sys.argv[1]
frame = load_runs(f"{out}/runs.csv")
close = frame[~frame["policy"].isin(["window", "random"])]
figures.ppl_vs_budget(close, f"{out}/figures/no_window_random")
figures.cumulative_ppl(close, f"{out}/figures/no_window_random", budget=128)
print(f"wrote ppl_vs_budget, cumulative_ppl without window and random to {out}/figures/no_window_random")
PYTHON
