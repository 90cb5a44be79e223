"""The stream options besides the policy, in one place: their allowed values and their check.

:class:`StreamOptions` is what :func:`rmm.evaluate`, ``python run.py`` (rmm/runner.py), lm-eval's model
(rmm/lm_eval.py) and :class:`~rmm.engine.StreamingEngine` pass along; no heavy import, so the config check
(:func:`rmm.config.check_config`) runs it before torch loads. What depends on the policy or the model as
well (an allocation a position rule cannot use, cache positions for a policy that reads cached keys) is
checked where those are known: :func:`rmm.policies.select.check_allocation`,
:func:`rmm.policies.select.check_positions`, the engine's model checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

POSITIONS = ("original", "cache")  # where a retained key sits: its position in the document, or its rank
SCOPES = ("head", "layer", "global")  # one kept set per (layer, KV head), per layer, or for the model
ALLOCATIONS = ("uniform", "adaptive", "pyramid")  # the budget across heads and layers
LAYERS = ("all", "global")  # the policy decides in every layer, or in global layers only


@dataclass(frozen=True)
class StreamOptions:
    """How a stream is bounded besides its policy (docs/semantics.md).

    positions : ``original`` | ``cache``; scope : ``head`` | ``layer`` | ``global``;
    allocation : ``uniform`` | ``adaptive`` | ``pyramid``; layers : ``all`` | ``global``;
    batch : streams per forward pass (>= 1; a stream's results do not depend on it beyond fp32 rounding).
    Raises ValueError naming the key and the fix."""

    positions: str = "original"
    scope: str = "head"
    allocation: str = "uniform"
    layers: str = "all"
    batch: int = 1

    def __post_init__(self) -> None:
        for key, allowed in (
            ("positions", POSITIONS),
            ("scope", SCOPES),
            ("allocation", ALLOCATIONS),
            ("layers", LAYERS),
        ):
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key} must be one of {allowed}, got {getattr(self, key)!r}")
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"batch must be an integer >= 1 (streams per forward pass), got {self.batch!r}")
        if self.layers == "global" and self.allocation != "uniform":
            raise ValueError(
                "layers=global keeps the windowed layers out of the policy's budget, which "
                f"allocation={self.allocation} spreads over every layer: use allocation=uniform, or "
                "layers=all"
            )

    @classmethod
    def given(cls, options: StreamOptions | None = None, **fields: Any) -> StreamOptions:
        """``options``, or the options of ``fields`` (keywords: ``positions="cache"``), never both."""
        if options is None:
            return cls(**fields)
        if not isinstance(options, StreamOptions):
            raise TypeError(
                f"options must be a StreamOptions (or give positions=, scope=, ...), got {options!r}"
            )
        if fields:
            raise TypeError("give the stream options as options= or as keywords, not both")
        return options

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> StreamOptions:
        """The options of a run config (``allocation``, ``layers`` and ``batch`` optional: configs written
        before them)."""
        return cls(
            positions=cfg["positions"],
            scope=cfg["scope"],
            allocation=cfg.get("allocation", "uniform"),
            layers=cfg.get("layers", "all"),
            batch=cfg.get("batch", 1),
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
