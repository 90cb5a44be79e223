"""Eviction policies, one per file, and the registry that builds them from a config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rmm.policies.base import Policy, QueryBatch
from rmm.policies.full import Full
from rmm.policies.h2o import H2O
from rmm.policies.oracle import Oracle
from rmm.policies.random_subset import RandomSubset
from rmm.policies.rmm import RMM
from rmm.policies.streaming_llm import StreamingLLM
from rmm.policies.tova import TOVA
from rmm.policies.window import Window

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (Full, Window, StreamingLLM, H2O, RMM, TOVA, RandomSubset, Oracle)
}

_NOT_PARAMETERS = {"name", "tag"}


def make_policy(cfg: Mapping[str, Any], budget: int | None, chunk: int, seed: int = 0) -> Policy:
    """Build a policy from its config node (``name`` plus parameters); budget is ignored by ``full``."""
    name = cfg["name"]
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}")
    cls = POLICIES[name]
    params = {k: v for k, v in cfg.items() if k not in _NOT_PARAMETERS}
    if cls is RandomSubset:
        params.setdefault("seed", seed)
    if cls is Full:
        budget = None
    try:
        return cls(budget=budget, chunk=chunk, **params)
    except TypeError as err:
        raise ValueError(f"bad parameters for policy {name!r}: {err}") from err


__all__ = ["POLICIES", "Policy", "QueryBatch", "make_policy"]
