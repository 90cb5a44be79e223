#!/usr/bin/env bash
# Budget allocation on natural text (docs/results.md): h2o and rmm under uniform, adaptive and pyramid at B = 64
# and 128 (experiment=reproduce_cpu_allocation, 12 runs into results/cpu/allocation/runs), then the collected
# runs and the paired comparisons against the uniform allocation. Resumable: complete runs are skipped;
# REPORT_ONLY=1 only rewrites the tables.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=results/cpu/allocation
if [ -z "${REPORT_ONLY:-}" ]; then
    "$PY" run.py -m experiment=reproduce_cpu_allocation "$@"
    rm -f "$OUT/runs/multirun.yaml"
fi
"$PY" -m rmm.analysis.collect "$OUT/runs" --out "$OUT/runs.csv" --table "$OUT/main_table.md" --intervals
"$PY" -m rmm.analysis.compare "$OUT/runs.csv" --baseline allocation=uniform --table "$OUT/comparison.md" >/dev/null
