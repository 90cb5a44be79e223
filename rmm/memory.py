"""A fixed-size slot memory per (layer, stream, KV head): retained entries plus the current chunk.

One memory holds the N streams (rows) of a batch in layer-major tensors, keys and values
[L, N, H, slots, D], so that one attention call per layer serves every stream of a pass
(:mod:`rmm.integration`); a stream's own memory is a view of its row (:class:`RowView`, the
per-document [L, H, ...] shapes a policy sees). Streams share no entry: each row's slots, masks and
positions are its own. Within a pass every row takes Q queries; a row whose chunk is shorter (a
document's last) is padded with queries that see only their own slot and whose keys nobody sees.

Layout along the slot axis: ``[0, R)`` retained entries, kept sorted by original position with empty
slots (position -1) last, then ``[R, R + Q)`` the chunk being processed. Its size never depends on the
stream length. R is the slots that hold the retained entries; ``capacity`` elsewhere is what one
(layer, KV head) may keep (B', or c_{l,h} under an allocation), never R.

Three pieces, one concern each: the slot storage here (:class:`SlotMemory`: keys and values
[L, N, H, R + C, D], key positions and the policy's statistics [L, N, H, R + C], attention
[L, N, H, C, R + C], queries [L, N, H, G, C, D], a model's bias per key [L, N, H, R + C] where it adds
one; rows, growth, compaction), the pass's attention masks
(:class:`~rmm.masks.ChunkMasks`) and its rotation tables (:class:`~rmm.rotary.ChunkRotations`),
both rebuilt at every :meth:`SlotMemory.begin_chunk`, each with its shapes in its own docstring.

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

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from rmm.masks import ChunkMasks, LayerWindow
from rmm.recording import RecordingPlan
from rmm.rotary import ChunkRotations, KeyStorage, Rotary
from rmm.transfer import to_device


class RowState(Protocol):
    """State a model carries from chunk to chunk outside attention, one row per stream
    (:class:`rmm.integration.CarriedState`): the memory's row changes apply to it too."""

    def reset_row(self, row: int) -> None: ...

    def keep_rows(self, index: torch.Tensor) -> None: ...

    def add_rows(self, count: int) -> None: ...


def empty_pairs(
    layer_shapes: Sequence[tuple[int, int, int]], attending: Sequence[bool], n_heads: int
) -> torch.Tensor | None:
    """bool [L, 1, H, 1]: the (layer, KV head) pairs whose slots stay empty (a layer that never attends, a
    head past the layer's own); None when every pair holds entries."""
    heads = torch.tensor([h if a else 0 for (h, _, _), a in zip(layer_shapes, attending, strict=True)])
    empty = torch.arange(n_heads)[None, :] >= heads[:, None]
    return empty[:, None, :, None] if bool(empty.any()) else None


class SlotMemory:
    """Bounded KV memory for N streams side by side; the attention function reads and writes it layer by
    layer, for all rows at once.

    Parameters
    ----------
    plan : which buffers exist (:func:`rmm.planning.recording_plan`).
    shape : (n_layers, n_kv_heads, head_dim) of the keys.
    retained : R, slots for entries kept across boundaries (B for position rules, B - C + 1 otherwise, or
        the largest per-head capacity under a non-uniform budget allocation).
    chunk : C, slots for the chunk.
    rows : N, streams held side by side.
    attending : per layer, whether it attends (default: every layer); a layer that does not (a recurrent
        or convolutional mixer) holds no entry: its slots stay empty.
    carried : the model's state outside attention (its recurrent and convolutional mixers), whose rows
        follow the memory's; None for a model of attention layers only.
    value_dim : the values' head dimension (default: the keys'; multi-head latent attention's differ).
    layer_shapes : per layer, its own (KV heads, key head dimension, value head dimension), where layers
        differ (Gemma 4); ``shape`` and ``value_dim`` are then the widest, and a layer's keys, values and
        queries are held zero-padded to them (a zero channel adds nothing to a logit or an output), its
        heads past its own hold no entry. None: every layer has ``shape``'s.
    sources : per layer, the layer whose keys and values it attends (default: itself). Under KV sharing a
        reading layer holds nothing (``attending`` says so): it attends the storing layer's slots under
        that layer's masks, and its attention adds to that layer's, so an entry is stored and evicted once.
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
        rows: int = 1,
        attending: Sequence[bool] | None = None,
        carried: RowState | None = None,
        value_dim: int | None = None,
        layer_shapes: Sequence[tuple[int, int, int]] | None = None,
        sources: Sequence[int] | None = None,
    ):
        n_layers, n_heads, head_dim = shape
        self.sources = list(range(n_layers)) if sources is None else list(sources)
        self.plan, self.retained, self.chunk, self.rows = plan, retained, chunk, rows
        self.rotary, self.device = rotary, device
        self.carried = carried
        attending = [True] * n_layers if attending is None else list(attending)
        own = [(n_heads, head_dim, value_dim or head_dim)] * n_layers
        self.layer_shapes = own if layer_shapes is None else list(layer_shapes)
        empty = empty_pairs(self.layer_shapes, attending, n_heads)
        self._empty = None if empty is None else empty.to(device)  # [L, 1, H, 1]
        self.storage = KeyStorage.of(plan)
        self.record_attention, self.track_gradient = plan.record_attention, plan.track_gradient
        self.record_queries, self.n_sink_slots = plan.record_queries, plan.n_sink_slots
        if self.track_gradient and not self.record_attention:
            raise ValueError("gradient tracking needs attention probabilities: record_attention must be set")
        self._allocate(shape, value_dim or head_dim, dtype)
        # filled by begin_chunk
        self.lengths: list[int] = [0] * rows  # real queries of each row in the pass
        self.query_pos = torch.empty(rows, 0, dtype=torch.long, device=device)  # [N, Q]
        self.model_pos = self.query_pos
        # position rules: the first layer the rule applies to (the others it applies to hold the same set)
        ruled = [layer for layer, exempt in enumerate(plan.exempt or [False] * n_layers) if not exempt]
        first = next((layer for layer in ruled if attending[layer]), 0)
        self.masks = ChunkMasks(plan, [h for h, _, _ in self.layer_shapes], first, dtype)
        self.rotations = ChunkRotations(plan, rotary)
        # KV sharing: per storing layer that others read, the keys and values it attended in this pass
        self._attended: dict[int, tuple[torch.Tensor, torch.Tensor]] = dict.fromkeys(
            {source for layer, source in enumerate(self.sources) if source != layer}
        )
        self.calls = [0] * n_layers  # attention calls per layer since the memory was made
        self.passes = 0  # forward passes (chunks) begun
        # called by the attention function with (layer, query [N, H, G, Q, D], key [N, H, Q, D]) as the
        # model produced them (the self-check reads the model's own rotation this way)
        self.capture: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None

    def _allocate(self, shape: tuple[int, int, int], value_dim: int, dtype: torch.dtype) -> None:
        """The slots [L, N, H, R + C, ...] of every buffer the plan asks for, empty."""
        n_layers, n_heads, head_dim = shape
        slots, device = self.retained + self.chunk, self.device
        self.keys = torch.zeros(n_layers, self.rows, n_heads, slots, head_dim, dtype=dtype, device=device)
        self.values = self.keys.new_zeros(*self.keys.shape[:-1], value_dim)
        # ROTATED_AND_RAW: a second, unrotated copy, filled as keys arrive
        self.raw_keys = torch.zeros_like(self.keys) if self.storage is KeyStorage.ROTATED_AND_RAW else None
        self.key_pos = torch.full((n_layers, self.rows, n_heads, slots), -1, dtype=torch.long, device=device)
        self.state = {name: torch.zeros(self.key_pos.shape, device=device) for name in self.plan.state_names}
        self.attn: torch.Tensor | None = None
        self.utility: torch.Tensor | None = None
        # a model's bias per key (:func:`rmm.model_config.key_bias_window`), [L, N, H, R + C], allocated at
        # its first store, and its keep window
        self.key_bias: torch.Tensor | None = None
        self.keep_window = 0
        if self.record_attention:
            self.record_all_attention()
        # per row: attended entries, evicted entries' summed age and their count, accumulated on the device
        # (read once per stream, at its end)
        self.totals = torch.zeros(self.rows, 3, dtype=torch.float64, device=device)
        # gradient tracking: what each layer's attention used during the chunk's forward pass:
        # (layer, probs [N, H, G, Q, S], values [N, H, S, D], output [N, H, G, Q, D])
        self._outputs: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.queries: torch.Tensor | None = None  # [L, N, H, G, C, D] unrotated, allocated at the first store

    # ---- rows (engine) ----------------------------------------------------------------------------
    def record_all_attention(self) -> None:
        """Compute and keep attention probabilities from now on (an observer of a stream needs them)."""
        self.record_attention = True
        if self.attn is None:
            shape = (*self.key_pos.shape[:3], self.chunk, self.key_pos.shape[-1])
            self.attn = torch.zeros(shape, device=self.device)
            self.utility = torch.zeros_like(self.attn) if self.track_gradient else None

    def reset_row(self, row: int) -> None:
        """Empty row ``row`` for a new stream."""
        self.key_pos[:, row] = -1
        for tensor in self.state.values():
            tensor[:, row] = 0
        self.totals[row] = 0
        if self.carried is not None:
            self.carried.reset_row(row)

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order), e.g. when streams finish and none replaces them."""
        index = to_device(list(rows), self.device)
        self._map_rows(lambda tensor, dim: tensor.index_select(dim, index))
        if self.carried is not None:
            self.carried.keep_rows(index)

    def add_rows(self, count: int) -> None:
        """Append ``count`` empty rows."""

        def extend(tensor: torch.Tensor, dim: int) -> torch.Tensor:
            shape = list(tensor.shape)
            shape[dim] = count
            return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)

        self._map_rows(extend)
        if self.carried is not None:
            self.carried.add_rows(count)
        for row in range(self.rows - count, self.rows):
            self.reset_row(row)

    def _map_rows(self, change: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
        """Apply ``change(tensor, row dim)`` to every per-row buffer."""

        def apply(tensor: torch.Tensor | None, dim: int = 1) -> torch.Tensor | None:
            return None if tensor is None else change(tensor, dim)

        self.keys, self.values, self.raw_keys = apply(self.keys), apply(self.values), apply(self.raw_keys)
        self.key_pos, self.attn, self.utility = apply(self.key_pos), apply(self.attn), apply(self.utility)
        self.queries, self.key_bias = apply(self.queries), apply(self.key_bias)
        self.state = {name: apply(tensor) for name, tensor in self.state.items()}
        self.totals = apply(self.totals, 0)
        self.rows = self.keys.shape[1]
        self.lengths = [0] * self.rows

    def grow(self, retained: int, chunk: int) -> None:
        """Hold at least ``retained`` slots across boundaries and ``chunk`` for a pass (a longer stream
        than the memory was made for: an unbounded run, or a stream shorter than a chunk before it)."""
        retained, chunk = max(retained, self.retained), max(chunk, self.chunk)
        if (retained, chunk) == (self.retained, self.chunk):
            return
        slots = retained + chunk

        def wider(tensor: torch.Tensor | None, fill: float = 0) -> torch.Tensor | None:
            if tensor is None:
                return None
            out = tensor.new_full((*tensor.shape[:3], slots, *tensor.shape[4:]), fill)
            out[:, :, :, : self.retained] = tensor[:, :, :, : self.retained]
            return out

        self.keys, self.values, self.raw_keys = (wider(t) for t in (self.keys, self.values, self.raw_keys))
        self.key_pos, self.key_bias = wider(self.key_pos, -1), wider(self.key_bias)
        self.state = {name: wider(tensor) for name, tensor in self.state.items()}
        self.retained, self.chunk = retained, chunk
        self.queries = None  # allocated again at the next store
        if self.attn is not None:
            self.attn = None
            self.record_all_attention()

    def row(self, row: int) -> RowView:
        """Stream ``row``'s view of the last chunk (what its policy and hooks see)."""
        return RowView(self, row)

    # ---- chunk setup (engine) -------------------------------------------------------------------
    def begin_chunk(self, starts: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
        """Prepare slots, masks and rotations for a pass: row i's queries are at original positions
        ``starts[i] .. starts[i] + lengths[i] - 1``, padded to Q = max(lengths) queries.

        Returns the position ids [N, Q] to feed the model, rising by one along every row (padded queries
        continue their row's positions, so the model sees no packed sequences).
        """
        if len(starts) != self.rows or len(lengths) != self.rows:
            raise ValueError(f"a pass of this memory has {self.rows} rows, got {len(starts)} starts")
        n_q = max(lengths)
        self.lengths = list(lengths)
        self.passes += 1
        step = torch.arange(n_q, device=self.device)
        pad = step >= to_device(list(lengths), self.device)[:, None] if min(lengths) < n_q else None
        # padded queries continue the positions
        self.query_pos = to_device(list(starts), self.device)[:, None] + step  # [N, Q]
        self._place_chunk(self.query_pos if pad is None else self.query_pos.masked_fill(pad, -1))
        reach = max(s + n - 1 for s, n in zip(starts, lengths, strict=True))
        retained_pos = self.key_pos[..., : self.retained]
        self.model_pos = self.rotations.begin(self.query_pos, retained_pos, reach)
        sinks = self.rotations.sink is not None
        key_pos = self.key_pos[..., : self.retained + n_q]
        self.masks.begin(key_pos, self.query_pos, pad, bool(self.n_sink_slots), sinks, self.record_attention)
        return self.model_pos

    def _place_chunk(self, chunk_pos: torch.Tensor) -> None:
        """The chunk's slots hold the queries' own keys at ``chunk_pos`` [N, Q] (-1 padded), their statistics
        zero; a pair that holds no entry stays empty."""
        end = self.retained + chunk_pos.shape[1]
        self.key_pos[..., self.retained :] = -1
        self.key_pos[..., self.retained : end] = chunk_pos[:, None, :]
        if self._empty is not None:  # a layer that does not attend, a head past its layer's, holds nothing
            self.key_pos.masked_fill_(self._empty, -1)
        for tensor in self.state.values():
            tensor[..., self.retained :] = 0

    # ---- attention function (per layer, all rows) ------------------------------------------------
    def attend_keys_values(self, layer: int, key: torch.Tensor, value: torch.Tensor):
        """Store the chunk's keys [N, H, Q, D] and values [N, H, Q, Dv]; return the keys and values to attend
        [N, H, R + Q, D or Dv] (a reading layer's: those its storing layer returned in this pass)."""
        if self.sources[layer] != layer:
            return self._attended[self.sources[layer]]
        attended = self._store_keys_values(layer, key, value)
        if layer in self._attended:
            self._attended[layer] = attended
        return attended

    def _store_keys_values(self, layer: int, key: torch.Tensor, value: torch.Tensor):
        end = self.retained + key.shape[2]
        graph_key, graph_value = key, value
        key, value = key.detach(), value.detach()  # slots never hold a graph
        self.values[layer, :, :, self.retained : end] = value
        if self.storage is KeyStorage.UNROTATED:
            self.keys[layer, :, :, self.retained : end] = self.rotations.unrotated_keys(key, layer)
            kept = self.rotations.ranked_keys(self.keys[layer, :, :, : self.retained], layer)
        else:
            self.keys[layer, :, :, self.retained : end] = key
            if self.storage is KeyStorage.ROTATED_AND_RAW:
                self.raw_keys[layer, :, :, self.retained : end] = self.rotations.unrotated_keys(key, layer)
            kept = self.keys[layer, :, :, : self.retained]
        if self.track_gradient:  # the chunk's own keys and values keep the pass's graph
            chunk_values = torch.cat([self.values[layer, :, :, : self.retained], graph_value], dim=2)
            return torch.cat([kept, graph_key], dim=2), chunk_values
        if self.storage is KeyStorage.UNROTATED:
            return torch.cat([kept, key], dim=2), self.values[layer, :, :, :end]
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def store_key_bias(self, layer: int, bias: torch.Tensor, window: int) -> None:
        """The chunk's bias per key [N, H_l, Q] that the model adds to every logit of the layer's keys, and
        its keep window (:func:`rmm.model_config.key_bias_window`); kept with the entries like their keys."""
        if self.key_bias is None:
            wide = torch.promote_types(bias.dtype, torch.float32)
            self.key_bias = torch.zeros(self.key_pos.shape, dtype=wide, device=self.device)
        self.keep_window = window
        n_heads, n_q = bias.shape[1:]
        self.key_bias[layer, :, :n_heads, self.retained : self.retained + n_q] = bias

    @property
    def has_key_bias(self) -> bool:
        """Whether the model adds a bias per key (stored at the pass's first call of a layer)."""
        return self.key_bias is not None

    def key_bias_for(self, layer: int, n_heads: int, n_slots: int) -> torch.Tensor | None:
        """The bias per key [N, n_heads, n_slots] of the slots the layer attends (its storing layer's);
        None for a model without one."""
        if self.key_bias is None:
            return None
        return self.key_bias[self.sources[layer], :, :n_heads, :n_slots]

    def enter_layer(self, layer: int, visible: LayerWindow | None) -> None:
        """Called by the attention function once per layer and pass: counts the call and applies the
        layer's own window ``visible`` (None: plain causal) to its masks for this chunk."""
        self.calls[layer] += 1
        if self.sources[layer] == layer:  # a reading layer has its storing layer's window and masks
            self.masks.enter_layer(layer, visible, self.key_pos)

    def allowed_mask(self, layer: int) -> torch.Tensor:
        """bool [N, H or 1, Q, R + Q]: which slots each query of the chunk may attend."""
        return self.masks.for_layer(self.sources[layer], 0)

    def blocked_mask(self, layer: int) -> torch.Tensor:
        """The complement of :meth:`allowed_mask` (computed once per chunk where the sinks need it, else as
        asked for)."""
        return self.masks.hidden(self.sources[layer])

    def eager_bias(self, layer: int) -> torch.Tensor:
        """fp32 [N, H or 1, Q, R + Q]: the layer's mask as an additive bias for the eager path, -inf where a
        query may not attend a slot, 0 where it may (:meth:`rmm.masks.ChunkMasks.eager_bias`)."""
        return self.masks.eager_bias(self.sources[layer])

    def other_slots_bias(self, layer: int) -> torch.Tensor:
        """Additive mask [N, H or 1, Q, R + Q] in the model's dtype: 0 where a query may attend a non-sink
        slot, -inf on the sink slots and wherever :meth:`allowed_mask` blocks (set with the sink table)."""
        assert self.masks.other_bias is not None
        return self.masks.for_layer(self.sources[layer], 2)

    def folded_mask(self, layer: int, group: int, bias: bool = False) -> torch.Tensor:
        """The layer's mask with the query group folded into the rows, for one fused call over queries
        [N, H, G * Q, D]: bool [N, H or 1, G * Q, S] (``bias``: :meth:`other_slots_bias` instead)."""
        return self.masks.folded_for(self.sources[layer], group, bias)

    def sink_query(self, layer: int, query: torch.Tensor) -> torch.Tensor | None:
        """Queries [N, H, G, Q, D] re-rotated to their cache rank, for the sink slots; None if not needed
        (and in a layer the policy leaves alone, which holds no sinks)."""
        if self.plan.exempt and self.plan.exempt[layer]:
            return None
        return self.rotations.sink_queries(query, layer)

    def store_attention(self, layer: int, probs: torch.Tensor, rows: slice = slice(None)) -> None:
        """Attention probabilities [n, H_l, G, Q, R + Q] of the chunk's queries of ``rows`` over the layer's
        own H_l KV heads, kept GQA group summed (summed straight into the buffer); a reading layer's add to
        its storing layer's (which ran before it in the pass)."""
        n_heads, _, n_q, n_slots = probs.shape[1:]
        source = self.sources[layer]
        held = self.attn[source, rows, :n_heads, :n_q, :n_slots]
        if source == layer:
            torch.sum(probs.detach(), dim=2, out=held)
        else:
            held += probs.detach().sum(dim=2)

    def track_output(
        self, layer: int, probs: torch.Tensor, values: torch.Tensor, output: torch.Tensor
    ) -> torch.Tensor:
        """Gradient tracking: remember a layer's attention probabilities [N, H, G, Q, S] (float32), the
        values [N, H, S, D] and its output o [N, H, G, Q, D] = probs . values, so that
        :func:`record_gradients` can differentiate the chunk's loss with respect to o.

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
            reach = (grad * output).sum(dim=-1, keepdim=True)  # <g_s, o_s>: [N, H, G, Q, 1]
            per_value = torch.matmul(grad, values.float()[:, :, None].transpose(-1, -2))  # <g_s, v_j>
            utility = (probs * (reach - per_value)).sum(dim=2)  # [N, H, Q, S]
            self.utility[layer, :, :, : utility.shape[2], : utility.shape[3]] = utility

    def store_queries(self, layer: int, query: torch.Tensor) -> None:
        """The chunk's queries [N, H, G, Q, D] as the model rotated them; kept unrotated."""
        if self.queries is None:
            rows, n_heads, group, _, head_dim = query.shape
            shape = (self.keys.shape[0], rows, n_heads, group, self.chunk, head_dim)
            self.queries = query.new_zeros(shape)
        self.queries[layer, :, :, :, : query.shape[3]] = self.rotations.unrotated_queries(
            query.detach(), layer
        )

    # ---- statistics and boundary (engine, all rows) -----------------------------------------------
    def chunk_key_pos(self) -> torch.Tensor:
        """[L, N, H, R + Q] original positions of the candidate slots (-1 empty)."""
        return self.key_pos[..., : self.retained + self.query_pos.shape[1]]

    def count_attended(self) -> None:
        """Add to each row's total the past entries (itself excluded) its real queries attended in the
        pass, averaged over layers and heads."""
        n_layers, _, n_heads = self.keys.shape[:3]
        self.totals[:, 0] += self.masks.attended(n_layers, n_heads, self._empty).sum(dim=-1)

    def alive(self, now: torch.Tensor) -> torch.Tensor:
        """bool [L, N, H, R + Q]: candidate slots holding an entry that some query from ``now`` [N] on may
        still attend under its layer's own window (a window or attention chunk hides a key from every
        later query once it hides it from ``now``)."""
        key_pos = self.chunk_key_pos()
        valid = key_pos >= 0
        at = now[:, None, None]  # [N, 1, Q = 1]
        for layer, visible in self.masks.windows.items():
            if visible is not None:
                valid[layer] &= visible(at, key_pos[layer].clamp_min(0))[..., 0, :]
        return valid

    def compact(self, keep: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
        """Keep the candidate slots ``keep`` [L, N, H, R + Q] marks (at most R per layer, row and head),
        moved to the front of the retained region sorted by position; the others are evicted, their ages
        at ``now`` [N] added to the rows' totals.

        Returns the evicted positions [L, N, H, R + Q] (-1 where nothing was evicted).
        """
        key_pos = self.chunk_key_pos()
        valid = key_pos >= 0
        keep = keep & valid
        gone = valid & ~keep
        evicted = torch.where(gone, key_pos, -1)
        ages = torch.where(gone, now[None, :, None, None] - key_pos, 0)
        self.totals[:, 1] += ages.sum(dim=(0, 2, 3))
        self.totals[:, 2] += gone.sum(dim=(0, 2, 3))
        order_key = torch.where(keep, key_pos, torch.iinfo(torch.long).max)
        index = torch.argsort(order_key, dim=-1, stable=True)[..., : self.retained]  # [L, N, H, R]
        kept = torch.gather(keep, -1, index)
        new_pos = torch.where(kept, torch.gather(key_pos, -1, index), -1)
        n = key_pos.shape[-1]
        rows = slot_rows(index, self.keys.shape[3])
        for tensor in (self.keys, self.values, self.raw_keys):
            if tensor is not None:
                move_slots(tensor, rows)
        for tensor in (*self.state.values(), self.key_bias):
            if tensor is not None:
                tensor[..., : self.retained] = torch.gather(tensor[..., :n], -1, index)
        self.key_pos[..., : self.retained] = new_pos
        return evicted


# compaction on a CPU: layers moved per call such that one call's moved slots stay within about this many
# bytes, which the allocator reuses (the whole memory's, a fresh buffer of tens of MB, is page-faulted in at
# every compaction: 3.7x slower in an ad hoc measurement of SmolLM2's keys at B = 256, batch 8); on other
# devices every layer at once
CPU_MOVE_BYTES = 2**21


def slot_rows(index: torch.Tensor, n_slots: int) -> torch.Tensor:
    """The slots ``index`` [L, N, H, R] of a memory tensor [L, N, H, ``n_slots``, D] as rows of its
    [L * N * H * n_slots, D] flattening: [L * N * H * R]."""
    base = torch.arange(index[..., 0].numel(), device=index.device).view(*index.shape[:-1], 1) * n_slots
    return (index + base).view(-1)


def move_slots(tensor: torch.Tensor, rows: torch.Tensor) -> None:
    """Compact ``tensor`` [L, N, H, S, D] in place: its first R slots become the slots ``rows``
    [L * N * H * R] (:func:`slot_rows`) name, each slot's D entries copied as one row (``index_select``;
    ``gather`` with an index expanded over D reads an index per entry: 1.7x slower on a CPU, ad hoc)."""
    n_layers, n, heads, _, width = tensor.shape
    per_layer = rows.numel() // n_layers  # N * H * R
    retained = per_layer // (n * heads)
    step = n_layers
    if tensor.device.type == "cpu":
        step = max(1, CPU_MOVE_BYTES // (per_layer * width * tensor.element_size()))
    flat = tensor.reshape(-1, width)
    blocks = [(tensor, rows)]
    if step < n_layers:
        starts = range(0, n_layers, step)
        blocks = [(tensor[i : i + step], rows[i * per_layer : (i + step) * per_layer]) for i in starts]
    for block, block_rows in blocks:
        moved = flat.index_select(0, block_rows)
        block[..., :retained, :] = moved.view(block.shape[0], n, heads, retained, width)


class RowView:
    """One stream's view of a batched :class:`SlotMemory` after a pass: the [L, H, ...] shapes of one
    document, over its candidate slots (retained, then its own R + Q' with Q' its real queries)."""

    def __init__(self, memory: SlotMemory, row: int):
        self.memory, self.row = memory, row
        self.n_q = memory.lengths[row]
        self.n = memory.retained + self.n_q

    @property
    def query_pos(self) -> torch.Tensor:
        """[Q'] original positions of the chunk's queries."""
        return self.memory.query_pos[self.row, : self.n_q]

    def chunk_key_pos(self) -> torch.Tensor:
        """[L, H, R + Q'] original positions of the candidate slots (-1 empty)."""
        return self.memory.key_pos[:, self.row, :, : self.n]

    def retained_positions(self) -> torch.Tensor:
        """[L, H, R] positions held across the last boundary (-1 empty)."""
        return self.memory.key_pos[:, self.row, :, : self.memory.retained]

    def chunk_attention(self) -> torch.Tensor:
        """[L, H, Q', R + Q'] attention of the last chunk."""
        return self.memory.attn[:, self.row, :, : self.n_q, : self.n]

    def state_view(self) -> dict[str, torch.Tensor]:
        """The policy's per-slot statistics over the candidate slots, [L, H, R + Q'] each (views)."""
        return {name: tensor[:, self.row, :, : self.n] for name, tensor in self.memory.state.items()}

    def observed(self, needs: frozenset[str]) -> dict[str, torch.Tensor]:
        """The chunk's recorded fields of an observation, exactly those ``needs`` names from
        ``attention``, ``keys``, ``values``, ``queries`` and ``gradient`` (shapes:
        :class:`~rmm.policies.Observation`)."""
        memory, row, n, n_q = self.memory, self.row, self.n, self.n_q
        fields: dict[str, torch.Tensor] = {}
        if "attention" in needs:
            fields["attention"] = self.chunk_attention()
        if "keys" in needs:
            keys = memory.keys if memory.raw_keys is None else memory.raw_keys
            fields["keys"] = keys[:, row, :, :n]
        if "values" in needs:
            fields["values"] = memory.values[:, row, :, :n]
        if "queries" in needs:
            fields["queries"] = memory.queries[:, row, :, :, :n_q]
        if "gradient" in needs:
            fields["gradient"] = memory.utility[:, row, :, :n_q, :n]
        return fields


def record_gradients(memory: SlotMemory, loss: torch.Tensor | None) -> None:
    """One backward pass of ``loss``, the summed NLL of a pass's scored queries over all rows (None when
    no query has a target). Rows share no entry, so the gradient of the sum at row i's attention outputs
    is the gradient of its own loss. Fills the memory's :attr:`~SlotMemory.utility` and releases the
    pass's graph."""
    outputs = memory.take_outputs()
    if loss is None:
        return
    grads = torch.autograd.grad(loss, [output for *_, output in outputs])
    memory.store_utility(outputs, list(grads))
