#!/usr/bin/env bash
# The controlled-reuse reproduction (docs/results.md): every reuse_cpu_* sweep into results/cpu/reuse/runs, then the
# collected runs, the recall table, the comparisons and the figures. Resumable: complete runs are skipped.
#   make reproduce-reuse                  # or: bash studies/reuse/reproduce_reuse.sh [extra Hydra overrides]
# PY selects the interpreter (default .venv/bin/python); SWEEPS a subset of the sweeps (names without
# the reuse_cpu_ prefix, space-separated; default all); extra arguments go to every sweep; REPORT_ONLY=1 only
# rewrites the report from the runs (no sweeps, no memory re-run).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
source studies/sweeps.sh
OUT=results/cpu/reuse
read -r -a SWEEPS <<<"${SWEEPS:-refs rmm lags decoys decoys_uniform gap extra freeze b64 b64_rmm gradient gradient_freeze smoother}"

if [ -z "${REPORT_ONLY:-}" ]; then
    run_sweeps reuse_cpu_ "${SWEEPS[@]}" -- "$@"
    rm -f "$OUT/runs/multirun.yaml"
fi

"$PY" studies/reuse/reuse_report.py "$OUT/runs" --out "$OUT"
# Where the memory goes: re-streams six B=128 runs of the main setting (about 10 minutes; MEMORY=0 skips it).
if [ "${MEMORY:-1}" = 1 ] && [ -z "${REPORT_ONLY:-}" ]; then
    MAIN="$OUT/runs/smollm2_135m/reuse_r4d4_e32_g192_s0"
    "$PY" studies/reuse/reuse_memory.py "$MAIN"/{h2o_rho0.5,rmm_H48_correct_accumulate,rmm_H48_uniform_accumulate,oracle_next_use,rmm_H48_correct_freeze,rmm_H48_gradient_accumulate}_B128_C16_cache_s0 \
        --out "$OUT/memory.md"
fi
