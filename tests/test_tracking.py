"""W&B tracking (offline and disabled) and the per-position perplexity summary."""

from __future__ import annotations

import json
import math
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from rmm.tracking import POSITION_COLUMNS, Tracker, position_perplexity

WANDB_CFG = {"mode": "offline", "project": "rmm-test", "entity": None, "group": "g", "tags": ["t1"]}
CONFIG = {"policy": {"name": "rmm", "lag": 16}, "budget": 64}
METRICS = {"ppl": 12.5, "n_tokens": 300, "policy": "rmm", "policy.lag": 16, "evicted_age_mean": None}


def nll_frame() -> pd.DataFrame:
    """Two documents of 4 tokens; position 0 has no nll."""
    return pd.DataFrame(
        {
            "doc_id": ["a"] * 4 + ["b"] * 4,
            "position": [0, 1, 2, 3] * 2,
            "nll": [np.nan, 1.0, 2.0, 4.0, np.nan, 3.0, 0.0, 2.0],
        }
    )


def test_position_perplexity_pools_documents() -> None:
    table = position_perplexity(nll_frame(), bins=2)
    assert list(table.columns) == POSITION_COLUMNS
    assert table["position_bin_start"].tolist() == [0, 2]
    assert table["position_bin_end"].tolist() == [2, 4]
    # bin [0, 2): nll 1 and 3; bin [2, 4): nll 2, 4, 0, 2; cumulative: all six.
    assert table["ppl"].tolist() == pytest.approx([math.exp(2.0), math.exp(2.0)])
    assert table["cum_ppl"].tolist() == pytest.approx([math.exp(2.0), math.exp(12 / 6)])
    fine = position_perplexity(nll_frame(), bins=64)  # more bins than positions: one per position
    assert fine["position_bin_start"].tolist() == [1, 2, 3]  # position 0 has nothing scored
    assert fine["ppl"].tolist() == pytest.approx([math.exp(2.0), math.exp(1.0), math.exp(3.0)])
    assert fine["cum_ppl"].tolist() == pytest.approx([math.exp(2.0), math.exp(6 / 4), math.exp(12 / 6)])


def test_position_perplexity_without_scored_tokens() -> None:
    frame = nll_frame().assign(nll=np.nan)
    assert position_perplexity(frame).empty
    with pytest.raises(ValueError):
        position_perplexity(nll_frame(), bins=0)


def test_disabled_tracker_needs_no_wandb_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` would raise ImportError
    with Tracker({"mode": "disabled"}, tmp_path, "run", CONFIG) as tracker:
        tracker.log_running(10, 5.0)
        tracker.finish(METRICS, position_perplexity(nll_frame()))
    assert list(tmp_path.iterdir()) == []


def test_unknown_mode_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mode"):
        Tracker({"mode": "cloud"}, tmp_path, "run", CONFIG)


def wandb_records(path: Path) -> Iterator[Any]:
    """Records of a ``.wandb`` file (a LevelDB-style log of protobuf records, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if data[:4] != b":W&B":
        pytest.skip("unknown .wandb file format")
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer too short for a header: padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@pytest.fixture(scope="module")
def offline_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two offline W&B runs in one process: one finished normally, one left by an exception."""
    base = tmp_path_factory.mktemp("wandb")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_SILENT", "true")
        for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
            patch.setenv(name, str(base / name.lower()))
        ok, failed = base / "ok", base / "failed"
        with Tracker(WANDB_CFG, ok, "model/data/rmm_B64", CONFIG) as tracker:
            tracker.log_running(100, 20.0)
            tracker.log_running(200, 15.0)
            tracker.finish(METRICS, position_perplexity(nll_frame(), bins=2))
        with pytest.raises(RuntimeError), Tracker(WANDB_CFG, failed, "m/d/rmm_B128", CONFIG) as tracker:
            tracker.log_running(100, 30.0)
            raise RuntimeError("out of memory")
    return {"ok": ok, "failed": failed}


def offline_dir(run_dir: Path) -> Path:
    found = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(found) == 1, found
    return found[0]


@pytest.mark.slow  # real W&B offline runs
def test_offline_run_files(offline_runs: dict[str, Path]) -> None:
    ok_dir, failed_dir = offline_dir(offline_runs["ok"]), offline_dir(offline_runs["failed"])
    assert ok_dir.name.split("-")[-1] != failed_dir.name.split("-")[-1]  # one W&B run per Tracker
    for run in (ok_dir, failed_dir):
        assert len(list(run.glob("*.wandb"))) == 1
    tables = list((ok_dir / "files" / "media" / "table").glob("position_ppl*.table.json"))
    assert len(tables) == 1
    table = json.loads(tables[0].read_text())
    assert table["columns"] == POSITION_COLUMNS
    assert [row[:2] for row in table["data"]] == [[0, 2], [2, 4]]
    assert table["data"][1][3] == pytest.approx(math.exp(2.0))


@pytest.mark.slow  # real W&B offline runs
def test_offline_run_records(offline_runs: dict[str, Path]) -> None:
    def read(run_dir: Path) -> dict[str, list[Any]]:
        records: dict[str, list[Any]] = {}
        for record in wandb_records(next(offline_dir(run_dir).glob("*.wandb"))):
            kind = record.WhichOneof("record_type")
            records.setdefault(kind, []).append(getattr(record, kind))
        return records

    ok = read(offline_runs["ok"])
    run = ok["run"][0]
    assert run.display_name == "model/data/rmm_B64" and run.project == "rmm-test" and run.run_group == "g"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["policy"] == {"name": "rmm", "lag": 16} and config["budget"] == 64
    summary = {item.key: json.loads(item.value_json) for s in ok["summary"] for item in s.update if item.key}
    assert summary["ppl"] == 12.5 and summary["n_tokens"] == 300 and summary["policy.lag"] == 16
    history = [{i.nested_key[0]: json.loads(i.value_json) for i in h.item} for h in ok["history"]]
    assert [(h["tokens_seen"], h["running_ppl"]) for h in history if "running_ppl" in h] == [
        (100, 20.0),
        (200, 15.0),
    ]
    assert ok["exit"][0].exit_code == 0
    failed = read(offline_runs["failed"])
    for _ in range(60):  # W&B's writer process may append a failed run's exit record after finish() returns
        if "exit" in failed:
            break
        time.sleep(1.0)
        failed = read(offline_runs["failed"])
    assert failed["exit"][0].exit_code == 1


class _Logged:
    """A tracker stand-in: ``run`` is None (nothing logs) or a list of (tokens, ppl) it logged."""

    def __init__(self, logging: bool) -> None:
        self.run = [] if logging else None

    def log_running(self, tokens_seen: int, running_ppl: float) -> None:
        if self.run is not None:  # as Tracker.log_running
            self.run.append((tokens_seen, running_ppl))


class _Unreadable(torch.Tensor):
    """An NLL tensor whose values may not be read on the host (a device's, to be read only when shown)."""

    def __float__(self) -> float:
        raise AssertionError("the running NLL was read on the host")


@pytest.mark.parametrize("shown", ["bar", "wandb", "neither"])
def test_running_perplexity_reads_the_nll_only_when_it_is_shown(shown: str) -> None:
    """The running perplexity sums the NLL where it lies and reads it every ``log_every`` scored tokens,
    onto the bar and W&B; where neither shows it, it reads nothing (each read would wait for a GPU)."""
    from tqdm import tqdm

    from rmm.metrics import RunTotals
    from rmm.tracking import RunningPerplexity

    totals = RunTotals(nll_sum=10.0, n_scored=10)
    tracker = _Logged(shown == "wandb")
    with tqdm(total=100, disable=shown != "bar") as bar:
        hook = RunningPerplexity(totals, bar, tracker, log_every=8)
        chunks = [torch.full((4,), 2.0), torch.full((3,), 1.0), torch.full((4,), 3.0)]
        if shown == "neither":
            chunks = [chunk.as_subclass(_Unreadable) for chunk in chunks]
        streamed = 0
        for chunk in chunks:
            streamed += chunk.numel()
            hook(streamed, chunk)
        assert bar.n == 11 if shown == "bar" else True
        expected = math.exp((10.0 + 8 + 3 + 12) / 21)  # logged once, at 21 scored tokens (>= 10 + 8)
        if shown == "wandb":
            assert tracker.run == [(21, pytest.approx(expected))]
        if shown == "bar":
            assert bar.postfix == f"ppl={expected:.3f}"
