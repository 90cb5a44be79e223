"""One run: config -> model and data -> engine per document -> metrics -> result files and W&B."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rmm import api, provenance, sharing
from rmm.config import CheckedRun, check_run
from rmm.data import DatasetStats, Document, load_documents
from rmm.engine import StreamingEngine
from rmm.lookahead import ReferenceRunner, configured_reference_context
from rmm.model_config import config_facts
from rmm.models import load_model, peek_config, resolve_device, resolve_dtype
from rmm.planning import check_stated
from rmm.policies import Policy, ScorePolicy
from rmm.storage import read_config, read_metrics, run_is_complete, write_run
from rmm.tracking import Progress, Tracker, position_perplexity

log = logging.getLogger(__name__)


@dataclass
class RunSetup:
    """Everything a run streams with, built once from the config."""

    policy: Policy
    engine: StreamingEngine  # over the loaded model, with the run's options
    docs: list[Document]
    data_stats: DatasetStats
    reference: ReferenceRunner | None  # the reference pass, when the policy or a diagnostic needs it
    estimator: bool  # whether the estimator diagnostic runs (score-based policies only)


def run(cfg: DictConfig, run_dir: str | Path, checked: CheckedRun | None = None) -> dict[str, Any]:
    """Execute the run described by ``cfg`` and write it to ``run_dir``; returns its metrics. Bad input
    fails before the model loads (:func:`rmm.config.check_run`, unless the caller ran it and hands over
    what it resolved: ``checked``).

    With ``reuse`` (the default), a budget-free policy's run takes the results of a complete run beside
    ``run_dir`` that differs only in the budget (:func:`rmm.sharing.reused_results`), and reference
    passes are read from and written to ``<run_dir>/../.reference`` (:class:`rmm.sharing.ReferenceCache`).
    """
    code = provenance.capture()  # the code as this process found it (run.py captured before Hydra)
    run_dir = Path(run_dir)
    config = OmegaConf.to_container(cfg, resolve=True)
    if cfg.resume and run_is_complete(run_dir):
        return _resume(run_dir, config, cfg)
    fields = _run_fields(cfg, config)
    if checked is None:
        checked = check_run(cfg)  # as run.py does: a call from Python fails as early
    if OmegaConf.select(cfg, "provenance.require_clean", default=False):
        code.require_clean()  # a registered study's run: refused from a dirty tree, before the model loads
    setup = build(cfg, checked)
    facts = setup.engine.facts
    environment = {**code.metrics(), **provenance.runtime_info(facts.device)}
    reusing = cfg.get("reuse", True) and sharing.known_code(environment)
    if reusing and setup.reference is not None:  # its passes read from and written beside the run
        identity = sharing.reference_identity(config, facts.device, facts.dtype, environment)
        setup.reference.cache = sharing.ReferenceCache(run_dir.parent / sharing.CACHE_DIR, identity)
    machine = {"device": str(facts.device), "dtype": str(facts.dtype).removeprefix("torch.")}
    stats = setup.data_stats
    same = (config, {**environment, **machine}, setup.policy.budget, setup.docs, stats.n_skipped_short)
    reused = sharing.reused_results(run_dir, *same) if reusing else None
    with Tracker(cfg.wandb, run_dir, cfg.run_name, config) as tracker:
        if reused is not None:
            metrics, tokens = reused
        else:
            progress = Progress(stats.n_tokens, tracker, cfg.run_name, disable=not cfg.progress)
            hooks = {"estimator": setup.estimator, "on_chunk": progress.chunk_hook}
            stream_metrics, tokens = api.run_engine(setup.engine, setup.docs, setup.reference, **hooks)
            progress.close()
            metrics = {**stream_metrics, "n_skipped_short": stats.n_skipped_short, **fields, **environment}
        if cfg.resume and run_is_complete(run_dir):  # a parallel job finished here meanwhile
            _check_same(run_dir, config, "was completed meanwhile by a run of another configuration")
        write_run(run_dir, config, metrics, tokens, code_diff=code.diff)
        tracker.finish(metrics, position_perplexity(tokens))
    return metrics


def _run_fields(cfg: DictConfig, config: dict) -> dict[str, Any]:
    """The metrics that name a run: its model (as the run name does), dataset, seed, run name, and the
    policy's and dataset's parameters."""
    return {
        "model": cfg.model.name + ("_repeat_kv" if cfg.model.get("repeat_kv") else ""),
        "dataset": cfg.dataset.name,
        "seed": cfg.seed,
        "run_name": cfg.run_name,
        **_parameters(config, "policy"),
        **_parameters(config, "dataset"),
    }


def _resume(run_dir: Path, config: dict, cfg: DictConfig) -> dict[str, Any]:
    """The stored metrics of a complete run of the same configuration, on the device and dtype that
    ``device=auto`` and ``dtype=auto`` resolve to here."""
    _check_same(run_dir, config, "holds complete results of a different configuration")
    metrics = read_metrics(run_dir)
    device_name = metrics.get("device")  # absent from runs older than the field: nothing to compare
    stored = (None if device_name is None else str(device_name).split(":")[0], metrics.get("dtype"))
    device = resolve_device("auto").type if str(cfg.device).lower() == "auto" else stored[0]
    here = (device, str(resolve_dtype(cfg.dtype, device)).removeprefix("torch."))
    if None not in stored and stored != here:
        raise ValueError(
            f"{run_dir} holds complete results computed on {stored[0]} in {stored[1]}, but "
            f"device={cfg.device} dtype={cfg.dtype} resolve to {here[0]} in {here[1]} here; run where they "
            "resolve to the stored ones, use resume=false to recompute them here, or another hydra.run.dir"
        )
    log.info("complete results found in %s; skipping (resume=false to recompute)", run_dir)
    return metrics


def _check_same(run_dir: Path, config: dict, what: str) -> None:
    """Refuse the complete results in ``run_dir`` if their config differs from ``config`` (``what``: what
    they are, for the message)."""
    changed = changed_keys(read_config(run_dir), config)
    if changed:
        raise ValueError(
            f"{run_dir} {what} (differs in: {', '.join(changed)}); use resume=false to overwrite them, or "
            "another hydra.run.dir (a sweep: hydra.sweep.dir)"
        )


def build(cfg: DictConfig, checked: CheckedRun) -> RunSetup:
    """Policy, engine over the loaded model, documents and (when needed) the reference pass, from ``cfg``
    and what :func:`check_run` resolved of it (``checked``). What the model's config.json alone refuses
    fails before its weights load."""
    dataset, policy, options = checked.dataset, checked.policy, checked.options
    estimator = bool(cfg.diagnostics.estimator) and isinstance(policy, ScorePolicy)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    config = peek_config(cfg.model)
    if config is not None:
        check_stated(config_facts(config, f"{cfg.model.name} ({config.model_type})"), policy, options)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(cfg.model, device, dtype)
    docs, data_stats = load_documents(dataset, tokenizer)
    if not docs:
        raise ValueError(
            f"dataset {cfg.dataset.name!r} gave no document with at least "
            f"{dataset.min_tokens} tokens ({data_stats.n_skipped_short} skipped as too short); lower "
            "dataset.min_tokens, or use longer texts"
        )
    engine = StreamingEngine(model, policy, options)
    longest = max(d.tokens.numel() for d in docs)
    reference = None
    if policy.needs_reference or estimator:
        context = configured_reference_context(cfg, engine.facts.dims["max_position_embeddings"], longest)
        reference = ReferenceRunner(model, cfg.oracle.tau, context)
    return RunSetup(policy, engine, docs, data_stats, reference, estimator)


def _parameters(config: dict, group: str) -> dict[str, Any]:
    """A config group's parameters as ``<group>.<name>`` metrics (``policy.rho``, ``dataset.n_docs``)."""
    return {f"{group}.{k}": v for k, v in config[group].items() if k not in ("name", "tag")}


def changed_keys(stored: dict, current: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between a stored and the current config, ignoring options that do
    not change results (``_NOT_RESULTS``).

    A key present on one side only counts as changed, unless ``ADDED_KEY_DEFAULTS`` lists it and its
    value there is the one that reproduces the results written before the key existed.
    """
    changed = []
    for key in sorted(set(stored) | set(current)):
        name = f"{prefix}{key}"
        if name in _NOT_RESULTS:
            continue
        if (key in stored) != (key in current):
            value = stored[key] if key in stored else current[key]
            if name not in ADDED_KEY_DEFAULTS or value != ADDED_KEY_DEFAULTS[name]:
                changed.append(name)
            continue
        old, new = stored[key], current[key]
        if isinstance(old, dict) and isinstance(new, dict):
            changed += changed_keys(old, new, f"{name}.")
        elif old != new:
            changed.append(name)
    return changed


# model.architecture records the checkpoint's shape (for the planner and proxies); the weights decide results.
# batch (documents per forward pass) changes a document's results only by fp32 rounding (docs/semantics.md).
# model.pip and model.assemble say how a gguf_package model is installed and its GGUF written, not what runs.
# provenance.require_clean only refuses a run from uncommitted code; the runs it lets through are the same.
# reuse takes results that this run would compute again exactly (rmm.sharing).
_NOT_RESULTS = {
    "resume",
    "reuse",
    "progress",
    "wandb",
    "batch",
    "model.architecture",
    "model.pip",
    "model.assemble",
    "provenance",
}
# Config keys added after results were written: dotted key -> the value that gives the old results.
# Add an entry with every new result-affecting config key, so that complete runs stay resumable.
ADDED_KEY_DEFAULTS: dict[str, object] = {
    "policy.seed": 0,  # random's seed became a policy key; the runs before it used the run seed, 0 in all
    "policy.weight": "correct",  # the oracle's weight (read by future_utility only) came with that variant
    "allocation": "uniform",  # budget allocation across heads and layers; before it, every head kept B'
    "layers": "all",  # the policy in global layers only (hybrid models); before it, in every layer
    "policy.variant": "harness",  # kvpress-named policies: the press's own score (kvpress), or the harness's
    "policy.step": 16,  # rmm lag=auto's unit of candidate lags (a fixed lag ignores it)
}
