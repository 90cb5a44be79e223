"""Run directory storage: atomic writes of config, metrics and per-token results.

A run directory holds ``config.yaml``, ``token_nll.parquet`` and ``metrics.json``, and ``code.diff`` when
it ran from uncommitted code (rmm/provenance.py). ``metrics.json`` is written last and marks the run as
complete. This module knows nothing of policies or models.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from rmm import provenance
from rmm.files import atomic_path, atomic_write_bytes, atomic_write_text
from rmm.provenance import DIFF_FILE, PACKAGES, package_versions

__all__ = ["DIFF_FILE", "PACKAGES", "package_versions"]  # re-exported: they lived here before provenance.py

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
        ("margin", pa.float32()),  # top-1 minus top-2 log-probability of query p - 1 (rmm.divergence)
        # at a boundary p (null elsewhere), per (layer, KV head), layer-major: the decision's margin and
        # a fingerprint of the set it kept (rmm.divergence)
        ("decision_margins", pa.list_(pa.float32())),
        ("decision_digests", pa.list_(pa.int64())),
    ]
)
# columns a token file may lack (written before they existed): their pandas dtypes
NULLABLE_COLUMNS = {
    "segment": "string",
    "margin": "Float32",
    "decision_margins": "object",
    "decision_digests": "object",
}


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
    for name, dtype in NULLABLE_COLUMNS.items():
        if name not in tokens.columns:
            tokens = tokens.assign(**{name: pd.array([None] * len(tokens), dtype=dtype)})
    missing = [name for name in TOKEN_SCHEMA.names if name not in tokens.columns]
    if missing:
        raise ValueError(f"token frame lacks columns {missing}")
    frame = tokens[TOKEN_SCHEMA.names].astype({"doc_id": str, "correct": "boolean", "segment": "string"})
    return pa.Table.from_pandas(frame, schema=TOKEN_SCHEMA, preserve_index=False)


def write_run(
    run_dir: str | Path,
    config: Mapping[str, Any],
    metrics: Mapping[str, Any],
    tokens: pd.DataFrame,
    code_diff: bytes | None = None,
) -> None:
    """Write a complete run: config.yaml, token_nll.parquet, code.diff (when ``code_diff`` is not empty:
    the uncommitted code it ran with), then metrics.json (the completion marker).

    Any earlier ``metrics.json`` and ``code.diff`` are removed first, so a rewrite interrupted midway leaves
    the run incomplete, and one from a clean tree leaves no stale diff. Where ``metrics`` holds
    ``code_diff_sha256`` it must be the hash of ``code_diff`` (None for none).
    """
    run_dir = Path(run_dir)
    expected = hashlib.sha256(code_diff).hexdigest() if code_diff else None
    if "code_diff_sha256" in metrics and metrics["code_diff_sha256"] != expected:
        raise ValueError(
            f"metrics' code_diff_sha256 {metrics['code_diff_sha256']} is not the hash of the code diff "
            f"given ({expected})"
        )
    table = _tokens_table(tokens)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / METRICS_FILE).unlink(missing_ok=True)
    (run_dir / DIFF_FILE).unlink(missing_ok=True)
    plain_config = json.loads(json.dumps(dict(config), default=_json_default))  # tuples, numpy, paths
    atomic_write_text(run_dir / CONFIG_FILE, yaml.safe_dump(plain_config, sort_keys=False))
    with atomic_path(run_dir / TOKENS_FILE) as tmp:
        pq.write_table(table, tmp)
    if code_diff:
        atomic_write_bytes(run_dir / DIFF_FILE, code_diff)
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
    """Load ``token_nll.parquet`` of a run; ``correct`` comes back as pandas' nullable boolean, and the
    :data:`NULLABLE_COLUMNS` as their nullable dtypes (all null where the file was written before the
    column existed; ``segment`` is null for plain text)."""
    table = pq.read_table(Path(run_dir) / TOKENS_FILE)
    frame = table.to_pandas(types_mapper={pa.bool_(): pd.BooleanDtype()}.get)
    for name, dtype in NULLABLE_COLUMNS.items():
        if name not in frame.columns:
            frame[name] = pd.Series([None] * len(frame), dtype=dtype)
        elif dtype != "object":
            frame[name] = frame[name].astype(dtype)
    return frame


def git_revision() -> str:
    """``git rev-parse HEAD`` of this checkout as it is now, with ``-dirty`` for uncommitted code (tracked
    changes, or untracked files under rmm/, studies/, checks/, conf/, run.py); ``"unknown"`` outside a git
    checkout or without git. A run records the revision its process captured at start instead
    (:func:`environment_info`)."""
    return provenance.read().git_revision


def environment_info(device: Any = None) -> dict[str, Any]:
    """What a run's ``metrics.json`` records of its code and machine, ready to merge into its metrics:
    ``git_revision``, ``code_dirty``, ``code_diff_sha256``, ``package_versions`` as this process captured
    them at its start (:func:`rmm.provenance.capture`), and ``cpu_capability``, ``torch_threads`` and
    ``device_name`` (for a CUDA ``device``) now."""
    return {**provenance.capture().metrics(), **provenance.runtime_info(device)}
