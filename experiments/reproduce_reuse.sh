#!/usr/bin/env bash
# The controlled-reuse reproduction (docs/results.md): every reuse_cpu_* sweep into results/cpu/reuse/runs, then the
# collected runs, the recall table, the comparisons and the figures. Resumable: complete runs are skipped.
#   make reproduce-reuse                  # or: bash experiments/reproduce_reuse.sh [extra Hydra overrides]
# PY selects the interpreter (default .venv/bin/python); REPRODUCE_SWEEPS a subset of the sweeps (names without
# the reuse_cpu_ prefix, space-separated; default all); extra arguments go to every sweep.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=results/cpu/reuse
read -r -a SWEEPS <<<"${REPRODUCE_SWEEPS:-refs rmm lags decoys decoys_uniform gap extra freeze b64 b64_rmm}"

for sweep in "${SWEEPS[@]}"; do
    start=$(date +%s)
    echo "== reuse_cpu_${sweep} ($(date -u +%H:%M:%S) UTC)"
    "$PY" run.py -m "experiment=reuse_cpu_${sweep}" "$@"
    echo "== reuse_cpu_${sweep}: $(($(date +%s) - start)) s"
done
rm -f "$OUT/runs/multirun.yaml"

"$PY" experiments/reuse_report.py "$OUT/runs" --out "$OUT"
