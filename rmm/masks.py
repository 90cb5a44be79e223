"""The attention masks of one pass over a slot memory (:class:`~rmm.memory.SlotMemory`): which slots each
query of the chunk may attend.

Built at every chunk (:meth:`ChunkMasks.begin`) from the slots' key positions [L, N, H, S] and the
queries' positions [N, Q], then per layer as the attention function enters it (:meth:`ChunkMasks.enter_layer`:
the layer's own window). Shapes (S = R + Q slots, G query heads per KV head):

- ``allowed``: bool [L or 1, N, H or 1, Q, S] (one layer and head where a position rule gives every
  layer and head it applies to the same set); a padded query sees its own slot only; in a score-based
  pass that builds ``blocked`` or the eager path's parts, only if something asks for it;
- ``blocked``: its complement, where the sinks need it (None otherwise);
- ``other_bias``: additive [L or 1, N, H or 1, Q, S] in the model's dtype, 0 where a query may attend a
  non-sink slot, -inf on the sink slots and wherever ``allowed`` blocks (None without sinks);
- the eager path's additive mask (:meth:`ChunkMasks.eager_bias`), for a score-based pass in two parts
  that a layer's mask is the sum of: ``slot_bias`` [L, N, H, 1, S] (-inf on the empty retained slots) and
  ``chunk_bias`` [N or 1, 1, Q, S] (-inf on the chunk's later keys; a padded query sees its own slot only);
- ``layers``: a windowed layer's own (allowed, blocked, bias), [N, H or 1, Q, S] each;
- ``folded``: the fused path's masks with the query group folded into the rows, [N, H or 1, G * Q, S].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rmm.recording import RecordingPlan

# a layer's own window: (query_pos [..., Q], key_pos [..., S]) -> bool [..., Q, S], hashable (one per
# layer type)
LayerWindow = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# a layer's masks for one pass: (allowed, blocked, other-slots bias), [N, H or 1, Q, S] each
LayerMasks = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def causal(key_pos: torch.Tensor, query_pos: torch.Tensor, hidden: bool = False) -> torch.Tensor:
    """bool [..., Q, S]: the valid keys ``key_pos`` [..., S] at or before each query ``query_pos``
    [..., Q] (``hidden``: the complement, the empty slots and the keys after each query)."""
    # an empty slot (-1) placed after every query: one comparison over [..., Q, S], not three
    keys = key_pos.masked_fill(key_pos < 0, torch.iinfo(key_pos.dtype).max)[..., None, :]
    return keys > query_pos[..., :, None] if hidden else keys <= query_pos[..., :, None]


def visible_count(allowed: torch.Tensor) -> torch.Tensor:
    """How many keys each query sees: ``allowed`` [..., Q, S] (bool) -> [..., Q] float, summed as bytes into
    int32 (a bool sum would first copy the mask to int64)."""
    return allowed.view(torch.uint8).sum(dim=-1, dtype=torch.int32).float()


def additive(blocked: torch.Tensor) -> torch.Tensor:
    """An additive mask, fp32: -inf where ``blocked`` (bool), 0 elsewhere. Added to finite logits it hides
    what ``masked_fill(blocked, -inf)`` would, bit for bit, and a CPU adds far faster than it masks."""
    return torch.where(blocked, float("-inf"), 0.0)


def fold(mask: torch.Tensor, group: int) -> torch.Tensor:
    """A mask [N, H or 1, Q, S] repeated for each of a group's G query heads: [N, H or 1, G * Q, S]."""
    n, heads, n_q, n_slots = mask.shape
    return mask[:, :, None].expand(n, heads, group, n_q, n_slots).reshape(n, heads, group * n_q, n_slots)


class ChunkMasks:
    """The masks of the current pass (shapes in the module docstring).

    Parameters
    ----------
    plan : the position rule and the layers it leaves alone (``rule``, ``exempt``), the sink slots.
    layer_heads : per layer, its own KV heads (a layer's masks are cut to them).
    ruled : the first layer a position rule applies to (the others it applies to hold the same set).
    dtype : the model's, for the additive bias.
    """

    def __init__(self, plan: RecordingPlan, layer_heads: Sequence[int], ruled: int, dtype: torch.dtype):
        self.rule, self.exempt, self.n_sink_slots = plan.rule, plan.exempt, plan.n_sink_slots
        self.layer_heads, self.ruled, self.dtype = list(layer_heads), ruled, dtype
        self.retained = 0
        self.held = torch.empty(0, dtype=torch.int32)
        self.query_pos = torch.empty(0, 0, dtype=torch.long)  # [N, Q]
        self.pad: torch.Tensor | None = None  # [N, Q] padded queries, None when every row is full
        self.key_pos = torch.empty(0, 0, 0, 0, dtype=torch.long)  # [L, N, H, S]
        self._allowed: torch.Tensor | None = torch.empty(0, dtype=torch.bool)
        self.blocked: torch.Tensor | None = None
        self.slot_bias: torch.Tensor | None = None
        self.chunk_bias: torch.Tensor | None = None
        self.other_bias: torch.Tensor | None = None
        # the model's own window per layer (set by the attention function each pass; None: plain causal)
        self.windows: dict[int, LayerWindow | None] = {}
        self.layers: dict[int, LayerMasks] = {}
        self.shared: dict[tuple[LayerWindow, bool], LayerMasks] = {}  # one per window, where layers share
        self.folded: dict[bool, torch.Tensor] = {}  # the shared masks folded, built once per pass

    def begin(
        self,
        key_pos: torch.Tensor,
        query_pos: torch.Tensor,
        pad: torch.Tensor | None,
        blocked: bool,
        sinks: bool,
        eager: bool = False,
    ) -> None:
        """The pass's masks over the slots' ``key_pos`` [L, N, H, R + Q] for queries at ``query_pos`` [N, Q]
        (``pad`` [N, Q]: padded queries, or None); ``blocked``: keep the complement too; ``sinks``: the
        other-slots bias too; ``eager``: the eager path's bias (:meth:`eager_bias`) will be asked for."""
        self.layers.clear()
        self.shared.clear()
        self.folded.clear()
        self.retained = key_pos.shape[-1] - query_pos.shape[1]
        self.key_pos, self.query_pos, self.pad = key_pos, query_pos, pad
        # [L, N, H]: entries held across the last boundary, each before every query of the pass (what a
        # score-based pass counts its queries' attended entries from)
        if self.rule is None:
            self.held = (key_pos[..., : self.retained] >= 0).sum(dim=-1, dtype=torch.int32)
        rows = query_pos[:, None, :]  # [N, 1, Q], against key positions [..., N, H, S]
        self._allowed = self.blocked = self.slot_bias = self.chunk_bias = None
        if self.rule is not None:
            # position rules give every layer and head they apply to the same set
            shared = key_pos[self.ruled : self.ruled + 1, :, :1]  # [1, N, 1, S]
            self._allowed = self._padded(causal(shared, rows) & self.rule(rows, shared))
        elif blocked:  # the complement alone, built directly (the allowed mask follows if asked for)
            self.blocked = self._padded(causal(key_pos, rows, hidden=True), hidden=True)
        elif eager:  # the eager path's bias in its two parts (the allowed mask follows if asked for)
            retained = torch.arange(key_pos.shape[-1], device=key_pos.device) < self.retained
            self.slot_bias = additive((key_pos < 0) & retained)[..., None, :]  # [L, N, H, 1, S]
            self.chunk_bias = additive(self._padded(self._later_keys(), hidden=True))
        else:
            self._allowed = self._padded(causal(key_pos, rows))
        if blocked and self.blocked is None:
            self.blocked = ~self._allowed
        self.other_bias = self._other_slots_bias(self.allowed) if sinks else None

    @property
    def allowed(self) -> torch.Tensor:
        """bool [L or 1, N, H or 1, Q, S]: which slots each query may attend (the complement of
        ``blocked`` where only that was built; built from the key positions where neither was)."""
        if self._allowed is None:
            if self.blocked is None:
                self._allowed = self._padded(causal(self.key_pos, self.query_pos[:, None, :]))
            else:
                self._allowed = ~self.blocked
        return self._allowed

    def _later_keys(self) -> torch.Tensor:
        """bool [1, 1, Q, S]: the chunk's keys after each of its queries (slot R + i holds query i's key)."""
        n_q, n_slots = self.query_pos.shape[1], self.retained + self.query_pos.shape[1]
        slot = torch.arange(n_slots, device=self.query_pos.device)
        query = torch.arange(n_q, device=self.query_pos.device)
        return (slot > self.retained + query[:, None])[None, None]

    def eager_bias(self, layer: int) -> torch.Tensor:
        """fp32 [N, H or 1, Q, S]: the layer's mask over its own KV heads as an additive bias for the eager
        path, -inf where a query may not attend a slot, 0 where it may. In a score-based pass the sum of
        ``slot_bias`` and ``chunk_bias``: every held entry precedes the chunk, so a query sees every held
        retained entry and the chunk's keys up to its own."""
        if self.slot_bias is None or layer in self.layers:
            return additive(self.hidden(layer))
        assert self.chunk_bias is not None
        slots = self.slot_bias[layer]  # [N, H, 1, S]
        heads = self.layer_heads[layer]
        return (slots[:, :heads] if slots.shape[1] > heads else slots) + self.chunk_bias

    def _padded(self, allowed: torch.Tensor, hidden: bool = False) -> torch.Tensor:
        """``allowed`` [..., N, H or 1, Q, S] with every padded query seeing its own slot only (so that
        its softmax is defined; no real query sees a padded key, whose position is -1); ``hidden``: the
        mask given and returned is the complement."""
        if self.pad is None:
            return allowed
        n_q, n_slots = allowed.shape[-2:]
        slot = torch.arange(n_slots, device=allowed.device)
        own = slot == self.retained + torch.arange(n_q, device=allowed.device)[:, None]  # [Q, S]
        return torch.where(self.pad[:, None, :, None], ~own if hidden else own, allowed)

    def _other_slots_bias(self, allowed: torch.Tensor) -> torch.Tensor:
        """Additive mask in the model's dtype: 0 where ``allowed`` lets a query attend a non-sink slot,
        -inf on the sink slots and wherever it blocks."""
        other = allowed.clone()
        other[..., : self.n_sink_slots] = False
        return additive(~other).to(self.dtype)

    def enter_layer(self, layer: int, visible: LayerWindow | None, key_pos: torch.Tensor) -> None:
        """Apply the layer's own window ``visible`` (None: plain causal) to its masks for this pass, over the
        memory's ``key_pos`` [L, N, H, slots]."""
        self.windows[layer] = visible
        if visible is None:
            self.layers.pop(layer, None)
            return
        shared = self.rule is not None  # a position rule: one set for every layer and head it applies to
        exempt = bool(self.exempt) and self.exempt[layer]
        if shared and (visible, exempt) in self.shared:
            self.layers[layer] = self.shared[visible, exempt]
            return
        row = layer if exempt or not shared else self.ruled  # the key positions its mask is built from
        heads = 1 if shared else key_pos.shape[2]
        key_pos = key_pos[row, :, :heads, : self.retained + self.query_pos.shape[1]]  # [N, H or 1, S]
        rows = self.query_pos[:, None, :]
        # [N, H or 1, Q, S]: the rule's set, or causal alone (no rule, or an exempt layer: its window decides)
        base = self.allowed[0] if shared and not exempt else causal(key_pos, rows)
        allowed = self._padded(base & visible(rows, key_pos.clamp_min(0)))
        blocked = ~allowed if self.blocked is not None else None
        bias = self._other_slots_bias(allowed) if self.other_bias is not None else None
        self.layers[layer] = (allowed, blocked, bias)
        if shared:
            self.shared[visible, exempt] = self.layers[layer]

    def for_layer(self, layer: int, which: int) -> torch.Tensor | None:
        """The layer's mask [N, H or 1, Q, S] over its own KV heads: ``which`` 0 allowed, 1 blocked, 2 the
        other-slots bias (None where the pass keeps none)."""
        if layer in self.layers:
            mask = self.layers[layer][which]
        else:
            full = self.allowed if which == 0 else (self.blocked, self.other_bias)[which - 1]
            if full is None:
                return None
            mask = full[0] if full.shape[0] == 1 else full[layer]
        heads = self.layer_heads[layer]
        return mask[:, :heads] if mask is not None and mask.shape[1] > heads else mask

    def hidden(self, layer: int) -> torch.Tensor:
        """bool [N, H or 1, Q, S]: the slots each query may not attend, over the layer's own KV heads (the
        blocked mask, or the allowed one's complement where the pass keeps no blocked mask)."""
        blocked = self.for_layer(layer, 1)
        return ~self.for_layer(layer, 0) if blocked is None else blocked

    def folded_for(self, layer: int, group: int, bias: bool = False) -> torch.Tensor:
        """The layer's allowed mask (``bias``: its other-slots bias) with the query group folded into the
        rows, [N, H or 1, G * Q, S]; built once per pass for every layer that shares it."""
        mask = self.for_layer(layer, 2 if bias else 0)
        if group == 1:
            return mask
        if layer in self.layers or self.rule is None:  # the layer's own: folded for it
            return fold(mask, group)
        if bias not in self.folded:  # one mask for every layer: folded once per pass
            self.folded[bias] = fold(mask, group)
        return self.folded[bias]

    def attended(self, n_layers: int, n_heads: int, empty: torch.Tensor | None) -> torch.Tensor:
        """[N, Q]: past entries (itself excluded) each query may attend, averaged over the (layer, KV head)
        pairs that hold entries (``empty`` [L, 1, H, 1]: those that do not, or None); 0 for a padded
        query."""
        if self.rule is None:  # causal but in windowed layers (below): the held entries, then the chunk's
            step = torch.arange(self.query_pos.shape[1], device=self.held.device, dtype=torch.float32)
            counts = self.held[..., None].float() + step  # [L, N, H, Q], as visible_count would find
        else:
            counts = visible_count(self.allowed) - 1  # [L or 1, N, H or 1, Q]
        if self.layers:
            counts = counts.expand(n_layers, -1, -1, -1).clone()
            for layer, (allowed, *_) in self.layers.items():
                counts[layer] = (visible_count(allowed) - 1).expand_as(counts[layer])
        if empty is not None and counts.shape[0] > 1:  # the average over the pairs that hold entries
            held = ~empty  # [L, 1, H, 1]; no boolean indexing: it would wait for the device
            counts = counts.expand(-1, -1, n_heads, -1)  # [L, N, H, Q], whole numbers: the sum is exact
            per_query = (counts * held).sum(dim=(0, 2)) / held.sum()  # [N, Q]
        else:
            per_query = counts.mean(dim=(0, 2))  # [N, Q]
        return per_query if self.pad is None else per_query.masked_fill(self.pad, 0)
