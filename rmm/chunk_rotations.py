"""The rotations one pass over a slot memory (:class:`~rmm.memory.SlotMemory`) applies, by how its slots
hold their keys (:class:`KeyStorage`; the cases are described in :mod:`rmm.memory`).

Built at every chunk (:meth:`ChunkRotations.begin`) from the queries' positions [N, Q]; each table is
cos, sin [..., Q or R, rot / 2] of :class:`~rmm.rotary.Rotary`, applied per layer:

- ``unrotate``: the chunk's keys [N, H, Q, D] back to position 0 (by -t under ``ROTATED_AND_RAW``, by
  -model_pos under ``UNROTATED``);
- ``rank_offset``: [L, N, H, R] the cache rank of each retained slot (``UNROTATED``; per head when heads
  hold different counts), its keys rotated to it at use;
- ``query``: the chunk's queries [N, H, G, Q, D] back by -model_pos (a policy reads queries);
- ``sink``: queries [N, H, G, Q, D] to rank min(t, B), for the sink slots (cache positions, a position rule
  with sinks), once some query of the pass is past B;
- ``model_pos``: [N, Q] the positions the queries continue at (original, or the ranks after the retained
  entries under ``UNROTATED``).
"""

from __future__ import annotations

from enum import Enum

import torch

from rmm.recording import RecordingPlan
from rmm.rotary import Rotary, Table


class KeyStorage(Enum):
    """How a slot holds its key (the table in :mod:`rmm.memory`'s docstring)."""

    ROTATED = "rotated"  # as the model rotated it, at its original position
    ROTATED_AND_RAW = "rotated and raw"  # that, plus an unrotated copy for a policy that reads keys
    UNROTATED = "unrotated"  # rotated back to position 0, rotated to its rank at use (cache positions)

    @classmethod
    def of(cls, plan: RecordingPlan) -> KeyStorage:
        if plan.store_unrotated:
            return cls.UNROTATED
        return cls.ROTATED_AND_RAW if plan.raw_keys else cls.ROTATED


class ChunkRotations:
    """The rotation tables of the current pass (shapes in the module docstring), for ``plan``'s storage."""

    def __init__(self, plan: RecordingPlan, rotary: Rotary):
        self.storage, self.rotary = KeyStorage.of(plan), rotary
        self.record_queries, self.n_sink_slots, self.sink_rank = (
            plan.record_queries,
            plan.n_sink_slots,
            plan.sink_rank,
        )
        self.model_pos = torch.empty(0, 0, dtype=torch.long)
        self.unrotate: Table | None = None
        self.rank_offset: torch.Tensor | None = None
        self.query: Table | None = None
        self.sink: Table | None = None

    def begin(self, query_pos: torch.Tensor, retained_pos: torch.Tensor, reach: int) -> torch.Tensor:
        """The pass's tables for queries at ``query_pos`` [N, Q] over the retained slots' positions
        ``retained_pos`` [L, N, H, R] (-1 empty); ``reach``: the last real query's position. Returns the
        positions the queries continue at [N, Q]."""
        self.sink = None
        if self.n_sink_slots and reach > self.sink_rank:
            delta = query_pos.clamp(max=self.sink_rank) - query_pos  # rank min(t, B) minus t
            self.sink = self.rotary.table(delta[:, None, None, :])  # for queries [N, H, G, Q, D]
        self.model_pos = query_pos
        self.unrotate, self.rank_offset = None, None
        if self.storage is KeyStorage.ROTATED_AND_RAW:
            self.unrotate = self.rotary.table(-query_pos[:, None, :])  # for keys [N, H, Q, D]
        elif self.storage is KeyStorage.UNROTATED:
            counts = (retained_pos >= 0).sum(dim=-1)  # [L, N, H]
            n_kept = counts.amax(dim=(0, 2))  # [N]
            step = torch.arange(query_pos.shape[1], device=query_pos.device)
            self.model_pos = n_kept[:, None] + step
            self.unrotate = self.rotary.table(-self.model_pos[:, None, :])
            # a head holding fewer entries than its row's fullest: its ranks end at n_kept - 1
            lag = n_kept[None, :, None] - counts  # [L, N, H]
            self.rank_offset = lag[..., None] + torch.arange(retained_pos.shape[-1], device=query_pos.device)
        if self.record_queries:
            self.query = self.rotary.table(-self.model_pos[:, None, None, :])
        return self.model_pos

    def unrotated_keys(self, key: torch.Tensor, layer: int) -> torch.Tensor:
        """The chunk's keys [N, H, Q, D] as the model rotated them, back to position 0."""
        return self.rotary.apply(key, self.unrotate, layer)

    def ranked_keys(self, keys: torch.Tensor, layer: int) -> torch.Tensor:
        """Retained unrotated keys [N, H, R, D] rotated to their cache ranks."""
        ranks = self.rotary.table(self.rank_offset[layer])  # [N, H, R] -> cos, sin [N, H, R, rot / 2]
        return self.rotary.apply(keys, ranks, layer)

    def unrotated_queries(self, query: torch.Tensor, layer: int) -> torch.Tensor:
        """The chunk's queries [N, H, G, Q, D] as the model rotated them, back by -model_pos."""
        return self.rotary.apply(query, self.query, layer)

    def sink_queries(self, query: torch.Tensor, layer: int) -> torch.Tensor | None:
        """Queries [N, H, G, Q, D] re-rotated to their cache rank for the sink slots; None if not needed."""
        return None if self.sink is None else self.rotary.apply(query, self.sink, layer)
