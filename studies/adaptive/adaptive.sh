#!/usr/bin/env bash
# The adaptive-lag confirmation (docs/adaptive_lag.md, "Registration"): every registered setting
# (studies/adaptive/adaptive_predictions.yaml, in its order) with its arms over generator seeds 19-26, SmolLM2
# first, then Gemma 3 270M, into results/cpu/adaptive/runs; then lag=auto on natural text (8 plays x 8192 tokens,
# B = 256 and 512) into results/cpu/adaptive/natural8k/runs; then the verdicts (studies/adaptive/adaptive.py).
# Resumable across sittings: complete runs are skipped, so the same command continues where it stopped.
# Registered: its presets set provenance.require_clean=true, so a run from uncommitted code is refused before its
# model loads (run from a clean worktree: git worktree add ../rmm-clean HEAD, then in it:
# PY=/path/to/.venv/bin/python bash studies/adaptive/adaptive.sh).
#   make adaptive                                 # or: bash studies/adaptive/adaptive.sh [extra Hydra overrides]
# PY selects the interpreter (default .venv/bin/python); ADAPTIVE_MODELS the models (default both);
# ADAPTIVE_SETTINGS a subset of the settings (space-separated names); ADAPTIVE_STAGES the stages (default
# "cells natural"); REPORT_ONLY=1 only rewrites the verdicts.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=results/cpu/adaptive
read -r -a MODELS <<<"${ADAPTIVE_MODELS:-smollm2_135m gemma3_270m}"
STAGES=" ${ADAPTIVE_STAGES:-cells natural} "

if [ -z "${REPORT_ONLY:-}" ] && [[ $STAGES == *" cells "* ]]; then
    for model in "${MODELS[@]}"; do
        while read -r setting arms factors; do
            if [ -n "${ADAPTIVE_SETTINGS:-}" ] && [[ " $ADAPTIVE_SETTINGS " != *" $setting "* ]]; then
                continue
            fi
            start=$(date +%s)
            echo "== $model $setting ($arms; $factors) ($(date -u +%H:%M:%S) UTC)"
            read -r -a cell_args <<<"$factors"
            common=(experiment=adaptive_cpu_common "model=$model" "${cell_args[@]}")
            for arm in ${arms//,/ }; do
                case $arm in
                    h2o) policy=(policy=h2o) ;;
                    auto) policy=(policy=rmm lag=auto) ;;
                    fixed*) policy=(policy=rmm "lag=${arm#fixed}") ;;
                    smoother) policy=(policy=oracle policy.variant=future_utility) ;;
                esac
                "$PY" run.py -m "${common[@]}" "${policy[@]}" "$@"
            done
            echo "== $model $setting: $(($(date +%s) - start)) s"
        done < <("$PY" -m studies.adaptive.adaptive --settings "$model")
    done
    rm -f "$OUT/runs/multirun.yaml"
fi
if [ -z "${REPORT_ONLY:-}" ] && [[ $STAGES == *" natural "* ]]; then
    for model in "${MODELS[@]}"; do
        echo "== natural text, $model ($(date -u +%H:%M:%S) UTC)"
        "$PY" run.py -m experiment=adaptive_cpu_natural "model=$model" "$@"
    done
    rm -f "$OUT/natural8k/runs/multirun.yaml"
fi
"$PY" -m studies.adaptive.adaptive "$OUT/runs" --out "$OUT"
