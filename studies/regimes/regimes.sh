#!/usr/bin/env bash
# The regime map (docs/regimes.md): every regimes_cpu_* sweep into results/cpu/regimes/runs, in order of priority,
# then the report (paired comparisons pooled over generator seeds, phase maps) into results/cpu/regimes/.
# Resumable across sittings: complete runs are skipped, so the same command continues where it stopped.
#   make regimes                          # or: bash studies/regimes/regimes.sh [extra Hydra overrides]
# PY selects the interpreter (default .venv/bin/python); SWEEPS a subset of the sweeps (names without the
# regimes_cpu_ prefix, space-separated; default all, in this order); REPORT_ONLY=1 only rewrites the report;
# MEMORY=1 adds the memory composition of the base cell (memory_base.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
source studies/sweeps.sh
OUT=results/cpu/regimes
read -r -a SWEEPS <<<"${SWEEPS:-echo_h2o echo_rmm echo_smoother echo_freeze decoys_h2o decoys_rmm decoys_smoother decoys_freeze gap_h2o gap_rmm gap_smoother gap_freeze echo_baselines2026 echo_restkv_official}"

if [ -z "${REPORT_ONLY:-}" ]; then
    run_sweeps regimes_cpu_ "${SWEEPS[@]}" -- "$@"
    rm -f "$OUT/runs/multirun.yaml"
fi
"$PY" studies/regimes/regimes.py "$OUT/runs" --out "$OUT"
# Where the memory goes in the base cell, per seed (re-streams 5 runs a seed; MEMORY=1 to run it).
if [ "${MEMORY:-0}" = 1 ]; then
    runs=()
    for seed in 1 2 3; do
        base="$OUT/runs/smollm2_135m/reuse_r4d4_e32_g192_s${seed}"
        for run in h2o_rho0.5 rmm_H48_correct_accumulate rmm_H48_uniform_accumulate rmm_H48_correct_freeze \
            oracle_future_utility_correct; do
            [ -f "$base/${run}_B128_C16_cache_s0/metrics.json" ] && runs+=("$base/${run}_B128_C16_cache_s0")
        done
    done
    "$PY" studies/reuse/reuse_memory.py "${runs[@]}" --out "$OUT/memory_base.md"
fi
