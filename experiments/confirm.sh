#!/usr/bin/env bash
# The confirmatory study (docs/confirmation.md, pre-registered): every registered cell (experiments/confirm_predictions.yaml,
# in its order) with its four arms over generator seeds 11-18, SmolLM2 first, then Gemma 3 270M, into
# results/cpu/confirm/runs; then the verdict table (experiments/confirm.py) into results/cpu/confirm/.
# Resumable across sittings: complete runs are skipped, so the same command continues where it stopped.
#   make confirm                                  # or: bash experiments/confirm.sh [extra Hydra overrides]
# PY selects the interpreter (default .venv/bin/python); CONFIRM_MODELS the models (default both);
# CONFIRM_CELLS a subset of the cells (space-separated names); REPORT_ONLY=1 only rewrites the verdicts.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=results/cpu/confirm
read -r -a MODELS <<<"${CONFIRM_MODELS:-smollm2_135m gemma3_270m}"

if [ -z "${REPORT_ONLY:-}" ]; then
    for model in "${MODELS[@]}"; do
        while read -r cell lag factors; do
            if [ -n "${CONFIRM_CELLS:-}" ] && [[ " $CONFIRM_CELLS " != *" $cell "* ]]; then
                continue
            fi
            start=$(date +%s)
            echo "== $model $cell (lag $lag; $factors) ($(date -u +%H:%M:%S) UTC)"
            read -r -a cell_args <<<"$factors"
            common=(experiment=confirm_cpu_common "model=$model" "${cell_args[@]}")
            "$PY" run.py -m "${common[@]}" policy=h2o "$@"  # h2o has no lag: shared by the cells' lags
            "$PY" run.py -m "${common[@]}" policy=rmm "lag=$lag" policy.weight=correct,uniform "$@"
            "$PY" run.py -m "${common[@]}" policy=rmm "lag=$lag" policy.after_commit=freeze "$@"
            echo "== $model $cell: $(($(date +%s) - start)) s"
        done < <("$PY" -m experiments.confirm --cells "$model")
    done
    rm -f "$OUT/runs/multirun.yaml"
fi
mkdir -p "$OUT"
"$PY" -m experiments.confirm "$OUT/runs" --out "$OUT"
