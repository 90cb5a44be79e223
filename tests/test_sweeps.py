"""End-to-end sweeps through run.py: launchers, kill and resume, failure isolation, determinism.

Each test runs SmolLM2-135M on 64 tokens of one play in subprocesses (a few seconds per job on 2 cores).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from rmm.analysis.collect import collect
from rmm.storage import CONFIG_FILE, METRICS_FILE, TOKENS_FILE, read_metrics, read_tokens

ROOT = Path(__file__).resolve().parents[1]
ERROR_FILE = "error.txt"  # run.py's record of a failed sweep job
TINY = [
    "dataset.n_docs=1",
    "dataset.max_tokens=64",
    "budget=32",
    "chunk=16",
    "lag=8",
    "device=cpu",
    "wandb.mode=disabled",
    "progress=false",
]
TIMEOUT_S = 300

pytestmark = pytest.mark.slow


def command(*overrides: str, sweep_dir: Path | None = None) -> list[str]:
    """``python run.py`` on the tiny setting: a sweep (-m) into ``sweep_dir``, else a single run."""
    mode = ["-m", f"hydra.sweep.dir={sweep_dir}"] if sweep_dir is not None else []
    return [sys.executable, "run.py", *mode, *TINY, *overrides]


def run_ok(cmd: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def ppl_by_run(root: Path) -> dict[str, float]:
    return collect([root]).set_index("run_name")["ppl"].to_dict()


def test_local_launcher_sweep(tmp_path: Path) -> None:
    """submitit_local: every job writes a complete, self-describing run; collect has one row per job."""
    run_ok(command("hydra/launcher=local", "policy=h2o,tova", sweep_dir=tmp_path))
    frame = collect([tmp_path])
    assert sorted(frame["policy"]) == ["h2o", "tova"]
    for run_name, run_dir in zip(frame["run_name"], frame["run_dir"], strict=True):
        assert Path(run_dir) == tmp_path / run_name
        assert all((Path(run_dir) / name).is_file() for name in (CONFIG_FILE, TOKENS_FILE, METRICS_FILE))
        metrics = read_metrics(run_dir)
        assert metrics["seed"] == 0 and metrics["git_revision"] != "unknown"
        assert metrics["package_versions"]["torch"] and metrics["package_versions"]["hydra-core"]
        assert not read_tokens(run_dir).empty
    assert (tmp_path / ".submitit").is_dir()


def test_killed_sweep_resumes(tmp_path: Path) -> None:
    """Kill a sweep after its first run; the rerun skips that run and ends as an uninterrupted sweep."""
    policies = "policy=h2o,tova,random"
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    run_ok(command(policies, sweep_dir=reference))

    process = subprocess.Popen(
        command(policies, sweep_dir=killed),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not list(killed.rglob(METRICS_FILE)):
            assert process.poll() is None and time.monotonic() < deadline, "the sweep did not get going"
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    done = {path: path.stat().st_mtime_ns for path in killed.rglob(METRICS_FILE)}
    assert 1 <= len(done) < 3
    assert len(collect([killed])) == len(done)  # the interrupted run is not collected

    run_ok(command(policies, sweep_dir=killed))
    assert {path: path.stat().st_mtime_ns for path in done} == done  # complete runs were skipped
    assert ppl_by_run(killed) == ppl_by_run(reference)
    assert len(ppl_by_run(killed)) == 3


def test_failing_job_does_not_stop_the_sweep(tmp_path: Path) -> None:
    """A job that fails (a model without a path) leaves error.txt; the next job still runs."""
    result = run_ok(command("model=local,smollm2_135m", "policy=h2o", sweep_dir=tmp_path))
    assert "failed; the sweep goes on" in result.stdout + result.stderr
    frame = collect([tmp_path])
    assert frame["model"].tolist() == ["smollm2_135m"]
    (error,) = tmp_path.rglob(ERROR_FILE)
    assert error.parent.relative_to(tmp_path).parts[0] == "local"
    assert not (error.parent / METRICS_FILE).exists()
    overrides, *_, last = error.read_text().strip().splitlines()
    assert "model=local" in overrides
    assert last.startswith("ValueError: model source 'local' needs a directory")

    single = subprocess.run(
        command("model=local", f"hydra.run.dir={tmp_path / 'single'}"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert single.returncode != 0 and "needs a directory" in single.stderr
    assert not (tmp_path / "single" / ERROR_FILE).exists()


def test_same_run_twice_gives_identical_token_nll(tmp_path: Path) -> None:
    """Same config, seed and machine: resume=false recomputes the run, token for token."""
    run_dir = tmp_path / "run"
    cmd = command("policy=random", f"hydra.run.dir={run_dir}")
    run_ok(cmd)
    first, first_mtime = read_tokens(run_dir), (run_dir / METRICS_FILE).stat().st_mtime_ns
    run_ok([*cmd, "resume=false"])
    assert (run_dir / METRICS_FILE).stat().st_mtime_ns != first_mtime
    pd.testing.assert_frame_equal(read_tokens(run_dir), first)
