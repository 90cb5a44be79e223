#!/usr/bin/env bash
# The confirmatory study (docs/confirmation.md, pre-registered): every registered cell (studies/confirm/confirm_predictions.yaml,
# in its order) with its four arms over generator seeds 11-18, SmolLM2 first, then Gemma 3 270M, into
# results/cpu/confirm/runs; then Gemma 3's natural-text study (its lag chosen on 3 plays x 2048 tokens, then
# 8 plays x 8192 tokens) into results/cpu/confirm/natural2048 and natural8k; then the verdict table
# (studies/confirm/confirm.py) and the natural-text tables into results/cpu/confirm/.
# Resumable across sittings: complete runs are skipped, so the same command continues where it stopped.
# Registered: its presets set provenance.require_clean=true, so a run that would be written from uncommitted
# code is refused before its model loads and the sweep stops (commit or stash, or run from a clean worktree:
# git worktree add ../rmm-clean HEAD, then in it: PY=/path/to/.venv/bin/python bash studies/confirm/confirm.sh).
#   make confirm                                  # or: bash studies/confirm/confirm.sh [extra Hydra overrides]
# PY selects the interpreter (default .venv/bin/python); CONFIRM_MODELS the models (default both);
# CONFIRM_CELLS a subset of the cells (space-separated names); CONFIRM_STAGES the stages (default "cells natural");
# REPORT_ONLY=1 only rewrites the tables.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=results/cpu/confirm
read -r -a MODELS <<<"${CONFIRM_MODELS:-smollm2_135m gemma3_270m}"
STAGES=" ${CONFIRM_STAGES:-cells natural} "

if [ -z "${REPORT_ONLY:-}" ] && [[ $STAGES == *" cells "* ]]; then
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
        done < <("$PY" -m studies.confirm.confirm --cells "$model")
    done
    rm -f "$OUT/runs/multirun.yaml"
fi
if [ -z "${REPORT_ONLY:-}" ] && [[ $STAGES == *" natural "* ]]; then
    source studies/sweeps.sh
    run_sweeps confirm_cpu_natural_ lags -- "$@"
    for budget in 256 512; do
        lag=$("$PY" -m studies.confirm.confirm --natural-lag "$budget" "$OUT/natural2048/runs")
        echo "== natural text on Gemma 3, B=$budget: lag $lag"
        natural=(experiment=confirm_cpu_natural "budget=$budget")
        "$PY" run.py -m "${natural[@]}" policy=h2o,streaming_llm "$@"
        "$PY" run.py -m "${natural[@]}" policy=rmm "lag=$lag" policy.weight=correct,uniform "$@"
        "$PY" run.py -m "${natural[@]}" policy=oracle policy.variant=future_utility "$@"  # the smoother
    done
    rm -f "$OUT"/natural*/runs/multirun.yaml
fi
mkdir -p "$OUT"
"$PY" -m studies.confirm.confirm "$OUT/runs" --out "$OUT"
for study in natural2048 natural8k; do
    if [ -d "$OUT/$study/runs" ]; then
        "$PY" -m rmm.analysis.collect "$OUT/$study/runs" --out "$OUT/$study/runs.csv" --table "$OUT/$study/main_table.md"
    fi
done
if [ -d "$OUT/natural8k/runs" ]; then
    "$PY" -m rmm.analysis.compare "$OUT/natural8k/runs.csv" --baseline policy=h2o --baseline policy.weight=uniform \
        --table "$OUT/natural8k/comparison.md"
fi
