"""One run: config -> model and data -> engine per document -> metrics -> result files and W&B."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from rmm.data import check_dataset, load_documents
from rmm.engine import StreamingEngine, record_future
from rmm.future import FutureRequests
from rmm.memory import POSITIONS, SCOPES, SlotMemory
from rmm.metrics import PeakMemory, RunTotals, kv_cache_bytes, segment_metrics, summarize
from rmm.models import describe_model, load_model, resolve_device, resolve_dtype
from rmm.policies import make_policy
from rmm.storage import environment_info, read_config, read_metrics, run_is_complete, write_run
from rmm.tracking import Tracker, position_perplexity

log = logging.getLogger(__name__)


def run(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any]:
    """Execute the run described by ``cfg`` and write it to ``run_dir``; returns its metrics."""
    run_dir = Path(run_dir)
    config = OmegaConf.to_container(cfg, resolve=True)
    if cfg.resume and run_is_complete(run_dir):
        changed = _changed_keys(read_config(run_dir), config)
        if changed:
            raise ValueError(
                f"{run_dir} holds complete results of a different configuration (differs in: "
                f"{', '.join(changed)}); use resume=false to overwrite them, or another hydra.run.dir"
            )
        log.info("complete results found in %s; skipping (resume=false to recompute)", run_dir)
        return read_metrics(run_dir)
    _check_options(cfg)
    check_dataset(cfg.dataset)
    policy = make_policy(cfg.policy, budget=cfg.budget, chunk=cfg.chunk, seed=cfg.seed)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(cfg.model, device, dtype)
    dims = describe_model(model)
    docs, data_stats = load_documents(cfg.dataset, tokenizer)
    if not docs:
        raise ValueError(
            f"dataset {cfg.dataset.name!r} gave no document with at least "
            f"{cfg.dataset.min_tokens} tokens ({data_stats.n_skipped_short} skipped as too short)"
        )
    longest = max(d.tokens.numel() for d in docs)
    needs_future = policy.name == "oracle" or (cfg.diagnostics.estimator and not policy.per_query)
    context = _reference_context(cfg, dims, longest) if needs_future else None

    engine = StreamingEngine(model, policy, positions=cfg.positions, scope=cfg.scope)
    totals = RunTotals()
    environment = environment_info()  # the code that runs, read before it runs
    memory = PeakMemory(device)
    with Tracker(cfg.wandb, run_dir, cfg.run_name, config) as tracker:
        progress = tqdm(total=data_stats.n_tokens, unit="tok", disable=not cfg.progress, desc=cfg.run_name)
        for doc in docs:
            hook = None
            if needs_future:
                start = time.perf_counter()
                future = record_future(model, doc.tokens, cfg.oracle.tau, context)
                totals.reference_wall_s += time.perf_counter() - start
                if policy.name == "oracle":
                    policy.future = future
                if cfg.diagnostics.estimator:
                    hook = _estimator_hook(future, totals.estimator_pairs)
            start = time.perf_counter()
            running = RunningPerplexity(totals, progress, tracker, memory)
            result = engine.stream(doc.tokens, before_boundary=hook, on_chunk=running)
            _sync(device)
            totals.add(doc.doc_id, doc.tokens, result, time.perf_counter() - start, doc.segments)
        progress.close()
        tokens = pd.concat(totals.token_frames, ignore_index=True)
        budget = cfg.budget if policy.budget is not None else longest
        metrics = {
            **summarize(totals),
            **segment_metrics(tokens),
            "n_skipped_short": data_stats.n_skipped_short,
            "peak_memory_bytes": memory.bytes(),
            "kv_cache_bytes": kv_cache_bytes(
                budget, dims["n_layers"], dims["n_kv_heads"], dims["head_dim"], dtype
            ),
            "reference_context": context,
            "reference_tau": cfg.oracle.tau if needs_future else None,
            "policy": policy.name,
            "budget": policy.budget,
            "lag": cfg.lag if policy.name == "rmm" else None,
            "chunk": cfg.chunk,
            "positions": cfg.positions,
            "scope": cfg.scope,
            "model": cfg.model.name,
            "dataset": cfg.dataset.name,
            "seed": cfg.seed,
            "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
            "run_name": cfg.run_name,
            **{f"policy.{k}": v for k, v in config["policy"].items() if k not in ("name", "tag")},
            **{f"dataset.{k}": v for k, v in config["dataset"].items() if k not in ("name", "tag")},
            **environment,
        }
        write_run(run_dir, config, metrics, tokens)
        tracker.finish(metrics, position_perplexity(tokens))
    return metrics


class RunningPerplexity:
    """Per-chunk progress: the bar's token count and running perplexity (logged to W&B every 512 tokens),
    and a memory sample."""

    def __init__(
        self, totals: RunTotals, progress: tqdm, tracker: Tracker, memory: PeakMemory, log_every: int = 512
    ):
        self.totals, self.progress, self.tracker, self.log_every = totals, progress, tracker, log_every
        self.memory = memory
        self.streamed = self.n_scored = 0
        self.last_logged = totals.n_scored
        self.nll_sum = 0.0

    def __call__(self, streamed: int, nll: torch.Tensor) -> None:
        self.memory.sample()
        self.progress.update(streamed - self.streamed)
        self.streamed = streamed
        self.nll_sum += float(nll.sum())
        self.n_scored += nll.numel()
        scored = self.totals.n_scored + self.n_scored
        ppl = math.exp((self.totals.nll_sum + self.nll_sum) / max(scored, 1))
        self.progress.set_postfix(ppl=f"{ppl:.3f}", refresh=False)
        if scored - self.last_logged >= self.log_every:
            self.tracker.log_running(scored, ppl)
            self.last_logged = scored


def _changed_keys(stored: dict, current: dict, prefix: str = "") -> list[str]:
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
            changed += _changed_keys(old, new, f"{name}.")
        elif old != new:
            changed.append(name)
    return changed


_NOT_RESULTS = {"resume", "progress", "wandb"}
# Config keys added after results were written: dotted key -> the value that gives the old results.
# Add an entry with every new result-affecting config key, so that complete runs stay resumable.
ADDED_KEY_DEFAULTS: dict[str, object] = {}


def _check_options(cfg: DictConfig) -> None:
    if cfg.positions not in POSITIONS:
        raise ValueError(f"positions must be one of {POSITIONS}, got {cfg.positions!r}")
    if cfg.scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {cfg.scope!r}")
    if cfg.oracle.tau <= 0:
        raise ValueError(f"oracle.tau must be > 0, got {cfg.oracle.tau}")


def _reference_context(cfg: DictConfig, dims: dict, longest: int) -> int:
    """The reference pass's window: ``oracle.context``, or the model's context for streams it covers."""
    model_context = dims["max_position_embeddings"]
    if cfg.oracle.context is None:
        if longest > model_context:
            raise ValueError(
                f"the oracle's reference pass cannot cover a {longest}-token stream with full attention "
                f"(model context {model_context}); set dataset.max_tokens<={model_context}, or "
                f"oracle.context=<window> for a windowed reference pass"
            )
        return longest
    if cfg.oracle.context > model_context:
        raise ValueError(f"oracle.context={cfg.oracle.context} exceeds the model's context {model_context}")
    return int(cfg.oracle.context)


def _estimator_hook(future: FutureRequests, pairs: list):
    """Record (policy score, oracle future attention mass) of each position as it commits."""

    def hook(memory: SlotMemory, now: int) -> None:
        policy = memory.policy
        key_pos = memory.chunk_key_pos()
        edge = now - policy.protected
        committing = (key_pos >= edge - policy.chunk) & (key_pos < edge)
        if committing.any():
            scores = policy.score(memory.state_view(), key_pos, now)
            pairs.append((scores[committing].cpu(), future.remaining_mass(key_pos, now)[committing].cpu()))

    return hook


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
