"""Future reuse recorded by a reference pass (:mod:`rmm.lookahead`): who attends to whom, as sparse
request events.

Key j is *requested* by query s when the reference pass's attention a*_s(j) (GQA group summed) is at
least ``tau``. Events are stored sorted by a single int64 code ((layer * H + head) * N + j) * N + s,
so next-request times, remaining attention mass and remaining utility are one ``searchsorted`` away.

The reference pass also scores its own predictions: per query s, ``correct`` (argmax p(. | s) =
x_{s+1}), ``prob`` (p(x_{s+1} | s)) and ``uniform`` (1), with 0 for the last query's ``correct`` and
``prob`` (it has no target). The remaining utility weights each request's attention by its query's
weight (the smoother, rmm's H = infinity limit).
"""

from __future__ import annotations

import torch


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
