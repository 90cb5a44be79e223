"""Future reuse recorded by a reference pass (:mod:`rmm.lookahead`): who attends to whom, as sparse
request events.

Key j is *requested* by query s when the reference pass's attention a*_s(j) (GQA group summed) is at
least ``tau``. Events are stored sorted by a single int64 code ((layer * H + head) * N + j) * N + s,
so next-request times, remaining attention mass and remaining utility are one ``searchsorted`` away.

The reference pass also scores its own predictions: per query s, ``correct`` (argmax p(. | s) =
x_{s+1}), ``prob`` (p(x_{s+1} | s)) and ``uniform`` (1), with 0 for the last query's ``correct`` and
``prob`` (it has no target). The remaining utility weights each request's attention by its query's
weight (the smoother, rmm's H = infinity limit).

Events whose attention lies within :data:`rmm.divergence.TIE_MARGIN` of tau (relative) are near-ties:
another machine may record them the other way. The reference pass records them down to
tau (1 - TIE_MARGIN), and :meth:`FutureRequests.bounds` gives the requests had all of them gone against the
request or for it (the oracles' score bounds, :meth:`rmm.policies.ScorePolicy.score_bounds`).
"""

from __future__ import annotations

import torch

from rmm.divergence import TIE_MARGIN


class FutureRequests:
    """Sparse reference attention of one document of ``n_tokens`` tokens.

    Parameters
    ----------
    codes : [E] int64 event codes ((layer * n_heads + head) * n_tokens + key) * n_tokens + query.
    mass : [E] float reference attention of each event.
    query_weights : weight name -> [n_tokens] float, the reference pass's own weight of each query
        (``correct``, ``prob``); ``uniform`` is implied.
    tau : the request threshold the events were recorded at (None: every event is a request); events below
        it are near misses, kept apart with the near hits (``near_codes``, ``near_mass``).
    """

    def __init__(
        self,
        n_layers: int,
        n_heads: int,
        n_tokens: int,
        codes: torch.Tensor,
        mass: torch.Tensor,
        query_weights: dict[str, torch.Tensor] | None = None,
        tau: float | None = None,
    ):
        self.tau = tau
        near = torch.zeros_like(codes, dtype=torch.bool)
        if tau is not None:
            near = (mass.double() / tau - 1).abs() < TIE_MARGIN
            codes, mass, self.near_codes, self.near_mass = (
                codes[mass >= tau],
                mass[mass >= tau],
                codes[near],
                mass[near],
            )
        else:
            self.near_codes, self.near_mass = codes[near], mass[near]
        self._bounds: tuple[FutureRequests, FutureRequests] | None = None
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

    def recorded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every recorded event's code and fp32 mass, requests and near misses: what the constructor takes."""
        miss = (
            self.near_mass < self.tau
            if self.tau is not None
            else torch.zeros_like(self.near_codes, dtype=bool)
        )
        return torch.cat([self.codes, self.near_codes[miss]]), torch.cat(
            [self.mass.float(), self.near_mass[miss].float()]
        )

    def bounds(self) -> tuple[FutureRequests, FutureRequests]:
        """The requests had every near-tie with tau gone against the request, and for it."""
        if self._bounds is None:
            hit = self.near_mass >= self.tau
            firm = ~torch.isin(self.codes, self.near_codes[hit])
            loose = (
                torch.cat([self.codes, self.near_codes[~hit]]),
                torch.cat([self.mass, self.near_mass[~hit].double()]),
            )
            shape, weights = (self.n_layers, self.n_heads, self.n_tokens), self.query_weights
            self._bounds = (
                FutureRequests(*shape, self.codes[firm], self.mass[firm], weights),
                FutureRequests(*shape, *loose, weights),
            )
        return self._bounds

    def threshold_distance(self, key_pos: torch.Tensor, now: int) -> torch.Tensor:
        """[L, H, S] float64: the smallest |a/tau - 1| of a near-tie event of each key from a query s >= now
        (inf where none)."""
        n = self.n_tokens
        later = self.near_codes % n >= now
        table = torch.full((self.n_layers * self.n_heads * n,), torch.inf, dtype=torch.float64)
        distance = (self.near_mass[later].double() / self.tau - 1).abs()
        table.scatter_reduce_(0, self.near_codes[later] // n, distance, "amin")
        found = table[(self._bases(key_pos) // n).cpu()].to(key_pos.device)
        return torch.where(key_pos >= 0, found, torch.inf)
