"""The recording plan of a stream: which buffers the slot memory holds and how chunks are streamed.

Derived once from (policy, positions) by :func:`rmm.planning.recording_plan`. The engine, the memory
(:class:`~rmm.memory.SlotMemory` takes the plan, never the policy) and the memory planner
(checks/plan.py) all read this one plan; this module knows no policy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

# Position rules decide per query, so their results do not depend on how many tokens one forward pass
# takes; without recorded attention a pass takes max(C, min(R, this many)) tokens: long passes amortise
# the per-pass work, and a pass of at most R keeps a query's slots within twice what it may attend
# (an ad hoc measurement with this constant patched, SmolLM2 on 2 CPU cores, B = 256, 2026-12-05:
# 256-token passes ran window 1.15x as fast as 1024-token ones at 4 and 8 documents per pass, 0.97x at 1).
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
    pass_limit : the most tokens one pass may take (a model that selects keys by a bias per key within
        its keep window: :func:`rmm.model_config.key_bias_window`); None: no limit.
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
    pass_limit: int | None = None

    @property
    def chunk(self) -> int:
        """Tokens per forward pass: C for score-based policies and whenever attention is recorded,
        max(C, min(R, POSITION_RULE_CHUNK)) for position rules otherwise (R unbounded: the constant), at
        most ``pass_limit`` (never below C, which the planner keeps within it)."""
        if self.record_attention or self.rule is None:
            return self.decision_chunk
        longest = POSITION_RULE_CHUNK if self.retained is None else min(self.retained, POSITION_RULE_CHUNK)
        if self.pass_limit is not None:
            longest = min(longest, self.pass_limit)
        return max(self.decision_chunk, longest)

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
