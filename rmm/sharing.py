"""What the runs of a sweep share across budgets: the results of a policy that ignores the budget
(``full``), and the reference pass (:mod:`rmm.lookahead`), which depends on the model and the documents
only. Both are reused only when exact (docs/sweeps.md, "Reuse across budgets"); ``reuse=false`` turns it off.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from rmm.data import Document
from rmm.files import atomic_path
from rmm.future import FutureRequests
from rmm.storage import read_config, read_metrics, read_tokens, run_is_complete

log = logging.getLogger(__name__)

# model config keys that describe the checkpoint or its installation, not what runs (as for resume)
MODEL_OPTIONS = ("model.architecture", "model.pip", "model.assemble")
# config keys that cannot change a budget-free run's results (batch does, by rounding, so it must match)
REUSE_IGNORED = ("budget", "run_name", "resume", "reuse", "progress", "wandb", "provenance", *MODEL_OPTIONS)
# what a run's metrics record of the code and the machine (rmm.provenance): equal, or no reuse
ENVIRONMENT_KEYS = (
    "git_revision",
    "code_dirty",
    "code_diff_sha256",
    "package_versions",
    "cpu_capability",
    "torch_threads",
    "device_name",
)
REUSED_FROM = "reused_from"  # the metrics field of a run whose results another run computed
CACHE_DIR = ".reference"  # beside the run directories (hidden: collect skips it)


def without(config: Mapping[str, Any], dotted: Iterable[str]) -> dict[str, Any]:
    """A deep copy of ``config`` less the ``dotted`` keys (``model.pip``) that it holds."""
    out = copy.deepcopy(dict(config))
    for key in dotted:
        *parents, last = key.split(".")
        node = out
        for parent in parents:
            node = node.get(parent) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return out


def budget_free_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a resolved run config that a budget-free run's results depend on."""
    return without(config, REUSE_IGNORED)


def reference_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a resolved run config that its reference pass depends on (the documents given by the
    dataset node): the model, dataset, dtype, device, seed, batch and ``oracle`` settings."""
    keys = ("model", "dataset", "dtype", "device", "seed", "batch", "oracle")
    return without({key: config.get(key) for key in keys}, MODEL_OPTIONS)


def reference_identity(
    config: Mapping[str, Any], device: torch.device, dtype: torch.dtype, environment: Mapping[str, Any]
) -> dict[str, Any]:
    """What a run's reference passes depend on beyond their settings and tokens: the model node, the
    device and dtype it runs in, the seed (random-init models) and the code and machine
    (:data:`ENVIRONMENT_KEYS`)."""
    return {
        "model": reference_config(config)["model"],
        "dtype": str(dtype),
        "device": str(device),
        "seed": config.get("seed"),
        **{key: environment.get(key) for key in ENVIRONMENT_KEYS},
    }


def fingerprint(value: Any) -> str:
    """sha256 of ``value`` as canonical JSON."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def known_code(environment: Mapping[str, Any]) -> bool:
    """Whether the code a process runs is identified (a git revision, and its diff's hash when dirty)."""
    revision, dirty = environment.get("git_revision"), environment.get("code_dirty")
    return revision not in (None, "unknown") and dirty is not None


def find_reusable_run(
    run_dir: Path, config: Mapping[str, Any], environment: Mapping[str, Any]
) -> Path | None:
    """A complete run beside ``run_dir`` (the same parent) of a budget-free policy whose config equals
    ``config`` but for :data:`REUSE_IGNORED` and whose metrics record ``environment`` (code, machine,
    device, dtype); None if there is none or the code is not identified."""
    parent = run_dir.parent
    if not known_code(environment) or not parent.is_dir():
        return None
    wanted = budget_free_config(config)
    for sibling in sorted(parent.iterdir()):
        if sibling == run_dir or not sibling.is_dir() or not run_is_complete(sibling):
            continue
        try:
            stored, metrics = read_config(sibling), read_metrics(sibling)
        except (OSError, ValueError):
            continue
        if stored.get("budget") is None or metrics.get("budget") is not None:
            continue  # the policy kept no configured budget: not a budget-free run at another budget
        if budget_free_config(stored) != wanted:
            continue
        if all(metrics.get(key) == value for key, value in environment.items()):
            return sibling
    return None


def reused_results(
    run_dir: Path,
    config: Mapping[str, Any],
    environment: Mapping[str, Any],
    policy_budget: int | None,
    docs: Sequence[Document],
    n_skipped_short: int,
) -> tuple[dict[str, Any], pd.DataFrame] | None:
    """The metrics and per-token frame of a complete run that the run of ``config`` into ``run_dir`` would
    repeat exactly: its policy ignores the budget (``policy_budget`` None while ``config`` sets one), and a
    run beside it (:func:`find_reusable_run`: the same config but for the budget, the same ``environment``:
    code, machine, device and dtype) streamed the same ``docs``, token for token, and skipped as many
    short documents. None when there is none."""
    if config.get("budget") is None or policy_budget is not None:
        return None  # the policy keeps the configured budget: its results depend on it
    source = find_reusable_run(run_dir, config, environment)
    if source is None:
        return None
    metrics, tokens = read_metrics(source), read_tokens(source)
    if metrics.get("n_skipped_short") != n_skipped_short or not same_documents(tokens, docs):
        return None
    log.info("%s streams as %s did (its policy ignores the budget): reusing its results", run_dir, source)
    origin = metrics.get(REUSED_FROM) or str(source)
    return {**metrics, "run_name": config.get("run_name"), REUSED_FROM: origin}, tokens


def same_documents(tokens: pd.DataFrame, docs: Sequence[Document]) -> bool:
    """Whether a run's per-token frame holds exactly ``docs``: the same ids, order and token ids."""
    ids = np.repeat([doc.doc_id for doc in docs], [doc.tokens.numel() for doc in docs])
    token_ids = torch.cat([doc.tokens for doc in docs]).numpy()
    return (
        len(tokens) == len(ids)
        and bool((tokens["doc_id"].to_numpy(dtype=str) == ids).all())
        and bool((tokens["token_id"].to_numpy() == token_ids).all())
    )


class ReferenceCache:
    """Reference passes on disk, one file per call of :func:`rmm.lookahead.stream_futures` (the streams of
    one batch, side by side), named by the hash of all its result depends on: ``identity`` (model, dtype,
    device, seed, code and machine), the pass's settings and every stream's tokens. Written atomically."""

    def __init__(self, directory: Path, identity: Mapping[str, Any]):
        self.directory, self.identity = Path(directory), dict(identity)

    def path(self, streams: Sequence[torch.Tensor], settings: Mapping[str, Any]) -> Path:
        """The file of the reference passes of ``streams`` under ``settings`` (tau, context, chunk, batch)."""
        digest = hashlib.sha256(fingerprint({"identity": self.identity, "settings": dict(settings)}).encode())
        for tokens in streams:
            digest.update(np.int64(tokens.numel()).tobytes())
            digest.update(tokens.to(torch.int64).cpu().numpy().tobytes())
        return self.directory / f"{digest.hexdigest()}.pt"

    @staticmethod
    def load(path: Path) -> list[FutureRequests] | None:
        """The passes stored at ``path``, or None when it does not exist."""
        if not path.is_file():
            return None
        return [
            FutureRequests(
                stored["n_layers"],
                stored["n_heads"],
                stored["n_tokens"],
                stored["codes"],
                stored["mass"],
                stored["query_weights"],
                stored.get("tau"),
            )
            for stored in torch.load(path, weights_only=True)
        ]

    @staticmethod
    def store(path: Path, futures: Sequence[FutureRequests]) -> None:
        """Write ``futures`` to ``path`` (events sorted, masses in the recorder's fp32: exactly restored)."""
        stored = [
            {
                "n_layers": future.n_layers,
                "n_heads": future.n_heads,
                "n_tokens": future.n_tokens,
                **dict(zip(("codes", "mass"), future.recorded(), strict=True)),
                "query_weights": future.query_weights,
                "tau": future.tau,
            }
            for future in futures
        ]
        with atomic_path(path) as tmp:
            torch.save(stored, tmp)
