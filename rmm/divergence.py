"""When two computations of one stream may differ, and when a difference is a regression.

The same code on two machines (or at another batch size, thread count or ATen CPU capability) does not
make bit-identical fp32 matrix products: kernels block and vectorise the sums differently, so the last
bits differ. Equality is guaranteed only for the same shapes through the same kernels. Everywhere else
the design guarantees three things, each with one bound stated here:

- :data:`NLL_BOUND`: while two computations take the same decisions, each token's NLL agrees to within
  3e-4 nats. Measured: batch 1 against batch 3-4 on the tiny models, about 1e-6, and on SmolLM2 (one
  memory for the batch) at most 3.1e-5 over 3080 tokens; the committed runs re-made on another CPU, 4e-5
  over 8192 tokens (``make verify-results``); a regime-map run (3716 tokens, SmolLM2, rmm freeze at B=64)
  re-made after the engine moved to one attention call for the batch (other kernels, transformers 5.25
  against 5.24), 9.4e-5 at one thread and 1.09e-4 at two, at one token (the mean over its tokens 5e-6).
  The bound was 1e-4 until that run; 3e-4 is about three times the largest measured and still 30 times
  below the smallest effect the studies report (paired log ratios of 0.01).
- :data:`TIE_MARGIN`: a decision is a near-tie when its relative margin (the gap between the lowest kept
  and the highest evicted score over their size, :func:`rmm.policies.select.decision_margin`) is below
  1e-4. A score is a sum of attention probabilities or products of fp32 activations; rounding moves it
  by about 1e-6 relative per term and a sum of thousands of terms by more, so a decision
  inside it may go either way on another machine, and one outside it may not (measured: margins move by
  at most 2.2e-5 between CPU kernel sets, ``python checks/capabilities.py``). A margin of exactly 0 is an
  exact tie (bit-equal scores: zero utilities, integer scores), broken by recency alike on every machine,
  so it is no near-tie: a regression cannot hide behind the exact ties some policies meet at every
  boundary. A policy that compares its scores at d significant digits (``score_digits``: knorm, keydiff,
  lagkv, rmm's gradient weight) turns rounding noise into exact ties, except where a score sits at a
  rounding boundary: for it a near-tie is a margin within two units of the last digit, 2 x 10^(1 - d),
  exact ties included (:func:`tie_margin`). A policy whose scores count comparisons of a statistic with a
  threshold (lru's and the oracles' ``a >= tau``) also decides at the threshold: a comparison whose
  statistic lies within :data:`TIE_MARGIN` of tau, relative, may go the other way on another machine and
  move a score by a whole step (lru: a last use; the oracles: a request). Its decision margin is therefore
  also at most the relative distance |a - tau| / tau of such a comparison wherever flipping those
  comparisons could change what the decision kept (:meth:`rmm.policies.ScorePolicy.score_bounds`,
  :func:`rmm.policies.select.threshold_margin`; measured: a committed lru run re-made on this machine
  first kept another set where one attention was 1 fp32 unit above tau, 7.1e-8 relative).
- :data:`CORRECT_MARGIN`: ``correct`` (argmax == target) is a near-tie when the top-1 and top-2
  log-probabilities of the query differ by less than 1e-3 nats, about three times :data:`NLL_BOUND`.

Once a near-tie flips, the two streams hold different memories and may differ by anything from there
on: that is a machine divergence, not a regression. :func:`diverge` finds the first difference between
two computations and says whether a near-tie explains it: the first differing retained set or
``correct`` must itself be a near-tie, and a first NLL difference beyond :data:`NLL_BOUND` must come
after a near-tie decision or flipped near-tie ``correct`` that could have caused it. Everything before
the first difference is checked token by token, so a regression that changes a clear decision, or any
token's NLL before the first near-tie, cannot hide behind a margin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

NLL_BOUND = 3e-4  # nats per token, fp32 (see the module docstring)
TIE_MARGIN = 1e-4  # relative score gap of a decision
CORRECT_MARGIN = 1e-3  # nats between the top-1 and top-2 log-probabilities


@dataclass
class Trace:
    """What one computation of one stream of n tokens recorded.

    nll, correct : [n - 1] per query (NaN / False where absent).
    margin : [n - 1] top-1 minus top-2 log-probability (NaN, or None, where not recorded: older files).
    decisions : boundary -> the decision's margins [L * H] per (layer, KV head), layer-major.
    kept : boundary -> what the decision kept per (layer, KV head), [L * H] comparable items: the retained
        sets where the caller recorded them (:func:`rmm.engine.retained_sets_recorder`), else their digests
        (:func:`rmm.policies.select.kept_digest`). Both empty where not recorded (older run files).
    score_digits : the digits at which the policy compared its scores (None: unrounded; :func:`tie_margin`).
    """

    nll: np.ndarray
    correct: np.ndarray
    margin: np.ndarray | None = None
    decisions: dict[int, np.ndarray] = field(default_factory=dict)
    kept: dict[int, list] = field(default_factory=dict)
    score_digits: int | None = None

    @classmethod
    def of(cls, result, sets: dict[int, list] | None = None) -> Trace:
        """The trace of an :class:`rmm.engine.StreamResult` (and the retained ``sets`` [L][H] it recorded)."""
        boundaries = [] if result.boundaries is None else result.boundaries.tolist()
        decisions, kept = {}, {}
        if result.decisions is not None:
            margins = result.decisions.flatten(1).double().numpy()
            decisions = dict(zip(boundaries, margins, strict=True))
        if sets is not None:
            kept = {t: [tuple(head) for layer in per for head in layer] for t, per in sets.items()}
        elif result.digests is not None:
            kept = {t: d.flatten().tolist() for t, d in zip(boundaries, result.digests, strict=True)}
        return cls(
            result.nll.double().numpy(),
            result.correct.numpy(),
            None if result.margin is None else result.margin.double().numpy(),
            decisions,
            kept,
            result.score_digits,
        )

    @classmethod
    def of_frame(cls, frame: pd.DataFrame, score_digits: int | None = None) -> Trace:
        """The trace of one document's rows of a ``token_nll.parquet`` (:func:`rmm.storage.read_tokens`); the
        run's ``score_digits`` are in its metrics."""
        rows = frame.sort_values("position")
        positions = rows["position"].tolist()
        decisions = {
            t: np.asarray(m, dtype=np.float64)
            for t, m in zip(positions, rows["decision_margins"], strict=True)
            if m is not None
        }
        kept = {t: list(d) for t, d in zip(positions, rows["decision_digests"], strict=True) if d is not None}
        return cls(
            rows["nll"].to_numpy(np.float64, na_value=np.nan)[1:],
            rows["correct"].astype("boolean").fillna(False).to_numpy(bool)[1:],
            rows["margin"].to_numpy(np.float64, na_value=np.nan)[1:],
            decisions,
            kept,
            score_digits,
        )


@dataclass
class Divergence:
    """Where two computations of one stream first differ, and why.

    first : query index of the first difference (NLL beyond :data:`NLL_BOUND`, ``correct``, or the
        decision at boundary ``first``), None when they agree throughout.
    what : that difference, in words.
    cause : the near-tie that explains it, None when nothing does (a regression).
    max_before : largest per-token |dNLL| before ``first`` (over the whole stream when they agree).
    """

    first: int | None
    what: str
    cause: str | None
    max_before: float

    @property
    def ok(self) -> bool:
        return self.first is None or self.cause is not None

    def describe(self) -> str:
        if self.first is None:
            return f"agree (max |dNLL| {self.max_before:.2g})"
        verdict = f"machine divergence: {self.cause}" if self.cause else "REGRESSION: no near-tie explains it"
        return f"{self.what}; {verdict}; agree before it (max |dNLL| {self.max_before:.2g})"


def tie_margin(score_digits: int | None) -> float:
    """The margin below which a decision is a near-tie: :data:`TIE_MARGIN`, or two units of the last digit
    (2 x 10^(1 - d)) for scores compared at d significant digits."""
    return TIE_MARGIN if score_digits is None else max(TIE_MARGIN, 2 * 10.0 ** (1 - score_digits))


def near_tie(margin: np.ndarray | float, score_digits: int | None = None) -> np.ndarray | bool:
    """Whether a decision's margin may flip with the rounding of another machine: 0 < margin <
    :func:`tie_margin` (0, an exact tie, is broken alike everywhere; not so for rounded scores, where it may
    be a rounding boundary's; NaN, not recorded, is no near-tie)."""
    lowest = 0.0 if score_digits is not None else np.nextafter(0.0, 1.0)
    return (margin >= lowest) & (margin < tie_margin(score_digits))


def _margins(a: Trace, b: Trace, t: int) -> np.ndarray | None:
    """The smaller of the two traces' margins [L * H] of the decision at boundary ``t`` (None if neither
    recorded it)."""
    found = [trace.decisions[t] for trace in (a, b) if t in trace.decisions]
    return None if not found else np.fmin.reduce(found) if len(found) > 1 else found[0]


def diverge(a: Trace, b: Trace) -> Divergence:
    """The first difference between two computations of one stream and the near-tie that explains it.

    Differences in time order: what the decision at boundary t kept (where both traces recorded it)
    precedes query t's NLL; then query i's NLL and ``correct``. The first of them must be a near-tie:
    every (layer, KV head) whose kept set differs decided within :func:`near_tie`, or the ``correct``
    that differs has a margin below :data:`CORRECT_MARGIN`. Where the traces did not record what their
    decisions kept (run files written before the digests), a first difference at query i is explained by
    a near-tie of any (layer, KV head) at a boundary t <= i, which may have flipped unseen.
    """
    n = len(a.nll)
    if len(b.nll) != n:
        raise ValueError(f"the traces have {n} and {len(b.nll)} predictions")
    diff = np.abs(a.nll - b.nll)
    both_nan = np.isnan(a.nll) & np.isnan(b.nll)
    events: list[tuple[float, str, str | None]] = []  # (time, what, cause if a near-tie)
    if (i := _first(np.where(both_nan, False, ~(diff <= NLL_BOUND)))) is not None:
        events.append((i, f"NLL of query {i} differs by {diff[i]:.3g}", None))
    if (i := _first(a.correct.astype(bool) != b.correct.astype(bool))) is not None:
        margins = [m[i] for m in (a.margin, b.margin) if m is not None and not np.isnan(m[i])]
        margin = min(margins, default=math.nan)
        cause = f"correct near-tie (margin {margin:.2g})" if margin < CORRECT_MARGIN else None
        events.append((i, f"correct of query {i} differs", cause))
    digits = a.score_digits if a.score_digits is not None else b.score_digits
    seen = bool(a.kept) and bool(b.kept)
    if seen:
        differing = [t for t in sorted(set(a.kept) | set(b.kept)) if a.kept.get(t) != b.kept.get(t)]
        if differing:
            t = differing[0]
            heads = _differing_heads(a.kept.get(t), b.kept.get(t))
            margins = _margins(a, b, t)
            flipped = None if margins is None or heads is None else margins[heads]
            near = flipped is not None and bool(np.all(near_tie(flipped, digits)))
            count = "some" if heads is None else len(heads)
            what = f"the decision at boundary {t} kept other entries in {count} (layer, KV head)s"
            cause = f"near-tie decisions there (margins up to {flipped.max():.2g})" if near else None
            events.append((t - 0.5, what, cause))
    if not events:
        return Divergence(None, "", None, float(np.nanmax(diff, initial=0.0)))
    time, what, cause = min(events, key=lambda e: e[0])
    first = math.ceil(time)
    if cause is None and not seen:
        unseen = sorted(t for t in set(a.decisions) | set(b.decisions) if t <= time)
        unseen = [t for t in unseen if np.any(near_tie(_margins(a, b, t), digits))]
        if unseen:
            t = unseen[0]
            margin = (m := _margins(a, b, t))[near_tie(m, digits)].min()
            cause = f"a near-tie decision at boundary {t} (margin {margin:.2g}) before it"
    before = diff[:first][~both_nan[:first]]
    return Divergence(first, what, cause, float(before.max(initial=0.0)))


def _differing_heads(a: list | None, b: list | None) -> np.ndarray | None:
    """Indices of the (layer, head)s whose kept sets differ (None where one side has no decision)."""
    if a is None or b is None or len(a) != len(b):
        return None
    return np.array([k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y], dtype=int)


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None
