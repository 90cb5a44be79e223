"""Rotary position maths: rotations of keys and queries by arbitrary position offsets, per layer.

RoPE rotates every frequency pair of a head vector by ``position * inv_freq[i]``. Two pairings exist:
``half`` (channels i and i + rot_dim / 2: Llama, Mistral, Qwen2, SmolLM, GPT-NeoX, Gemma) and
``interleaved`` (channels 2i and 2i + 1: Cohere, GLM, DeepSeek, Llama 4). The rotated channels are the
first ``rot_dim`` of a head vector, or its last (``offset`` = head_dim - rot_dim: multi-head latent
attention, whose keys are an unrotated part expanded from the latent followed by the rotated part shared
by all heads); the others (partial rotary) are left as they are, and a layer without positions (NoPE) is
not rotated at all.
Rotations compose, so a key rotated at ``p`` and then by ``delta`` is the key at ``p + delta``, and
rotating by ``-p`` recovers the unrotated (pre-RoPE) key.

Each layer has one :class:`Rotation`. The defaults are read from the model: the ``*inv_freq`` buffers
of its rotary modules, one per layer type where the model keeps one per type (Gemma 3's sliding and
global layers), ``half`` pairing. A rotary module (``rotary`` or ``rope`` in its name or class) that
keeps a precomputed sin/cos table instead (GPT-J's and CodeGen's ``embed_positions``, row p
``[sin(p * inv_freq), cos(p * inv_freq)]``) gives the frequencies that reproduce its table
(:func:`table_frequencies`); an additive sinusoidal position table outside a rotary module (CTRL's
``pos_encoding``) is no rotation. :meth:`Rotary.calibrate` then checks every layer against the model's
own rotation (keys the model produced at positions p and p + delta) and picks, per layer, the
candidate the model actually uses (any frequency buffer, either pairing, first or last channels, or none:
GPT-J and CodeGen rotate the interleaved pairs of their first ``rotary_dim`` channels); a layer that no
candidate reproduces is refused (:mod:`rmm.selfcheck` runs it before a stream).

The rotations one pass over a slot memory (:class:`~rmm.memory.SlotMemory`) applies are
:class:`ChunkRotations`, by how its slots hold their keys (:class:`KeyStorage`; the cases are described in
:mod:`rmm.memory`). Built at every chunk (:meth:`ChunkRotations.begin`) from the queries' positions
[N, Q]; each table is cos, sin [..., Q or R, rot / 2] of :class:`Rotary`, applied per layer:

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

import re
from dataclasses import dataclass
from enum import Enum

import torch
from transformers import PreTrainedModel

from rmm.errors import UnsupportedModelError
from rmm.recording import RecordingPlan

_BUFFER = re.compile(r"^(?:(?P<kind>\w+?)_)?inv_freq$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_ROTARY_MODULE = re.compile(r"rotary|rope", re.IGNORECASE)  # a rotary module, by its name or its class

# cos and sin of a rotation, per distinct rotation in use: rotation index -> ([..., P, half] each)
Table = dict[int, tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Rotation:
    """One way of rotating a head vector: ``inv_freq`` [rot_dim / 2] (empty: no rotation), pairing, and
    ``offset``, the first rotated channel (the channels before it and past ``offset + rot_dim`` are left
    as they are)."""

    name: str
    inv_freq: torch.Tensor
    interleaved: bool = False
    offset: int = 0

    @property
    def rot_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [..., P, head_dim] by angles with cos, sin [..., P, rot_dim / 2]."""
        if not self.rot_dim:
            return x
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32, or fp64
        start, stop = self.offset, self.offset + self.rot_dim
        head, part, rest = xf[..., :start], xf[..., start:stop], xf[..., stop:]
        if self.interleaved:
            x1, x2 = part[..., 0::2], part[..., 1::2]
            rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        else:
            x1, x2 = part.chunk(2, dim=-1)
            rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return torch.cat([head, rotated, rest], dim=-1).to(x.dtype)

    def placed(self, offset: int) -> Rotation:
        """The same rotation of the channels from ``offset`` on."""
        suffix = f"/from {offset}" if offset else ""
        return Rotation(f"{self.name}{suffix}", self.inv_freq, self.interleaved, offset)


class Rotary:
    """Rotations by arbitrary position offsets, with each layer's rotation.

    ``attention_scaling`` (YaRN, LongRoPE) is already applied once by the model and is deliberately
    not applied again.
    """

    def __init__(self, model: PreTrainedModel):
        n_layers = model.config.get_text_config().num_hidden_layers
        # no candidate: a model without rotary positions (learned absolute positions), whose keys cannot
        # move to other positions (the engine then refuses what would need it). max_positions: the positions
        # the model's rotary sin/cos tables cover, past which its own forward fails (None: frequencies,
        # which cover every position)
        self.candidates, defaults, self.max_positions = _candidates(model, n_layers)
        # multi-head latent attention: a key is qk_nope_head_dim unrotated channels, then the rotated ones
        unrotated = getattr(model.config.get_text_config(), "qk_nope_head_dim", None)
        if unrotated:
            placed = {id(r): r.placed(unrotated) for r in defaults}
            defaults = [placed[id(r)] for r in defaults]
        self.layers: list[Rotation] = defaults or [_NONE] * n_layers  # the rotation of each layer

    @property
    def rot_dim(self) -> int:
        """The rotated channels of the first rotated layer (0 when no layer is rotated)."""
        return next((r.rot_dim for r in self.layers if r.rot_dim), 0)

    def table(self, delta: torch.Tensor) -> Table:
        """cos and sin of a rotation by ``delta`` [..., P] positions for every rotation in use."""
        table: Table = {}
        for rotation in self.layers:
            key = id(rotation)
            if key not in table and rotation.rot_dim:
                freq = rotation.inv_freq
                angles = delta.to(freq.device, torch.float32)[..., None] * freq
                table[key] = (angles.cos(), angles.sin())
        return table

    def apply(self, x: torch.Tensor, table: Table, layer: int) -> torch.Tensor:
        """Rotate ``x`` [..., P, head_dim] of ``layer`` by a precomputed :meth:`table`."""
        rotation = self.layers[layer]
        if not rotation.rot_dim:
            return x
        return rotation.apply(x, *table[id(rotation)])

    def rotate(self, x: torch.Tensor, delta: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """Rotate ``x`` [..., P, head_dim] of ``layer`` by ``delta`` positions (broadcastable to [..., P])."""
        return self.apply(x, self.table(delta), layer)

    def to(self, device: torch.device) -> Rotary:
        moved = {id(r): _moved(r, device) for r in self.candidates + self.layers}
        self.candidates = [moved[id(r)] for r in self.candidates]
        self.layers = [moved[id(r)] for r in self.layers]
        return self

    def calibrate(
        self, before: dict[int, torch.Tensor], after: dict[int, torch.Tensor], delta: int, tolerance: float
    ) -> dict[int, tuple[str, float]]:
        """Choose each layer's rotation from the model's own: ``before`` and ``after`` map a layer to the
        vectors [..., P, head_dim] the model produced at positions p and p + ``delta`` (same inputs).

        A layer keeps its default rotation when it reproduces ``after`` within ``tolerance`` (relative
        Frobenius error); otherwise the best candidate within it is taken. Layers absent from ``before``
        keep their default. Returns layer -> (rotation name, relative error). Raises
        :class:`UnsupportedModelError` when no candidate reproduces a layer.
        """
        found: dict[int, tuple[str, float]] = {}
        every: dict[int, list[Rotation]] = {}  # per head dimension: one object per rotation, shared tables
        for layer, x0 in before.items():
            width = x0.shape[-1]
            if width not in every:
                every[width] = self._all(width)
            options = [self.layers[layer]] + [r for r in every[width] if r is not self.layers[layer]]
            errors = []
            for rotation in options:
                if rotation.offset + rotation.rot_dim > width:
                    continue
                error = _error(rotation, x0, after[layer], delta)
                errors.append((error, rotation))
                if error <= tolerance:
                    break
            error, best = min(errors, key=lambda e: e[0])
            if error > tolerance:
                names = ", ".join(f"{r.name} {e:.2g}" for e, r in sorted(errors, key=lambda e: e[0])[:3])
                raise UnsupportedModelError(
                    f"layer {layer}: no rotation the harness knows reproduces the model's own rotary "
                    f"positions (relative errors: {names}; tolerance {tolerance:g}), so keys cannot be "
                    "moved to other positions; use positions=original with a policy that does not read "
                    "keys or queries"
                )
            self.layers[layer] = best
            found[layer] = (best.name, error)
        return found

    def check(
        self, captured: list[tuple[dict, dict]], delta: int, tolerance: float, queries: bool
    ) -> dict[int, tuple[str, float]]:
        """Calibrate on the model's own keys and check its queries: ``captured`` holds (keys, queries), each
        layer -> [..., P, head_dim], at positions p and at p + ``delta`` (same inputs). With ``queries``,
        every layer's queries must rotate by its rotation too. Returns :meth:`calibrate`'s layer -> (rotation
        name, relative error); raises :class:`UnsupportedModelError` naming the first cause."""
        (keys0, queries0), (keys1, queries1) = captured
        try:
            found = self.calibrate(keys0, keys1, delta, tolerance)
        except UnsupportedModelError as err:
            cause = self._queries_moved(captured, delta, tolerance)
            if cause is None:
                raise
            raise cause from err
        for layer in queries0 if queries else ():
            error = self.error(layer, queries0[layer], queries1[layer], delta)
            if error > tolerance:
                raise UnsupportedModelError(
                    f"layer {layer}'s queries at shifted positions are not its rotation of the same queries "
                    f"(relative error {error:.3g}, tolerance {tolerance:g}): the model changes queries with "
                    "their position beyond RoPE; use positions=original with a policy that reads no queries"
                )
        return found

    def _queries_moved(
        self, captured: list[tuple[dict, dict]], delta: int, tolerance: float
    ) -> UnsupportedModelError | None:
        """Where a layer's keys at shifted positions are no rotation of its keys: the first earlier layer
        whose keys rotate but whose queries do not (Beam's NoPE layers scale queries by their position),
        which makes every later layer's keys depend on absolute positions; None when there is none."""
        (keys0, queries0), (keys1, queries1) = captured
        for layer in keys0:
            if self.error(layer, keys0[layer], keys1[layer], delta) > tolerance:
                return None  # this layer's keys fail first: no earlier cause among the queries
            error = self.error(layer, queries0[layer], queries1[layer], delta)
            if error > tolerance:
                return UnsupportedModelError(
                    f"layer {layer} changes its queries with their absolute position beyond RoPE (Beam's "
                    f"NoPE layers scale them by the position: at positions shifted by {delta} they are no "
                    f"rotation of the same queries, relative error {error:.3g}, tolerance {tolerance:g}, "
                    "while its keys are), so the keys of the layers after it depend on absolute positions "
                    "and no rotation moves them to other positions; use positions=original with a policy "
                    "that reads no keys or queries"
                )
        return None

    def error(self, layer: int, before: torch.Tensor, after: torch.Tensor, delta: int) -> float:
        """Relative error of ``layer``'s rotation by ``delta`` of ``before`` against ``after`` [..., P, D]."""
        return _error(self.layers[layer], before, after, delta)

    def _all(self, width: int) -> list[Rotation]:
        """Every candidate for head vectors of ``width`` channels: each frequency buffer in both pairings
        and both directions, on the first channels and then on the last, and no rotation."""
        out = []
        for r in self.candidates:
            out += [r, Rotation(f"{r.name}/interleaved", r.inv_freq, True)]
        for r in self.candidates:
            out += [
                Rotation(f"{r.name}/reversed", -r.inv_freq),
                Rotation(f"{r.name}/interleaved/reversed", -r.inv_freq, True),
            ]
        last = [r.placed(width - r.rot_dim) for r in out if 0 < r.rot_dim < width]
        return out + last + [_NONE]


_NONE = Rotation("none", torch.zeros(0))


def _moved(rotation: Rotation, device: torch.device) -> Rotation:
    return Rotation(rotation.name, rotation.inv_freq.to(device), rotation.interleaved, rotation.offset)


def _error(rotation: Rotation, before: torch.Tensor, after: torch.Tensor, delta: int) -> float:
    """||rotation(before, delta) - after|| / ||after|| (Frobenius, float32)."""
    angles = float(delta) * rotation.inv_freq.to(before.device)
    moved = rotation.apply(before.float(), angles.cos(), angles.sin())
    after = after.float()
    return float((moved - after).norm() / after.norm().clamp_min(1e-12))


def table_frequencies(table: torch.Tensor) -> torch.Tensor | None:
    """The inverse frequencies [k] of a sin/cos table [P, 2k] whose row p is ``[sin(p * f), cos(p * f)]``
    (or ``[cos, sin]``), as GPT-J's and CodeGen's ``create_sinusoidal_positions`` builds it; None when
    ``table`` is no such table (or has fewer than 2 rows).

    ``f`` is read from row 1 (``atan2``; exact for ``|f| < pi``) and refined on the last row checked, and
    must reproduce every row checked (the first :data:`_TABLE_ROWS`) within :data:`_TABLE_TOLERANCE`.
    """
    if table.ndim != 2 or not table.is_floating_point() or table.shape[0] < 2 or table.shape[1] % 2:
        return None
    k = table.shape[1] // 2
    zero = table[0].detach().double().cpu()  # row 0: sin 0 = 0, cos 0 = 1
    zeros, ones = torch.zeros(k, dtype=torch.float64), torch.ones(k, dtype=torch.float64)
    orders = [order for order in ((zeros, ones), (ones, zeros)) if _close(zero, torch.cat(order))]
    if not orders:
        return None
    sin_first = orders[0][0] is zeros
    rows = table.detach()[:_TABLE_ROWS].double().cpu()
    sin, cos = (rows[:, :k], rows[:, k:]) if sin_first else (rows[:, k:], rows[:, :k])
    freq = torch.atan2(sin[1], cos[1])
    last = rows.shape[0] - 1
    if last > 1:  # refine on the last row: its angle, unwrapped by the estimate, over its position
        angle = torch.atan2(sin[last], cos[last])
        turns = torch.round((last * freq - angle) / (2 * torch.pi))
        freq = (angle + 2 * torch.pi * turns) / last
    angles = torch.arange(rows.shape[0], dtype=torch.float64)[:, None] * freq
    return freq.float() if _close(angles.sin(), sin) and _close(angles.cos(), cos) else None


def _close(x: torch.Tensor, y: torch.Tensor) -> bool:
    return bool((x - y).abs().max() <= _TABLE_TOLERANCE)


# the rows of a sin/cos table checked (past them fp32 rounding of p * f grows past the tolerance)
_TABLE_ROWS = 4096
_TABLE_TOLERANCE = 1e-3


def _candidates(model: PreTrainedModel, n_layers: int) -> tuple[list[Rotation], list[Rotation], int | None]:
    """The model's frequency buffers (``*inv_freq``, or the frequencies of a rotary module's sin/cos table:
    :func:`table_frequencies`) as rotations, and each layer's default: the buffer of its own rotary module
    (``layers.<i>.``) or of its layer type (``<type>_inv_freq``), else the first without a layer type; and
    the positions the model's sin/cos tables cover (their fewest rows; None without a table)."""
    config = model.config.get_text_config()
    layer_types = list(getattr(config, "layer_types", None) or [])
    by_name: dict[str, Rotation] = {}
    typed: set[str] = set()  # the names of the buffers of one layer type
    own: dict[int, Rotation] = {}
    rows: list[int] = []  # of each sin/cos table read
    for module_name, module in model.named_modules():
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if "original" in buffer_name or buffer.numel() == 0:
                continue
            match = _BUFFER.match(buffer_name)
            if match:
                freq = buffer.detach().float().flatten()
            elif _ROTARY_MODULE.search(f"{module_name} {type(module).__name__}"):
                freq = table_frequencies(buffer)  # not an additive sinusoidal table (CTRL's pos_encoding)
                rows += [buffer.shape[0]] if freq is not None else []
            else:
                continue
            if freq is None:
                continue
            name = f"{module_name}.{buffer_name}"
            if match and match.group("kind"):
                typed.add(name)
            rotation = Rotation(name, freq)
            if any(
                r.rot_dim == rotation.rot_dim and torch.equal(r.inv_freq, rotation.inv_freq)
                for r in by_name.values()
            ):
                rotation = next(r for r in by_name.values() if torch.equal(r.inv_freq, rotation.inv_freq))
            by_name.setdefault(name, rotation)
            layer = _LAYER.search(f"{module_name}.")
            if layer is not None:
                own[int(layer.group(1))] = rotation
            elif match and match.group("kind"):
                for i, kind in enumerate(layer_types):
                    if kind == match.group("kind"):
                        own.setdefault(i, rotation)
    candidates = list({id(r): r for r in by_name.values()}.values())
    if not candidates:
        return [], [], None
    default = next((r for name, r in by_name.items() if name not in typed), candidates[0])
    return candidates, [own.get(i, default) for i in range(n_layers)], min(rows, default=None)


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
