"""A fixed-size slot memory per (layer, KV head): retained entries plus the current chunk.

Layout along the slot axis: ``[0, R)`` retained entries, kept sorted by original position with empty
slots (position -1) last, then ``[R, R + Q)`` the chunk being processed. Its size never depends on the
stream length. R is the slots that hold the retained entries; ``capacity`` elsewhere is what one
(layer, KV head) may keep (B', or c_{l,h} under an allocation), never R.

How a slot holds its key is one of three cases (:class:`KeyStorage`, chosen from the plan), plus two
rotations that apply in any case. Queries continue at ``model_pos``: their original positions, or under
``cache`` positions the ranks after the retained entries.

- ``ROTATED`` (original positions): a slot holds the key as the model rotated it at t; attended as stored.
- ``ROTATED_AND_RAW`` (original positions, a policy reads keys): that, plus an unrotated copy; at
  ``begin_chunk`` the table to -t, at ``attend_keys_values`` the chunk's keys rotated back into the copy.
- ``UNROTATED`` (cache positions, score-based): the key rotated back to position 0; at ``begin_chunk``
  the table to -model_pos and the rank tables (per head when heads hold different counts); at
  ``attend_keys_values`` the chunk's keys rotated back and stored, the retained ones rotated to rank.
- sinks (cache positions, a position rule with sinks; keys as ``ROTATED``): at ``begin_chunk`` the
  query's table to rank min(t, B); the attention function re-rotates the query for the sink slots
  (:mod:`rmm.integration`).
- queries (a policy reads queries): the chunk's queries [L, H, G, C, D], rotated back by -model_pos.

Why ``UNROTATED`` for cache positions: score-based policies keep a boundary's set fixed for the whole
chunk, so ranks are the same for every query. Position rules change the set per query; there the
relative distance of every non-sink key equals its original distance, and only the sinks need the query
re-rotated to its rank, which is done exactly per query.

The memory never sees a policy: which buffers exist is said by its :class:`~rmm.recording.RecordingPlan`,
and what it keeps at a boundary by the keep mask handed to :meth:`SlotMemory.compact`. What a policy
observes after a chunk (:meth:`SlotMemory.observed`) is read from these slots; keys and queries are
handed over unrotated in every case.

A policy that needs ``gradient`` turns on gradient tracking: the chunk's forward pass runs with autograd
(only that pass), the chunk's own keys and values keep their graph inside the pass so that the loss of a
later query of the chunk reaches an earlier query's hidden states, and one backward pass of the chunk's
summed NLL gives each layer's dl/do at the attention output (:func:`record_gradients`). Slots
always hold detached tensors, so no graph outlives the chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import torch

from rmm.recording import RecordingPlan
from rmm.rotary import Rotary, Table

# a layer's own window: (query_pos [Q], key_pos [..., S]) -> bool [..., Q, S], hashable (one per layer type)
LayerWindow = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class KeyStorage(Enum):
    """How a slot holds its key (the table in the module docstring)."""

    ROTATED = "rotated"  # as the model rotated it, at its original position
    ROTATED_AND_RAW = "rotated and raw"  # that, plus an unrotated copy for a policy that reads keys
    UNROTATED = "unrotated"  # rotated back to position 0, rotated to its rank at use (cache positions)

    @classmethod
    def of(cls, plan: RecordingPlan) -> KeyStorage:
        if plan.store_unrotated:
            return cls.UNROTATED
        return cls.ROTATED_AND_RAW if plan.raw_keys else cls.ROTATED


class SlotMemory:
    """Bounded KV memory for one stream; the attention function reads and writes it layer by layer.

    Parameters
    ----------
    plan : which buffers exist (:func:`rmm.recording.recording_plan`).
    shape : (n_layers, n_kv_heads, head_dim).
    retained : R, slots for entries kept across boundaries (B for position rules, B - C + 1 otherwise, or
        the largest per-head capacity under a non-uniform budget allocation).
    chunk : C, slots for the chunk.
    """

    def __init__(
        self,
        plan: RecordingPlan,
        shape: tuple[int, int, int],
        retained: int,
        chunk: int,
        rotary: Rotary,
        dtype: torch.dtype,
        device: torch.device,
    ):
        n_layers, n_heads, head_dim = shape
        slots = retained + chunk
        self.plan, self.retained, self.chunk = plan, retained, chunk
        self.rotary = rotary
        self.storage = storage = KeyStorage.of(plan)
        self.record_attention = record_attention = plan.record_attention
        self.track_gradient = plan.track_gradient
        if self.track_gradient and not record_attention:
            raise ValueError("gradient tracking needs attention probabilities: record_attention must be set")
        self.keys = torch.zeros(n_layers, n_heads, slots, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        # ROTATED_AND_RAW: a second, unrotated copy, filled as keys arrive
        self.raw_keys = torch.zeros_like(self.keys) if storage is KeyStorage.ROTATED_AND_RAW else None
        self.key_pos = torch.full((n_layers, n_heads, slots), -1, dtype=torch.long, device=device)
        self.state = {name: torch.zeros(n_layers, n_heads, slots, device=device) for name in plan.state_names}
        self.attn = torch.zeros(n_layers, n_heads, chunk, slots, device=device) if record_attention else None
        # gradient tracking: u_s(j) of the last chunk [L, H, C, R + C], and what each layer's attention
        # used during the chunk's forward pass: (layer, probs [H, G, Q, S], values [H, S, D], output)
        self.utility = torch.zeros_like(self.attn) if self.track_gradient else None
        self._outputs: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.record_queries = plan.record_queries
        self.queries: torch.Tensor | None = None  # [L, H, G, C, D] unrotated, allocated at the first store
        self._query_table: Table | None = None
        self.n_sink_slots = plan.n_sink_slots
        self._rank_table = (
            rotary.table(torch.arange(retained, device=device)) if storage is KeyStorage.UNROTATED else None
        )
        self._unrotate_table: Table | None = None
        # cache positions, heads holding different numbers of entries: per-head rank tables [L, H, R, .]
        self._layer_ranks: Table | None = None
        # filled by begin_chunk
        self.query_pos = torch.empty(0, dtype=torch.long, device=device)
        self.model_pos = self.query_pos
        self._allowed = torch.empty(0, dtype=torch.bool, device=device)
        self._blocked: torch.Tensor | None = None  # ~allowed, for the eager path only
        self._sink_table: Table | None = None
        self._other_bias: torch.Tensor | None = None  # sink slots and blocked -inf, else 0 (model dtype)
        # the model's own window per layer (set by the attention function each pass; None: plain causal),
        # and the masks of a windowed layer for this chunk: layer -> (allowed, blocked, other bias)
        self._visible: dict[int, LayerWindow | None] = {}
        self._layer_masks: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = {}
        self._shared_masks: dict[
            LayerWindow, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
        ] = {}
        # position rules: the first layer the rule applies to (the others it applies to hold the same set)
        self._ruled = next((layer for layer, exempt in enumerate(plan.exempt) if not exempt), 0)
        self.calls = [0] * n_layers  # attention calls per layer since the memory was made
        self.passes = 0  # forward passes (chunks) begun
        # called by the attention function with (layer, query [H, G, Q, D], key [H, Q, D]) as the model
        # produced them (the self-check reads the model's own rotation this way)
        self.capture: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None

    # ---- chunk setup (engine) -------------------------------------------------------------------
    def begin_chunk(self, query_pos: torch.Tensor) -> torch.Tensor:
        """Prepare slots and masks for queries at original positions ``query_pos`` [Q].

        Returns the position ids [Q] to feed the model.
        """
        n_q, end = query_pos.numel(), self.retained + query_pos.numel()
        self.query_pos = query_pos
        self.passes += 1
        self._layer_masks.clear()
        self._shared_masks.clear()
        self.key_pos[:, :, self.retained :] = -1
        self.key_pos[:, :, self.retained : end] = query_pos
        for tensor in self.state.values():
            tensor[:, :, self.retained :] = 0
        key_pos = self.key_pos[:, :, :end]
        if self.plan.rule is not None:
            # position rules give every layer and head they apply to the same set
            shared = key_pos[self._ruled : self._ruled + 1, :1]
            allowed = (shared[..., None, :] >= 0) & (shared[..., None, :] <= query_pos[:, None])
            self._allowed = allowed & self.plan.rule(query_pos, shared)
        else:
            self._allowed = (key_pos[..., None, :] >= 0) & (key_pos[..., None, :] <= query_pos[:, None])
        self._blocked = ~self._allowed if self.record_attention or self.n_sink_slots else None
        self._sink_table, self._other_bias = None, None
        if self.n_sink_slots:
            delta = query_pos.clamp(max=self.plan.sink_rank) - query_pos  # rank min(t, B) minus t
            if bool((delta != 0).any()):
                self._sink_table = self.rotary.table(delta)
                self._other_bias = self._other_slots_bias(self._allowed)
        self.model_pos = query_pos
        self._unrotate_table, self._layer_ranks = None, None
        if self.storage is KeyStorage.ROTATED_AND_RAW:
            self._unrotate_table = self.rotary.table(-query_pos)
        elif self.storage is KeyStorage.UNROTATED:
            counts = (self.key_pos[:, :, : self.retained] >= 0).sum(dim=-1)  # [L, H]
            n_kept = int(counts.max())
            self.model_pos = n_kept + torch.arange(n_q, device=query_pos.device)
            self._unrotate_table = self.rotary.table(-self.model_pos)
            if bool((counts != n_kept).any()):  # a head holding fewer entries: ranks end at n_kept - 1
                offset = (n_kept - counts)[..., None] + torch.arange(self.retained, device=counts.device)
                self._layer_ranks = self.rotary.table(offset)  # [L, H, R, rot_dim / 2] per rotation
        if self.record_queries:
            self._query_table = self.rotary.table(-self.model_pos)
        return self.model_pos

    # ---- attention function (per layer) ----------------------------------------------------------
    def attend_keys_values(self, layer: int, key: torch.Tensor, value: torch.Tensor):
        """Store the chunk's key/value [H, Q, D]; return the keys and values to attend [H, R + Q, D]."""
        end = self.retained + key.shape[1]
        graph_key, graph_value = key, value
        key, value = key.detach(), value.detach()  # slots never hold a graph
        self.values[layer, :, self.retained : end] = value
        if self.storage is KeyStorage.UNROTATED:
            self.keys[layer, :, self.retained : end] = self.rotary.apply(key, self._unrotate_table, layer)
            ranks = self._rank_table
            if self._layer_ranks is not None:
                ranks = {key: (cos[layer], sin[layer]) for key, (cos, sin) in self._layer_ranks.items()}
            kept = self.rotary.apply(self.keys[layer, :, : self.retained], ranks, layer)
        else:
            self.keys[layer, :, self.retained : end] = key
            if self.storage is KeyStorage.ROTATED_AND_RAW:
                self.raw_keys[layer, :, self.retained : end] = self.rotary.apply(
                    key, self._unrotate_table, layer
                )
            kept = self.keys[layer, :, : self.retained]
        if self.track_gradient:  # the chunk's own keys and values keep the pass's graph
            chunk_values = torch.cat([self.values[layer, :, : self.retained], graph_value], dim=1)
            return torch.cat([kept, graph_key], dim=1), chunk_values
        if self.storage is KeyStorage.UNROTATED:
            return torch.cat([kept, key], dim=1), self.values[layer, :, :end]
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def enter_layer(self, layer: int, visible: LayerWindow | None) -> None:
        """Called by the attention function once per layer and pass: counts the call and applies the
        layer's own window ``visible`` (None: plain causal) to its masks for this chunk."""
        self.calls[layer] += 1
        self._visible[layer] = visible
        if visible is None:
            self._layer_masks.pop(layer, None)
            return
        shared = self._allowed.shape[0] == 1
        exempt = bool(self.plan.exempt) and self.plan.exempt[layer]
        if shared and (visible, exempt) in self._shared_masks:
            self._layer_masks[layer] = self._shared_masks[visible, exempt]
            return
        base = self._allowed[0 if shared else layer]  # [H or 1, Q, S]
        row = layer if exempt or not shared else self._ruled  # the key positions ``base`` was built from
        key_pos = self.key_pos[row, : base.shape[0], : base.shape[-1]]
        if exempt:  # no position rule: the layer's own window decides
            base = (key_pos[..., None, :] >= 0) & (key_pos[..., None, :] <= self.query_pos[:, None])
        allowed = base & visible(self.query_pos, key_pos.clamp_min(0))
        blocked = ~allowed if self._blocked is not None else None
        bias = self._other_slots_bias(allowed) if self._other_bias is not None else None
        self._layer_masks[layer] = (allowed, blocked, bias)
        if shared:
            self._shared_masks[visible, exempt] = self._layer_masks[layer]

    def _other_slots_bias(self, allowed: torch.Tensor) -> torch.Tensor:
        """Additive mask in the model's dtype: 0 where ``allowed`` lets a query attend a non-sink slot,
        -inf on the sink slots and wherever it blocks (see :meth:`other_slots_bias`)."""
        other = allowed.clone()
        other[..., : self.n_sink_slots] = False
        bias = torch.zeros(other.shape, dtype=self.keys.dtype, device=other.device)
        return bias.masked_fill_(~other, float("-inf"))

    def allowed_mask(self, layer: int) -> torch.Tensor:
        """bool [H or 1, Q, R + Q]: which slots each query of the chunk may attend."""
        if layer in self._layer_masks:
            return self._layer_masks[layer][0]
        return self._allowed[0] if self._allowed.shape[0] == 1 else self._allowed[layer]

    def blocked_mask(self, layer: int) -> torch.Tensor | None:
        """The complement of :meth:`allowed_mask` (computed once per chunk where the eager path or the
        sinks need it; None otherwise)."""
        if layer in self._layer_masks:
            return self._layer_masks[layer][1]
        if self._blocked is None:
            return None
        return self._blocked[0] if self._blocked.shape[0] == 1 else self._blocked[layer]

    def other_slots_bias(self, layer: int) -> torch.Tensor:
        """Additive mask [H or 1, Q, R + Q] in the model's dtype: 0 where a query may attend a non-sink
        slot, -inf on the sink slots and wherever :meth:`allowed_mask` blocks (set with the sink table)."""
        assert self._other_bias is not None
        if layer in self._layer_masks:
            return self._layer_masks[layer][2]
        return self._other_bias[0] if self._other_bias.shape[0] == 1 else self._other_bias[layer]

    def sink_query(self, layer: int, query: torch.Tensor) -> torch.Tensor | None:
        """Queries [H, G, Q, D] re-rotated to their cache rank, for the sink slots; None if not needed (and
        in a layer the policy leaves alone, which holds no sinks)."""
        if self._sink_table is None or (self.plan.exempt and self.plan.exempt[layer]):
            return None
        return self.rotary.apply(query, self._sink_table, layer)

    def store_attention(self, layer: int, probs: torch.Tensor) -> None:
        """Attention probabilities [H, Q, R + Q] of the chunk's queries, GQA group summed."""
        self.attn[layer, :, : probs.shape[1], : probs.shape[2]] = probs.detach()

    def track_output(
        self, layer: int, probs: torch.Tensor, values: torch.Tensor, output: torch.Tensor
    ) -> torch.Tensor:
        """Gradient tracking: remember a layer's attention probabilities [H, G, Q, S] (float32), the values
        [H, S, D] and its output o [H, G, Q, D] = probs . values, so that :func:`record_gradients` can
        differentiate the chunk's loss with respect to o.

        Returns o, plus a zero leaf that requires grad when nothing before it does (the first layer of a
        model whose weights need no grad), so that the loss has a graph back to every layer's output.
        """
        if not output.requires_grad:
            output = output + torch.zeros_like(output, requires_grad=True)
        self._outputs.append((layer, probs.detach(), values.detach(), output))
        return output

    def take_outputs(self) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The outputs :meth:`track_output` remembered during the pass (cleared); zeroes :attr:`utility`."""
        outputs, self._outputs = self._outputs, []
        self.utility.zero_()
        return outputs

    def store_utility(
        self, outputs: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]], grads: list[torch.Tensor]
    ) -> None:
        """u_s(j) = a_s(j) * (<g_s, o_s> - <g_s, v_j>) with g_s = dl/do_s, summed over each KV head's query
        heads, into :attr:`utility`, from the pass's ``outputs`` and their gradients ``grads``."""
        for (layer, probs, values, output), grad in zip(outputs, grads, strict=True):
            grad, output = grad.float(), output.detach().float()
            reach = (grad * output).sum(dim=-1, keepdim=True)  # <g_s, o_s>: [H, G, Q, 1]
            per_value = torch.matmul(grad, values.float()[:, None].transpose(-1, -2))  # <g_s, v_j>
            utility = (probs * (reach - per_value)).sum(dim=1)  # [H, Q, S]
            self.utility[layer, :, : utility.shape[1], : utility.shape[2]] = utility

    def store_queries(self, layer: int, query: torch.Tensor) -> None:
        """The chunk's queries [H, G, Q, D] as the model rotated them; kept unrotated."""
        if self.queries is None:
            n_heads, group, _, head_dim = query.shape
            self.queries = query.new_zeros(self.keys.shape[0], n_heads, group, self.chunk, head_dim)
        self.queries[layer, :, :, : query.shape[2]] = self.rotary.apply(
            query.detach(), self._query_table, layer
        )

    # ---- statistics (engine) -------------------------------------------------------------------
    def chunk_attention(self) -> torch.Tensor:
        """[L, H, Q, R + Q] attention of the last chunk."""
        n_q = self.query_pos.numel()
        return self.attn[:, :, :n_q, : self.retained + n_q]

    def chunk_key_pos(self) -> torch.Tensor:
        """[L, H, R + Q] original positions of the candidate slots (-1 empty)."""
        return self.key_pos[:, :, : self.retained + self.query_pos.numel()]

    def retained_positions(self) -> torch.Tensor:
        """[L, H, R] positions held across the last boundary (-1 empty)."""
        return self.key_pos[:, :, : self.retained]

    def state_view(self) -> dict[str, torch.Tensor]:
        """The policy's per-slot statistics over the candidate slots, [L, H, R + Q] each (views)."""
        n = self.retained + self.query_pos.numel()
        return {name: tensor[:, :, :n] for name, tensor in self.state.items()}

    def observed(self, needs: frozenset[str]) -> dict[str, torch.Tensor]:
        """The chunk's recorded fields of an observation, exactly those ``needs`` names from
        ``attention``, ``keys``, ``values``, ``queries`` and ``gradient`` (shapes:
        :class:`~rmm.policies.Observation`)."""
        n, n_q = self.retained + self.query_pos.numel(), self.query_pos.numel()
        fields: dict[str, torch.Tensor] = {}
        if "attention" in needs:
            fields["attention"] = self.chunk_attention()
        if "keys" in needs:
            keys = self.keys[:, :, :n]
            fields["keys"] = keys if self.raw_keys is None else self.raw_keys[:, :, :n]
        if "values" in needs:
            fields["values"] = self.values[:, :, :n]
        if "queries" in needs:
            fields["queries"] = self.queries[:, :, :, :n_q]
        if "gradient" in needs:
            fields["gradient"] = self.utility[:, :, :n_q, :n]
        return fields

    def attended_total(self) -> float:
        """Past entries (itself excluded) attended by the chunk's queries, averaged over layers and
        heads, summed over queries."""
        if not self._layer_masks:
            return float((self._allowed.sum(dim=-1) - 1).float().mean(dim=(0, 1)).sum())
        counts = (self._allowed.sum(dim=-1) - 1).float()  # [L or 1, H or 1, Q]
        counts = counts.expand(self.keys.shape[0], -1, -1).clone()
        for layer, (allowed, *_) in self._layer_masks.items():
            counts[layer] = (allowed.sum(dim=-1) - 1).float()
        return float(counts.mean(dim=(0, 1)).sum())

    def alive(self, now: int) -> torch.Tensor:
        """bool [L, H, R + Q]: candidate slots holding an entry that some query from ``now`` on may still
        attend under its layer's own window (a window or attention chunk hides a key from every later
        query once it hides it from ``now``)."""
        key_pos = self.chunk_key_pos()
        valid = key_pos >= 0
        now_pos = torch.tensor([now], device=key_pos.device)
        for layer, visible in self._visible.items():
            if visible is not None:
                valid[layer] &= visible(now_pos, key_pos[layer].clamp_min(0))[..., 0, :]
        return valid

    # ---- boundary (engine) ---------------------------------------------------------------------
    def compact(self, keep: torch.Tensor) -> torch.Tensor:
        """Keep the candidate slots ``keep`` [L, H, R + Q] marks (at most R per layer and head), moved
        to the front of the retained region sorted by position; the others are evicted.

        Returns the evicted positions [L, H, R + Q] (-1 where nothing was evicted).
        """
        key_pos = self.chunk_key_pos()
        valid = key_pos >= 0
        keep = keep & valid
        evicted = torch.where(valid & ~keep, key_pos, torch.full_like(key_pos, -1))
        order_key = torch.where(keep, key_pos, torch.full_like(key_pos, torch.iinfo(torch.long).max))
        index = torch.argsort(order_key, dim=-1, stable=True)[..., : self.retained]  # [L, H, R]
        kept = torch.gather(keep, -1, index)
        new_pos = torch.where(kept, torch.gather(key_pos, -1, index), torch.full_like(index, -1))
        gather4 = index[..., None].expand(-1, -1, -1, self.keys.shape[-1])
        n = key_pos.shape[-1]
        self.keys[:, :, : self.retained] = torch.gather(self.keys[:, :, :n], 2, gather4)
        self.values[:, :, : self.retained] = torch.gather(self.values[:, :, :n], 2, gather4)
        if self.raw_keys is not None:
            self.raw_keys[:, :, : self.retained] = torch.gather(self.raw_keys[:, :, :n], 2, gather4)
        for tensor in self.state.values():
            tensor[:, :, : self.retained] = torch.gather(tensor[:, :, :n], -1, index)
        self.key_pos[:, :, : self.retained] = new_pos
        return evicted


def record_gradients(memories: list[SlotMemory], losses: list[torch.Tensor | None]) -> None:
    """One backward pass of the summed NLL of a pass's streams: ``losses[i]`` is the summed NLL of stream
    i's chunk (None when none of its queries has a target). Streams share no entry, so the gradient of the
    sum at stream i's attention outputs is the gradient of its own loss. Fills each memory's
    :attr:`~SlotMemory.utility` (zero for a stream without a loss) and releases the pass's graph."""
    outputs = [memory.take_outputs() for memory in memories]
    scored = [loss for loss in losses if loss is not None]
    if not scored:
        return
    tracked = [
        (memory, out) for memory, out, loss in zip(memories, outputs, losses, strict=True) if loss is not None
    ]
    flat = [output for _, out in tracked for *_, output in out]
    grads = list(torch.autograd.grad(torch.stack(scored).sum(), flat))
    for memory, out in tracked:
        memory.store_utility(out, grads[: len(out)])
        del grads[: len(out)]
