"""Run directory storage: atomic writes of config, metrics and per-token results.

A run directory holds ``config.yaml``, ``token_nll.parquet`` and ``metrics.json``. ``metrics.json`` is
written last and marks the run as complete. This module knows nothing of policies or models.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from rmm.files import atomic_path, atomic_write_text

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.json"
TOKENS_FILE = "token_nll.parquet"

TOKEN_SCHEMA = pa.schema(
    [
        ("doc_id", pa.string()),
        ("position", pa.int32()),
        ("token_id", pa.int32()),
        ("nll", pa.float32()),
        ("correct", pa.bool_()),
        ("segment", pa.string()),  # controlled-reuse label of x_p; null for plain text
    ]
)

PACKAGES = ("torch", "transformers", "datasets", "hydra-core", "wandb", "numpy", "pandas")
REPO_ROOT = Path(__file__).resolve().parents[1]


def _json_default(value: Any) -> Any:
    """Make numpy scalars/arrays and paths JSON-serialisable."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _tokens_table(tokens: pd.DataFrame) -> pa.Table:
    """Cast the per-token frame to the ``token_nll.parquet`` schema (raises on missing columns)."""
    if "segment" not in tokens.columns:
        tokens = tokens.assign(segment=pd.array([None] * len(tokens), dtype="string"))
    missing = [name for name in TOKEN_SCHEMA.names if name not in tokens.columns]
    if missing:
        raise ValueError(f"token frame lacks columns {missing}")
    frame = tokens[TOKEN_SCHEMA.names].astype({"doc_id": str, "correct": "boolean", "segment": "string"})
    return pa.Table.from_pandas(frame, schema=TOKEN_SCHEMA, preserve_index=False)


def write_run(
    run_dir: str | Path, config: Mapping[str, Any], metrics: Mapping[str, Any], tokens: pd.DataFrame
) -> None:
    """Write a complete run: config.yaml, token_nll.parquet, then metrics.json (the completion marker).

    Any earlier ``metrics.json`` is removed first, so a rewrite interrupted midway leaves the run incomplete.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / METRICS_FILE).unlink(missing_ok=True)
    table = _tokens_table(tokens)
    plain_config = json.loads(json.dumps(dict(config), default=_json_default))  # tuples, numpy, paths
    atomic_write_text(run_dir / CONFIG_FILE, yaml.safe_dump(plain_config, sort_keys=False))
    with atomic_path(run_dir / TOKENS_FILE) as tmp:
        pq.write_table(table, tmp)
    atomic_write_text(
        run_dir / METRICS_FILE, json.dumps(dict(metrics), indent=2, default=_json_default) + "\n"
    )


def run_is_complete(run_dir: str | Path) -> bool:
    """True iff metrics.json parses as a JSON object and token_nll.parquet and config.yaml exist."""
    run_dir = Path(run_dir)
    if not ((run_dir / TOKENS_FILE).is_file() and (run_dir / CONFIG_FILE).is_file()):
        return False
    try:
        return isinstance(read_metrics(run_dir), dict)
    except (OSError, ValueError):
        return False


def read_metrics(run_dir: str | Path) -> dict[str, Any]:
    """Load ``metrics.json`` of a run."""
    return json.loads((Path(run_dir) / METRICS_FILE).read_text(encoding="utf-8"))


def read_config(run_dir: str | Path) -> dict[str, Any]:
    """Load ``config.yaml`` of a run."""
    return yaml.safe_load((Path(run_dir) / CONFIG_FILE).read_text(encoding="utf-8"))


def read_tokens(run_dir: str | Path) -> pd.DataFrame:
    """Load ``token_nll.parquet`` of a run; ``correct`` comes back as pandas' nullable boolean, ``segment``
    as a nullable string (all null for plain text, and for files written before the column existed)."""
    table = pq.read_table(Path(run_dir) / TOKENS_FILE)
    frame = table.to_pandas(types_mapper={pa.bool_(): pd.BooleanDtype()}.get)
    segment = frame["segment"] if "segment" in frame.columns else [None] * len(frame)
    frame["segment"] = pd.array(segment, dtype="string")
    return frame


def _git(*args: str) -> str:
    result = subprocess.run(
        ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=True, timeout=30
    )
    return result.stdout.strip()


def git_revision() -> str:
    """``git rev-parse HEAD`` of this checkout, with ``-dirty`` for uncommitted changes to tracked files.

    Returns ``"unknown"`` outside a git checkout or without git.
    """
    try:
        revision = _git("rev-parse", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{revision}-dirty" if dirty else revision


def package_versions() -> dict[str, str | None]:
    """Installed versions of the packages that shape results (None where not installed), and Python's."""
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    versions["python"] = platform.python_version()
    return versions


def environment_info() -> dict[str, Any]:
    """``{"git_revision": str, "package_versions": dict}``, ready to merge into a run's metrics."""
    return {"git_revision": git_revision(), "package_versions": package_versions()}
