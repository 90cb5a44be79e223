"""Run directory storage: atomic writes, completion marker, reading back, environment info."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from rmm import files, provenance, storage
from rmm.analysis.collect import collect
from rmm.storage import (
    TOKEN_SCHEMA,
    atomic_write_text,
    environment_info,
    read_config,
    read_metrics,
    read_tokens,
    run_is_complete,
    write_run,
)

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"torch", "transformers", "datasets", "hydra-core", "wandb", "numpy", "pandas", "python"}
CONFIG = {"policy": {"name": "h2o", "rho": 0.5}, "budget": 64, "wandb": {"tags": ["a", "b"]}}
# What a config may hold beyond plain YAML types, and what it reads back as.
ODD_CONFIG = {"shape": (1, 2), "seed": np.int64(3), "dir": Path("runs/x")}
ODD_CONFIG_READ = {"shape": [1, 2], "seed": 3, "dir": "runs/x"}
METRICS = {
    "ppl": 12.5,
    "n_tokens": np.int64(5),
    "correct_frac": np.float32(0.25),
    "evicted_age_mean": None,
    "package_versions": {"torch": "2.0"},
    "policy": "h2o",
    "policy.rho": 0.5,
    "budget": 64,
}


def make_tokens() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "doc_id": ["d0"] * 3 + ["d1"] * 3,
            "position": [0, 1, 2] * 2,
            "token_id": [5, 6, 7, 8, 9, 10],
            "nll": [np.nan, 1.5, 2.5, np.nan, 0.5, 3.0],
            "correct": [None, True, False, None, False, True],
        }
    )


def run_files(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir())


def test_write_run_round_trip(tmp_path: Path) -> None:
    run_dir = tmp_path / "a" / "run"
    write_run(run_dir, CONFIG, METRICS, make_tokens())
    assert run_files(run_dir) == ["config.yaml", "metrics.json", "token_nll.parquet"]  # no temp files left
    assert run_is_complete(run_dir)
    assert read_config(run_dir) == CONFIG
    write_run(run_dir, ODD_CONFIG, METRICS, make_tokens())
    assert read_config(run_dir) == ODD_CONFIG_READ
    metrics = read_metrics(run_dir)
    assert metrics["n_tokens"] == 5 and metrics["correct_frac"] == pytest.approx(0.25)
    assert metrics["evicted_age_mean"] is None and metrics["package_versions"] == {"torch": "2.0"}
    tokens = read_tokens(run_dir)
    assert list(tokens.columns) == TOKEN_SCHEMA.names
    assert tokens["segment"].isna().all()  # plain text: no segment labels
    assert tokens["position"].dtype == np.int32 and tokens["token_id"].dtype == np.int32
    assert tokens["nll"].dtype == np.float32
    assert tokens["nll"].isna().tolist() == [True, False, False, True, False, False]
    assert tokens["nll"].iloc[2] == pytest.approx(2.5)
    assert tokens["correct"].dtype == pd.BooleanDtype()
    assert tokens["correct"].isna().tolist() == [True, False, False, True, False, False]
    assert tokens["correct"].iloc[1] and not tokens["correct"].iloc[2]
    assert tokens["doc_id"].tolist() == ["d0"] * 3 + ["d1"] * 3


def test_metrics_written_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    replaced: list[str] = []
    real_replace = os.replace

    def recording_replace(src: str, dst: str) -> None:
        replaced.append(Path(dst).name)
        real_replace(src, dst)

    monkeypatch.setattr(storage.os, "replace", recording_replace)
    write_run(tmp_path / "run", CONFIG, METRICS, make_tokens())
    assert replaced[-1] == "metrics.json"
    assert sorted(replaced) == ["config.yaml", "metrics.json", "token_nll.parquet"]


def test_interrupted_write_is_not_complete_nor_collected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    write_run(tmp_path / "done", CONFIG, METRICS, make_tokens())

    def crash(table: object, where: Path) -> None:
        Path(where).write_bytes(b"PAR1 half a parquet file")
        raise KeyboardInterrupt  # killed midway through the token file

    monkeypatch.setattr(storage.pq, "write_table", crash)
    with pytest.raises(KeyboardInterrupt):
        write_run(tmp_path / "crashed", CONFIG, METRICS, make_tokens())
    assert run_files(tmp_path / "crashed") == ["config.yaml"]  # temp file removed, no tokens, no marker
    assert not run_is_complete(tmp_path / "crashed")

    (tmp_path / "tokens_only").mkdir()
    (tmp_path / "tokens_only" / "token_nll.parquet").write_bytes(b"PAR1")
    with caplog.at_level(logging.WARNING):
        frame = collect([tmp_path])
    assert frame["run_dir"].tolist() == [str((tmp_path / "done").resolve())]
    assert "ignored 2 incomplete run directories" in caplog.text


def test_rewrite_interrupted_leaves_run_incomplete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir, CONFIG, METRICS, make_tokens())

    def crash(*args: object) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(storage.pq, "write_table", crash)
    with pytest.raises(RuntimeError):
        write_run(run_dir, CONFIG, {**METRICS, "ppl": 99.0}, make_tokens())
    assert not run_is_complete(run_dir)  # the old marker went before anything was rewritten
    assert not any(p.name.endswith(".tmp") for p in run_dir.iterdir())


def test_atomic_write_failure_keeps_old_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "notes.txt"
    atomic_write_text(target, "old")

    def failing_replace(src: str, dst: str) -> None:
        raise OSError("rename failed")

    monkeypatch.setattr(files.os, "replace", failing_replace)
    with pytest.raises(OSError):
        atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert run_files(tmp_path) == ["notes.txt"]


def test_run_is_complete_requires_parsable_metrics(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir, CONFIG, METRICS, make_tokens())
    (run_dir / "metrics.json").write_text('{"ppl": 1')  # truncated
    assert not run_is_complete(run_dir)
    (run_dir / "metrics.json").write_text("[1, 2]")  # parses, but not an object
    assert not run_is_complete(run_dir)
    (run_dir / "metrics.json").write_text(json.dumps({"ppl": 1.0}))
    assert run_is_complete(run_dir)
    (run_dir / "config.yaml").unlink()
    assert not run_is_complete(run_dir)


def test_write_run_rejects_missing_token_columns(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nll"):
        write_run(tmp_path / "run", CONFIG, METRICS, make_tokens().drop(columns=["nll"]))
    assert not run_is_complete(tmp_path / "run")


def test_environment_info_of_this_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(provenance, "_captured", None)  # captured now, not earlier in the session
    info = environment_info()
    assert {"code_dirty", "code_diff_sha256", "cpu_capability", "torch_threads", "device_name"} <= set(info)
    versions = info["package_versions"]
    assert set(versions) == PACKAGES
    assert versions["python"] == platform.python_version()
    assert versions["pandas"] == pd.__version__ and versions["numpy"] == np.__version__
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    expected = head.stdout.strip() if head.returncode == 0 else "unknown"
    assert info["git_revision"].removesuffix("-dirty") == expected


def test_git_revision_clean_dirty_and_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "file.txt").write_text("one")
    subprocess.run([*git, "add", "file.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "c"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    revision = head.stdout.strip()
    monkeypatch.setattr(provenance, "REPO_ROOT", repo)
    (repo / "untracked.txt").write_text("ignored for dirtiness")
    assert storage.git_revision() == revision
    (repo / "file.txt").write_text("two")
    assert storage.git_revision() == f"{revision}-dirty"
    monkeypatch.setattr(provenance, "REPO_ROOT", tmp_path / "not_a_repo")
    assert storage.git_revision() == "unknown"
