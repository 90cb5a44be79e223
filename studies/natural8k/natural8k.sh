#!/usr/bin/env bash
# Natural text at the paper's ratio of budget to context (docs/results.md): 8 plays x 8192 tokens, B = 256 and 512,
# h2o, streaming_llm, restkv, expected_attention, rmm (lag 128, correct and uniform) and the smoother, then the
# paired comparisons against h2o and, for rmm(correct), against rmm(uniform).
# Resumable: complete runs are skipped.   make natural8k   # or: bash studies/natural8k/natural8k.sh [Hydra overrides]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
source studies/sweeps.sh
OUT=results/cpu/natural8k
if [ -z "${REPORT_ONLY:-}" ]; then  # REPORT_ONLY=1: only the tables
    run_sweeps natural8k_cpu_ baselines rmm smoother restkv_official -- "$@"
    rm -f "$OUT/runs/multirun.yaml"
fi
"$PY" -m rmm.analysis.collect "$OUT/runs" --out "$OUT/runs.csv" --table "$OUT/main_table.md"
"$PY" -m rmm.analysis.compare "$OUT/runs.csv" --baseline policy=h2o --baseline policy.weight=uniform \
    --table "$OUT/comparison.md"
"$PY" -m rmm.analysis.figures "$OUT/runs.csv" --out "$OUT/figures" >/dev/null
# The 2026 baselines against h2o and the smoother in both natural-text studies (results/cpu/baselines2026.md).
"$PY" studies/natural8k/baselines2026.py >/dev/null
