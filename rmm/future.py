"""Future reuse recorded by a reference pass: who attends to whom, as sparse request events.

Key j is *requested* by query s when the reference pass's attention a*_s(j) (GQA group summed) is at
least ``tau``. Events are stored sorted by a single int64 code ((layer * H + head) * N + j) * N + s,
so next-request times, remaining attention mass and remaining utility are one ``searchsorted`` away.

The reference pass also scores its own predictions: per query s, ``correct`` (argmax p(. | s) =
x_{s+1}), ``prob`` (p(x_{s+1} | s)) and ``uniform`` (1), with 0 for the last query's ``correct`` and
``prob`` (it has no target). The remaining utility weights each request's attention by its query's
weight (the smoother, rmm's H = infinity limit).
"""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedModel

from rmm.engine import StreamingEngine
from rmm.policies.window import Window


class FutureRequests:
    """Sparse reference attention of one document of ``n_tokens`` tokens.

    Parameters
    ----------
    codes : [E] int64 event codes ((layer * n_heads + head) * n_tokens + key) * n_tokens + query.
    mass : [E] float reference attention of each event.
    query_weights : weight name -> [n_tokens] float, the reference pass's own weight of each query
        (``correct``, ``prob``); ``uniform`` is implied.
    """

    def __init__(
        self,
        n_layers: int,
        n_heads: int,
        n_tokens: int,
        codes: torch.Tensor,
        mass: torch.Tensor,
        query_weights: dict[str, torch.Tensor] | None = None,
    ):
        order = torch.argsort(codes)
        self.n_layers, self.n_heads, self.n_tokens = n_layers, n_heads, n_tokens
        self.codes = codes[order]
        self.mass = mass[order].double()
        self.cum_mass = torch.cat([self.mass.new_zeros(1), self.mass.cumsum(0)])
        self.query_weights = dict(query_weights or {})
        self._cum_utility: dict[str, torch.Tensor] = {}

    def _bases(self, key_pos: torch.Tensor) -> torch.Tensor:
        n_layers, n_heads, _ = key_pos.shape
        lh = (
            torch.arange(n_layers, device=key_pos.device)[:, None] * n_heads
            + torch.arange(n_heads, device=key_pos.device)[None, :]
        )[..., None]
        return (lh * self.n_tokens + key_pos.clamp(min=0)) * self.n_tokens

    def next_request(self, key_pos: torch.Tensor, now: int) -> torch.Tensor:
        """First query s >= now requesting each key [L, H, S]; ``n_tokens`` when never requested."""
        base = self._bases(key_pos).to(self.codes.device)
        idx = torch.searchsorted(self.codes, base + now).clamp(max=max(len(self.codes) - 1, 0))
        if len(self.codes) == 0:
            return torch.full_like(key_pos, self.n_tokens)
        hit = self.codes[idx]
        found = (hit >= base + now) & (hit < base + self.n_tokens)
        return torch.where(found, hit - base, torch.full_like(hit, self.n_tokens)).to(key_pos.device)

    def remaining_mass(self, key_pos: torch.Tensor, now: int) -> torch.Tensor:
        """Sum of recorded reference attention on each key from queries s >= now: [L, H, S]."""
        base = self._bases(key_pos).to(self.codes.device)
        start = torch.searchsorted(self.codes, base + now)
        stop = torch.searchsorted(self.codes, base + self.n_tokens)
        return (self.cum_mass[stop] - self.cum_mass[start]).float().to(key_pos.device)

    def remaining_utility(self, key_pos: torch.Tensor, now: int, weight: str) -> torch.Tensor:
        """Sum over the recorded requests of each key by queries s >= now of a*_s(j) * w*_s: [L, H, S].

        ``weight`` names w*: ``correct``, ``prob`` (the reference pass's own outcomes) or ``uniform``
        (then exactly :meth:`remaining_mass`).
        """
        if weight == "uniform":
            return self.remaining_mass(key_pos, now)
        if weight not in self._cum_utility:
            if weight not in self.query_weights:
                raise ValueError(f"the reference pass recorded no query weight {weight!r}")
            per_event = self.query_weights[weight].double()[self.codes % self.n_tokens]
            utility = self.mass * per_event
            self._cum_utility[weight] = torch.cat([utility.new_zeros(1), utility.cumsum(0)])
        cum = self._cum_utility[weight]
        base = self._bases(key_pos).to(self.codes.device)
        start = torch.searchsorted(self.codes, base + now)
        stop = torch.searchsorted(self.codes, base + self.n_tokens)
        return (cum[stop] - cum[start]).float().to(key_pos.device)


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
        layer, head, q, s = torch.nonzero(attn >= self.tau, as_tuple=True)
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
        return FutureRequests(*self.shape, n_tokens, codes, mass, query_weights)


def record_future(
    model: PreTrainedModel, tokens: torch.Tensor, tau: float, context: int, chunk: int = 256
) -> FutureRequests:
    """The reference pass: who attends to whom, under full attention over the last ``context`` positions.

    Streams ``tokens`` with a ``window`` of ``context`` positions (exact full attention when the stream
    is no longer than ``context``), original positions, and records every (query, key) pair whose
    attention is at least ``tau``, and each query's ``correct`` and ``prob`` weights [n] in that pass.
    """
    recorder = RequestRecorder(tau)
    window = Window(budget=context, chunk=min(chunk, context))
    result = StreamingEngine(model, window).stream(tokens, observer=recorder)
    no_target = torch.zeros(1)  # the last query predicts nothing
    weights = {
        "correct": torch.cat([result.correct.float(), no_target]),
        "prob": torch.cat([torch.exp(-result.nll.double()).float(), no_target]),
    }
    return recorder.finish(tokens.numel(), weights)


class ReferencePass:
    """``reference(tokens)``: the reference pass of one stream, run at most once per stream and timed.

    Shared by a policy's ``prepare`` (the oracle) and the estimator diagnostic; ``wall_s`` sums the time
    spent in reference passes.
    """

    def __init__(self, model: PreTrainedModel, tau: float, context: int):
        self.model, self.tau, self.context = model, tau, context
        self.wall_s = 0.0
        self._last: tuple[torch.Tensor, FutureRequests] | None = None

    def __call__(self, tokens: torch.Tensor) -> FutureRequests:
        if self._last is not None and self._last[0] is tokens:
            return self._last[1]
        start = time.perf_counter()
        future = record_future(self.model, tokens, self.tau, self.context)
        self.wall_s += time.perf_counter() - start
        self._last = (tokens, future)
        return future


def no_reference_pass(tokens: torch.Tensor) -> FutureRequests:
    """Stands in for :class:`ReferencePass` when a run has none configured."""
    raise RuntimeError("this run has no reference pass; only policies with needs_reference may use it")
