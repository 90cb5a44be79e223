"""Eviction policies, one per file, and the registry that builds them from a config."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

from rmm.policies.base import (
    NEEDS,
    POLICIES,
    Observation,
    Policy,
    PositionRule,
    ReferencePass,
    ScorePolicy,
    registry,
)

# every module of this package but the bases and the selection defines one policy, registered by its
# @register decorator as it is imported: a new policy is a new file here (docs/adding_a_policy.md)
for _module in pkgutil.iter_modules(__path__):
    if _module.name not in ("base", "select"):
        importlib.import_module(f"{__name__}.{_module.name}")

_NOT_PARAMETERS = {"name", "tag"}


def make_policy(cfg: Mapping[str, Any], budget: int | None, chunk: int) -> Policy:
    """Build a policy from its config node (``name`` plus parameters)."""
    name = cfg["name"]
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}")
    params = {k: v for k, v in cfg.items() if k not in _NOT_PARAMETERS}
    try:
        return POLICIES[name](budget=budget, chunk=chunk, **params)
    except TypeError as err:
        raise ValueError(f"bad parameters for policy {name!r}: {err}") from err


__all__ = [
    "NEEDS",
    "POLICIES",
    "Observation",
    "Policy",
    "PositionRule",
    "ReferencePass",
    "ScorePolicy",
    "make_policy",
    "registry",
]
