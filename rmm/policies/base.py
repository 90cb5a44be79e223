"""The policy interface: pure tensor logic over slot positions and what a chunk let the policy observe.

Shapes use L layers, H KV heads, G query heads per KV head, S candidate slots, Q queries of the current
chunk and D the head dimension. A slot whose position is -1 is empty. Two families exist, each with its
own base class:

- :class:`PositionRule`: ``allowed`` says, for every query, which positions it may see; the engine
  applies it per query, so the result does not depend on the chunk size.
- :class:`ScorePolicy`: after every chunk the engine hands the policy one :class:`Observation` holding
  exactly what its ``needs`` declare; ``observe`` may fold it into per-slot statistics (``state``, one
  [L, H, S] tensor per name in ``state_names``, moved with the slots when the memory compacts). At
  each chunk boundary the engine keeps the ``capacity = B - C + 1`` valid slots with the highest
  ``score`` (ties go to the more recent position).

Attention probabilities are opt-in: a policy that does not need them lets the engine keep PyTorch's
fused scaled-dot-product attention.
"""

from __future__ import annotations

import math
import operator
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from rmm.divergence import TIE_MARGIN

if TYPE_CHECKING:
    from rmm.future import FutureRequests

NEVER = float("inf")

# what a policy may declare in ``needs``: what a chunk records, then the model constants the engine reads
# once per stream (:class:`rmm.engine.StreamingEngine`)
NEEDS = ("attention", "keys", "values", "queries", "outcomes", "gradient", "output_projection", "rotation")

# the oracle's reference pass for a document: tokens [n] -> recorded future requests
ReferencePass = Callable[[torch.Tensor], "FutureRequests"]


class Observation:
    """What one chunk lets a policy see, over the chunk's candidate slots (retained slots, then the chunk).

    Always present:

    key_pos : [L, H, S] long, original positions of the candidate slots (-1 empty).
    query_pos : [Q] long, original positions s of the chunk's queries.

    Present only when the policy's ``needs`` name them (reading another raises a clear error):

    attention (``attention``) : [L, H, Q, S] float32, a_s(j): attention probabilities of the chunk's
        queries, summed over the query heads of each KV head's group; 0 where s cannot see j.
    keys (``keys``) : [L, H, S, D], **unrotated** (pre-RoPE) keys, whatever ``positions`` is, so they
        do not depend on the position mode. Channels past the model's rotary dimension (GPT-NeoX's
        partial rotary) are as the model produced them. A policy whose :attr:`ScorePolicy.cached_keys`
        is set gets them as the cache holds them instead: rotated at their original positions.
    values (``values``) : [L, H, S, D].
    queries (``queries``) : [L, H, G, Q, D], **unrotated** (pre-RoPE) queries of the chunk.
    correct, prob, nll (``outcomes``) : [Q] float32, per query s: 1.0 where argmax p(. | s) = x_{s+1},
        p(x_{s+1} | s), and -log p(x_{s+1} | s); 0.0, 0.0 and 0.0 for the document's last query (no
        target).
    gradient (``gradient``) : [L, H, Q, S] float32, the first-order utility u_s(j) = -dl/dz_{s,j} of
        slot j to query s, summed over the query heads of each KV head's group, where z_{s,j} is the
        attention logit and l is the summed NLL of the chunk's queries (one backward pass per chunk):
        u_s(j) = a_s(j) * (<g_s, o_s> - <g_s, v_j>), g_s = dl/do_s at the head's attention output o_s.
        Positive where attending to j lowered the loss; 0 where s cannot see j. Only this need turns
        on autograd, and only for the chunk's forward pass.

    Model constants, the same at every chunk of a stream (read once per stream, :mod:`rmm.projections`):

    output_projection (``output_projection``) : [L, H, hidden, G * D] float32, the columns of each layer's
        attention output projection W_o that the G query heads of KV head h feed (query head h * G + g
        owns columns [g * D, (g + 1) * D)).
    rotary (``rotation``) : the layers' rotary positions (:class:`rmm.rotary.Rotary`, as calibrated by
        the self-check): ``rotary.rotate(x, delta, layer)`` rotates x [..., P, D] by ``delta`` positions,
        ``rotary.table`` / ``rotary.apply`` the same in two steps.
    """

    key_pos: torch.Tensor
    query_pos: torch.Tensor
    attention: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    correct: torch.Tensor
    prob: torch.Tensor
    nll: torch.Tensor
    gradient: torch.Tensor
    output_projection: torch.Tensor
    rotary: Any

    _NEED_OF = {
        "attention": "attention",
        "keys": "keys",
        "values": "values",
        "queries": "queries",
        "correct": "outcomes",
        "prob": "outcomes",
        "nll": "outcomes",
        "gradient": "gradient",
        "output_projection": "output_projection",
        "rotary": "rotation",
    }

    def __init__(self, key_pos: torch.Tensor, query_pos: torch.Tensor, **fields: torch.Tensor):
        unknown = set(fields) - set(self._NEED_OF)
        if unknown:
            raise TypeError(f"unknown observation fields {sorted(unknown)}")
        self.key_pos, self.query_pos = key_pos, query_pos
        for name, value in fields.items():
            setattr(self, name, value)

    def __getattr__(self, name: str) -> Any:  # only called for fields that were not filled in
        if name in self._NEED_OF:
            where = ""
            if self._NEED_OF[name] in ("output_projection", "rotation"):
                where = " (a model constant, read once per stream: StreamingEngine.plan.constants)"
            raise AttributeError(
                f"the observation has no {name!r}: add {self._NEED_OF[name]!r} to the policy's `needs`{where}"
            )
        raise AttributeError(name)


@dataclass
class Policy(ABC):
    """Base of both families. ``budget`` is B (None for unbounded), ``chunk`` is C.

    Class attributes a policy sets: ``name`` (its registry and config name) and ``needs_reference``
    (it calls the reference pass in :meth:`prepare`). A policy derives from :class:`PositionRule` or
    :class:`ScorePolicy`, never from this class directly.
    """

    budget: int | None
    chunk: int

    name: ClassVar[str] = ""
    needs_reference: ClassVar[bool] = False
    needs_budget: ClassVar[bool] = True  # False: it keeps every entry and ignores a budget (full)

    def __post_init__(self) -> None:
        self.chunk = _integer("chunk", self.chunk)
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")
        if self.budget is None:
            if self.needs_budget:
                raise ValueError(
                    f"policy {self.name} needs a budget: set budget=N (no budget only with policy=full)"
                )
            return
        self.budget = _integer("budget", self.budget)
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")
        if self.chunk > self.budget:
            raise ValueError(
                f"chunk ({self.chunk}) must not exceed budget ({self.budget}); set chunk<={self.budget}"
            )

    @property
    @abstractmethod
    def capacity(self) -> int:
        """Entries kept at a boundary, so that every query sees at most B."""

    def metric_fields(self) -> dict[str, Any]:
        """Top-level metrics this policy contributes to ``metrics.json`` (``lag``: rmm's H, else None)."""
        return {"lag": None}

    def prepare(self, tokens: torch.Tensor, reference: ReferencePass) -> None:  # noqa: B027 (optional hook)
        """Called once per stream ``tokens`` [n] before it is streamed; ``reference(tokens)`` runs the
        reference pass (only policies with ``needs_reference`` may call it)."""


@dataclass
class PositionRule(Policy):
    """A policy that keeps by position alone: ``allowed`` decides for every query which keys it sees."""

    @property
    def capacity(self) -> int:
        """B: a position rule decides per query, so every slot up to the budget stays usable."""
        assert self.budget is not None
        return self.budget

    @property
    def sink_positions(self) -> int:
        """The first positions that stay visible however old they are (attention sinks).

        With ``positions=cache`` their rank differs from their original distance, which the attention
        function corrects per query. 0 by default.
        """
        return 0

    @abstractmethod
    def allowed(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """bool [..., Q, S]: which of the keys [..., S] each query [..., Q] may see (leading dims broadcast:
        the engine passes a batch's queries [N, 1, Q] against keys [..., N, H, S]); index as
        ``query_pos[..., :, None]``."""


def _integer(name: str, value: Any) -> int:
    """``value`` as an int (a Python or NumPy integer, not a bool), or a ValueError naming ``name``."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def every_key(query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """The position rule that allows everything: True [..., Q, S] for queries [..., Q] and keys [..., S]."""
    shape = torch.broadcast_shapes(query_pos[..., :, None].shape, key_pos[..., None, :].shape)
    return torch.ones(shape, dtype=torch.bool, device=key_pos.device)


@dataclass
class ScorePolicy(Policy):
    """A policy that ranks: it observes every chunk and scores the candidates at each boundary.

    Class attributes it sets: ``needs`` (a subset of :data:`NEEDS`), ``state_names`` (per-slot
    statistics it keeps), ``scope_reduce`` (``sum`` or ``max``: how scores combine when heads or
    layers share one set). Selection itself (:mod:`rmm.policies.select`) is not the policy's business.
    """

    needs: ClassVar[frozenset[str]] = frozenset()
    state_names: ClassVar[tuple[str, ...]] = ()
    scope_reduce: ClassVar[str] = "sum"

    def __post_init__(self) -> None:
        unknown = set(self.needs) - set(NEEDS)
        if unknown:
            raise TypeError(f"{type(self).__name__}.needs has unknown entries {sorted(unknown)}; use {NEEDS}")
        super().__post_init__()

    @property
    def capacity(self) -> int:
        """B' = B - C + 1: entries kept at a boundary, so that the chunk's last query sees at most B."""
        assert self.budget is not None
        return self.budget - self.chunk + 1

    @property
    def protected(self) -> int:
        """Number of most recent positions that are never ranked (a recent window); 0 by default."""
        return 0

    @property
    def always_kept(self) -> int:
        """The most entries a boundary keeps whatever their scores (infinite priority): the recent window
        (:attr:`protected`) and any other always-kept positions (sinks). A capacity must exceed it for the
        policy to rank anything (the pyramid's smallest layer:
        :func:`rmm.policies.select.pyramid_capacities`)."""
        return self.protected

    @property
    def score_digits(self) -> int | None:
        """The significant digits at which the scores are compared (:func:`significant`), None where they
        are compared unrounded; it sets what counts as a near-tie decision (:mod:`rmm.divergence`)."""
        return None

    @property
    def lookback(self) -> int:
        """How many positions behind the previous boundary :meth:`observe` reads entries' keys or values
        (0: only what the chunk attended). A layer whose own window hides entries sooner is refused."""
        return 0

    @property
    def cached_keys(self) -> bool:
        """Whether the observation's ``keys`` are the keys as the model's cache holds them, rotated at
        their original positions (what kvpress's presses score after a prefill), instead of unrotated.
        Only under ``positions=original``, where the memory stores exactly those keys
        (:func:`rmm.planning.recording_plan` refuses ``positions=cache``). False by default."""
        return False

    def observe(self, state: dict[str, torch.Tensor], obs: Observation) -> None:
        """Update ``state`` ([L, H, S] each) in place from the chunk's observation."""

    def score_bounds(
        self, state: dict[str, torch.Tensor], obs: Observation, now: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For a policy whose scores count comparisons of a statistic with a threshold (``a >= tau``): the
        scores [L, H, S] had every comparison within :data:`rmm.divergence.TIE_MARGIN` of the threshold
        (relative, :func:`threshold_distance`) gone the lowering way, the same the raising way, and each
        slot's smallest such distance [L, H, S] (inf where none). They make the threshold part of the
        decision's margin (:func:`rmm.policies.select.threshold_margin`). None (default): no threshold."""
        return None

    @abstractmethod
    def score(self, state: dict[str, torch.Tensor], obs: Observation, now: int) -> torch.Tensor:
        """Retention priority [L, H, S] at boundary ``now`` (the next query's position); higher keeps.

        ``obs`` is the observation of the chunk that just ended (its candidates are the slots ranked).
        """


# every policy by its ``name``, filled by :func:`register` as rmm.policies imports each policy's module
POLICIES: dict[str, type[Policy]] = {}
P = TypeVar("P", bound=type[Policy])


def registry(
    classes: Iterable[type[Policy]], table: dict[str, type[Policy]] | None = None
) -> dict[str, type[Policy]]:
    """``table`` (default a new one) with ``classes`` added by their ``name``; a class without a name, or
    a second class with a name already there, is refused."""
    table = {} if table is None else table
    for cls in classes:
        if not cls.name:
            raise TypeError(f"policy class {cls.__name__} sets no `name`")
        if table.get(cls.name, cls) is not cls:
            raise ValueError(
                f"two policies are named {cls.name!r}: {table[cls.name].__name__} and {cls.__name__}"
            )
        table[cls.name] = cls
    return table


def register(cls: P) -> P:
    """Class decorator of a policy: add it to :data:`POLICIES` (``@register`` above ``@dataclass``).
    Its abstract methods are enforced when it is built (a ScorePolicy without ``score`` is refused)."""
    registry([cls], POLICIES)
    return cls


@dataclass
class RecentRatioPolicy(ScorePolicy):
    """A score-based policy that always keeps its r = floor(rho * B') most recent positions."""

    rho: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.rho < 1.0:
            raise ValueError(f"policy.rho must be in [0, 1), got {self.rho}")

    @property
    def protected(self) -> int:
        """floor(rho * B'), the product rounded to 9 decimals first: a decimal rho counts as written
        (0.29 * 100 is 28.999999999999996 in binary floating point, and r is 29)."""
        return math.floor(round(self.rho * self.capacity, 9))


# ``policy.variant`` of the policies named after a kvpress press (knorm, keydiff, lagkv, snapkv, tova,
# observed_attention): the harness's definition (default), or the press's own score on the same state
# (docs/semantics.md; tests/test_kvpress_parity.py checks it against kvpress itself)
KVPRESS_VARIANTS = ("harness", "kvpress")


def check_variant(variant: str) -> None:
    """``policy.variant`` must be one of :data:`KVPRESS_VARIANTS`."""
    if variant not in KVPRESS_VARIANTS:
        raise ValueError(f"policy.variant must be one of {KVPRESS_VARIANTS}, got {variant!r}")


def check_protected(name: str, value: int, capacity: int) -> None:
    """A recent window of ``value`` positions must leave room to rank at a boundary of ``capacity``."""
    if value >= capacity:
        raise ValueError(
            f"{name} ({value}) must be smaller than the room at a boundary, budget - chunk + 1 = "
            f"{capacity}; lower {name} or chunk, or raise budget"
        )


def protect_recent(scores: torch.Tensor, key_pos: torch.Tensor, now: int, recent: int) -> torch.Tensor:
    """Give the ``recent`` most recent positions (``now - recent <= j``) infinite priority."""
    return torch.where(key_pos >= now - recent, torch.full_like(scores, NEVER), scores)


# significant decimal digits at which scores that can tie in exact arithmetic are compared (key norms,
# key similarities, lagkv's spreads): equal keys then give equal scores whatever the rounding of the
# rotations, and the tie goes to the more recent position, in the engine and the reference alike
SCORE_DIGITS = 4


def significant(scores: torch.Tensor, digits: int = SCORE_DIGITS) -> torch.Tensor:
    """``scores`` rounded (half to even, in float64) to ``digits`` significant decimal digits; zeros and
    infinities unchanged. Returns float64 of the same shape."""
    x = scores.double()
    finite = torch.isfinite(x) & (x != 0)
    magnitude = torch.where(finite, x.abs(), torch.ones_like(x))
    scale = torch.pow(10.0, torch.floor(torch.log10(magnitude)) - (digits - 1))
    return torch.where(finite, torch.round(x / scale) * scale, x)


def threshold_distance(statistic: torch.Tensor, threshold: float) -> torch.Tensor:
    """|statistic / threshold - 1| (float64, the shape of ``statistic``): a comparison of the statistic with
    ``threshold`` closer than :data:`rmm.divergence.TIE_MARGIN` may go the other way on another machine."""
    return (statistic.double() / threshold - 1).abs()


def near_threshold(statistic: torch.Tensor, threshold: float) -> torch.Tensor:
    """Where a comparison of ``statistic`` with ``threshold`` is a near-tie (bool, the same shape)."""
    return threshold_distance(statistic, threshold) < TIE_MARGIN


def weighted_attention(attn: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum_s attn[..., s, j] * weight[s]: attn [L, H, Q, S], weight [Q] -> [L, H, S]."""
    return (attn * weight[:, None]).sum(dim=-2)


def group_size(attention: torch.Tensor) -> torch.Tensor:
    """G [L, H]: how many query heads a group-summed attention [L, H, Q, S] sums over, read as the row sum
    of the chunk's last query (each query head's probabilities sum to 1), rounded; at least 1. (A model
    with learned attention sinks, whose rows sum to less, is not one kvpress supports.)"""
    return attention[:, :, -1, :].sum(dim=-1).round().clamp(min=1.0)


def seen_count(obs: Observation) -> torch.Tensor:
    """Number of the chunk's queries that saw each candidate slot (causal: s >= j): [L, H, S] float32."""
    seen = obs.query_pos[:, None] >= obs.key_pos[..., None, :]  # [L, H, Q, S]
    return (seen & (obs.key_pos[..., None, :] >= 0)).sum(dim=-2).float()


def position_order(key_pos: torch.Tensor) -> torch.Tensor:
    """Slot indices [L, H, S] sorting the candidates by position, oldest first, empty slots last."""
    last = torch.full_like(key_pos, torch.iinfo(torch.long).max)
    return torch.argsort(torch.where(key_pos >= 0, key_pos, last), dim=-1, stable=True)
