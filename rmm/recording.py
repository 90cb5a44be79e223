"""The recording plan of a stream: which buffers the slot memory holds and how chunks are streamed.

Derived once from (policy, positions) by :func:`recording_plan`. The engine, the memory
(:class:`~rmm.memory.SlotMemory` takes the plan, never the policy) and the memory planner
(checks/plan.py) all read this one plan, so the rules below are written only here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from rmm.options import POSITIONS
from rmm.policies import Policy, PositionRule, ScorePolicy
from rmm.policies.select import retained_slots

# Position rules decide per query, so their results do not depend on how many tokens one forward pass
# takes; without recorded attention they stream in chunks of at least this many tokens (the decision
# chunk C and the budget B do not limit them).
POSITION_RULE_CHUNK = 1024

# a position rule: allowed(query_pos [..., Q], key_pos [..., S]) -> bool [..., Q, S] (broadcast)
AllowedFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RecordingPlan:
    """What one stream records.

    rule : the position rule, applied per query; None for a score-based policy (it ranks at boundaries).
    retained : R, slots kept across boundaries: B' under uniform allocation, the largest per-head
        capacity otherwise (:func:`rmm.policies.select.retained_slots`), or the widest window of an
        exempt layer; None when unbounded (R is then the stream length). ``capacity`` always means what
        a (layer, KV head) may keep (B', or c_{l,h} under an allocation); R is the slots that hold it.
    decision_chunk : C, tokens between two boundaries.
    record_attention : attention probabilities [L, H, C, S] are computed and kept (the eager path).
    record_queries : the chunk's unrotated queries [L, H, G, C, D] are kept.
    raw_keys : a second, unrotated copy of the keys is kept (original positions, a policy reads keys,
        unless it reads them as cached: ``ScorePolicy.cached_keys``).
    store_unrotated : keys are stored unrotated and rotated to their rank at use (cache positions,
        score-based policies).
    track_gradient : the chunk's forward pass runs with autograd for the gradient utility [L, H, C, S].
    n_sink_slots : the first slots whose keys a query sees re-rotated to its rank min(t, sink_rank)
        (cache positions, a position rule with attention sinks); 0 otherwise.
    sink_rank : B, the largest rank of a query under cache positions (read when n_sink_slots > 0).
    state_names : the policy's per-slot statistics [L, H, S], moved with the slots.
    exempt : per layer, whether the policy leaves it alone (``layers=global``: a windowed layer keeps
        whatever its own window shows); empty when the policy applies to every layer.
    """

    rule: AllowedFn | None
    retained: int | None
    decision_chunk: int
    record_attention: bool
    record_queries: bool
    raw_keys: bool
    store_unrotated: bool
    track_gradient: bool
    n_sink_slots: int
    sink_rank: int | None
    state_names: tuple[str, ...]
    exempt: tuple[bool, ...] = ()

    @property
    def chunk(self) -> int:
        """Tokens per forward pass: C for score-based policies and whenever attention is recorded,
        max(C, POSITION_RULE_CHUNK) for position rules otherwise."""
        if self.record_attention or self.rule is None:
            return self.decision_chunk
        return max(self.decision_chunk, POSITION_RULE_CHUNK)

    def slots(self, n_tokens: int) -> tuple[int, int]:
        """(R, Q): retained and chunk slots of the memory for an ``n_tokens`` stream."""
        retained = n_tokens if self.retained is None else self.retained
        return retained, min(self.chunk, n_tokens)

    def exempting(self, windows: list[int | None]) -> RecordingPlan:
        """The plan with the policy applied to global layers only: every windowed layer (``windows``: the
        past entries each layer's window shows, None for a global layer) keeps what its window shows, so
        R grows to the largest window where that exceeds the policy's capacity."""
        exempt = tuple(w is not None for w in windows)
        if not any(exempt):
            return self
        widest = max(w for w in windows if w is not None)
        retained = None if self.retained is None else max(self.retained, widest)
        return replace(self, exempt=exempt, retained=retained)

    @property
    def moves_positions(self) -> bool:
        """Whether a stream under this plan rotates keys or queries to positions other than the model's."""
        return self.store_unrotated or self.raw_keys or self.record_queries or self.n_sink_slots > 0

    def observed(self) -> RecordingPlan:
        """The plan with attention recorded for an observer of every chunk."""
        return replace(self, record_attention=True)


def recording_plan(
    policy: Policy, positions: str, allocation: str = "uniform", shape: tuple[int, int] | None = None
) -> RecordingPlan:
    """The recording plan of ``policy`` under ``positions`` (``original`` or ``cache``) and the budget
    ``allocation`` over ``shape`` = (n_layers, n_kv_heads) (needed unless ``allocation`` is uniform)."""
    check_positions(policy, positions)
    retained = None if policy.budget is None else policy.capacity
    if isinstance(policy, PositionRule):
        return RecordingPlan(
            rule=policy.allowed,
            retained=retained,
            decision_chunk=policy.chunk,
            record_attention=False,
            record_queries=False,
            raw_keys=False,
            store_unrotated=False,
            track_gradient=False,
            n_sink_slots=policy.sink_positions if positions == "cache" else 0,
            sink_rank=policy.budget,
            state_names=(),
        )
    if not isinstance(policy, ScorePolicy):
        raise TypeError(f"{type(policy).__name__} must derive from PositionRule or ScorePolicy")
    if retained is not None and allocation != "uniform":
        if shape is None:
            raise ValueError(f"allocation={allocation} needs the model's (n_layers, n_kv_heads)")
        retained = retained_slots(allocation, retained, policy.protected, *shape)
    needs = policy.needs
    store_unrotated = positions == "cache"
    return RecordingPlan(
        rule=None,
        retained=retained,
        decision_chunk=policy.chunk,
        # the gradient utility is built from the attention probabilities
        record_attention=bool({"attention", "gradient"} & needs),
        record_queries="queries" in needs,
        # a policy that reads the keys as cached reads the memory's own (rotated) keys
        raw_keys="keys" in needs and not store_unrotated and not policy.cached_keys,
        store_unrotated=store_unrotated,
        track_gradient="gradient" in needs,
        n_sink_slots=0,
        sink_rank=policy.budget,
        state_names=tuple(policy.state_names),
    )


def check_positions(policy: Policy, positions: str) -> None:
    """Refuse an unknown ``positions``, and ``positions=cache`` for a policy that reads keys as cached
    (:attr:`ScorePolicy.cached_keys`): there the memory holds keys unrotated and rotates them to a new rank
    at every chunk."""
    if positions not in POSITIONS:
        raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")
    if positions == "cache" and isinstance(policy, ScorePolicy) and policy.cached_keys:
        raise ValueError(
            f"policy {policy.name} with policy.variant={getattr(policy, 'variant', None)} scores the keys "
            "as the cache holds them at their original positions, which positions=cache does not keep; "
            "use positions=original"
        )
