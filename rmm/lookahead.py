"""The look-ahead (reference) pass: the same model streamed once more with full attention, recording
who attends to whom as :class:`~rmm.future.FutureRequests` for the oracle and the estimator diagnostic.

It drives the engine, so it sits above it; :mod:`rmm.future` is only the value type policies read.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from rmm.divergence import TIE_MARGIN
from rmm.engine import StreamHooks, StreamingEngine, StreamRequest
from rmm.future import FutureRequests
from rmm.policies.window import Window

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from rmm.sharing import ReferenceCache

CHUNK = 256  # tokens per forward pass of a reference pass


class RequestRecorder:
    """Collects events (attention >= tau) chunk by chunk during a reference pass."""

    def __init__(self, tau: float):
        if tau <= 0:
            raise ValueError(f"oracle.tau must be > 0, got {tau}")
        self.tau = tau
        self.events: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.shape: tuple[int, int] | None = None

    def __call__(self, attn: torch.Tensor, key_pos: torch.Tensor, query_pos: torch.Tensor) -> None:
        """attn [L, H, Q, S], key_pos [L, H, S], query_pos [Q]."""
        n_layers, n_heads = attn.shape[:2]
        self.shape = (n_layers, n_heads)
        layer, head, q, s = torch.nonzero(
            attn >= self.tau * (1 - TIE_MARGIN), as_tuple=True
        )  # near misses too
        keys = key_pos[layer, head, s]
        queries = query_pos[q]
        self.events.append(
            (
                torch.stack([layer * n_heads + head, keys, queries]).cpu(),
                attn[layer, head, q, s].float().cpu(),
            )
        )

    def finish(self, n_tokens: int, query_weights: dict[str, torch.Tensor] | None = None) -> FutureRequests:
        assert self.shape is not None, "the reference pass recorded nothing"
        triples = torch.cat([e[0] for e in self.events], dim=1)
        mass = torch.cat([e[1] for e in self.events])
        lh, keys, queries = triples
        codes = (lh * n_tokens + keys) * n_tokens + queries
        return FutureRequests(*self.shape, n_tokens, codes, mass, query_weights, self.tau)


def record_future(
    model: PreTrainedModel, tokens: torch.Tensor, tau: float, context: int, chunk: int = CHUNK
) -> FutureRequests:
    """The reference pass: who attends to whom, under full attention over the last ``context`` positions.

    Streams ``tokens`` with a ``window`` of ``context`` positions (exact full attention when the stream
    is no longer than ``context``), original positions, and records every (query, key) pair whose
    attention is at least ``tau``, and each query's ``correct`` and ``prob`` weights [n] in that pass.
    """
    return record_futures(model, [tokens], tau, context, chunk)[0]


def reference_engine(
    model: PreTrainedModel, context: int, chunk: int = CHUNK, batch: int = 1
) -> StreamingEngine:
    """The engine of a reference pass: a window of ``context`` positions in chunks of ``chunk`` tokens,
    ``batch`` streams per forward pass."""
    return StreamingEngine(model, Window(budget=context, chunk=min(chunk, context)), batch=batch)


def record_futures(
    model: PreTrainedModel,
    streams: list[torch.Tensor],
    tau: float,
    context: int,
    chunk: int = CHUNK,
    batch: int = 1,
) -> list[FutureRequests]:
    """:func:`record_future` of every stream, ``batch`` streams side by side per forward pass."""
    return stream_futures(reference_engine(model, context, chunk, batch), streams, tau)


def stream_futures(engine: StreamingEngine, streams: list[torch.Tensor], tau: float) -> list[FutureRequests]:
    """The reference passes of ``streams`` through ``engine`` (a :func:`reference_engine`, which may be kept
    across calls: its self-check does not run again unless a stream needs a longer probe), recording
    attention of at least ``tau``."""
    recorders = [RequestRecorder(tau) for _ in streams]
    requests = [
        StreamRequest(tokens, engine.policy, StreamHooks(observer=recorder))
        for tokens, recorder in zip(streams, recorders, strict=True)
    ]
    futures: list[FutureRequests | None] = [None] * len(streams)
    no_target = torch.zeros(1)  # the last query predicts nothing
    for index, result, _ in engine.stream_many(requests):
        weights = {
            "correct": torch.cat([result.correct.float(), no_target]),
            "prob": torch.cat([torch.exp(-result.nll.double()).float(), no_target]),
        }
        futures[index] = recorders[index].finish(streams[index].numel(), weights)
    return futures  # type: ignore[return-value]


class ReferenceRunner:
    """``reference(tokens)``: the reference pass of one stream, run at most once per stream and timed.

    Shared by a policy's ``prepare`` (the oracle) and the estimator diagnostic; ``wall_s`` sums the time
    spent in reference passes (or reading them from ``cache``). :meth:`prefetch` runs the passes of
    several streams side by side ahead of their calls (the batch a run streams next). With a ``cache``
    (:class:`rmm.sharing.ReferenceCache`), every pass of the same streams, settings and model that ran
    before is read from it instead, and every pass that runs is written to it.
    """

    def __init__(self, model: PreTrainedModel, tau: float, context: int, cache: ReferenceCache | None = None):
        self.model, self.tau, self.context, self.cache = model, tau, context, cache
        self.wall_s = 0.0
        self._engines: dict[int, StreamingEngine] = {}  # batch -> the reference engine, made on first use
        self._last: tuple[torch.Tensor, FutureRequests] | None = None
        self._ahead: dict[int, tuple[torch.Tensor, FutureRequests]] = {}

    def _record(self, streams: list[torch.Tensor], batch: int) -> list[FutureRequests]:
        """The reference passes of ``streams`` (:func:`stream_futures`), through the cache when there is
        one; timed."""
        start = time.perf_counter()
        settings = {"tau": self.tau, "context": self.context, "chunk": CHUNK, "batch": batch}
        path = self.cache.path(streams, settings) if self.cache is not None else None
        futures = self.cache.load(path) if path is not None else None
        if futures is None:
            if batch not in self._engines:
                self._engines[batch] = reference_engine(self.model, self.context, CHUNK, batch)
            futures = stream_futures(self._engines[batch], streams, self.tau)
            if path is not None:
                self.cache.store(path, futures)
        self.wall_s += time.perf_counter() - start
        return futures

    def prefetch(self, streams: list[torch.Tensor], batch: int) -> None:
        """Run the reference passes of ``streams``, ``batch`` per forward pass; each is kept until called."""
        futures = self._record(streams, batch)
        self._ahead.update(
            {id(tokens): (tokens, future) for tokens, future in zip(streams, futures, strict=True)}
        )

    def __call__(self, tokens: torch.Tensor) -> FutureRequests:
        if self._last is not None and self._last[0] is tokens:
            return self._last[1]
        ahead = self._ahead.pop(id(tokens), None)
        future = ahead[1] if ahead is not None and ahead[0] is tokens else self._record([tokens], 1)[0]
        self._last = (tokens, future)
        return future


def no_reference_pass(tokens: torch.Tensor) -> FutureRequests:
    """Stands in for :class:`ReferenceRunner` when a run has none configured."""
    raise RuntimeError("this run has no reference pass; only policies with needs_reference may use it")


def reference_context(model_context: int, requested: int | None, longest: int) -> int:
    """The reference pass's window: ``requested`` (``oracle.context``), or the whole stream when the
    model's context ``model_context`` covers it; neither beyond ``model_context``."""
    if requested is None:
        if longest > model_context:
            raise ValueError(
                f"the oracle's reference pass cannot cover a {longest}-token stream with full attention "
                f"(model context {model_context}); set dataset.max_tokens<={model_context}, or "
                f"oracle.context=<window> for a windowed reference pass"
            )
        return longest
    if requested > model_context:
        raise ValueError(f"oracle.context={requested} exceeds the model's context {model_context}")
    return int(requested)


def configured_reference_context(cfg: DictConfig, max_position_embeddings: int, longest: int) -> int:
    """:func:`reference_context` of the run ``cfg``, whose model's context is ``model.max_context`` when
    the model config sets it, else the checkpoint's ``max_position_embeddings``. The one rule of the
    runner and the memory planner (checks/plan.py)."""
    model_context = cfg.model.get("max_context") or max_position_embeddings
    return reference_context(model_context, cfg.oracle.context, longest)
