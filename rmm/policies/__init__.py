"""Eviction policies, one per file, and the registry that builds them from a config."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rmm.policies.base import NEEDS, Observation, Policy, PositionRule, ReferencePass, ScorePolicy
from rmm.policies.expected_attention import ExpectedAttention
from rmm.policies.full import Full
from rmm.policies.h2o import H2O
from rmm.policies.keydiff import KeyDiff
from rmm.policies.knorm import KNorm
from rmm.policies.lagkv import LagKV
from rmm.policies.lru import LRU
from rmm.policies.observed_attention import ObservedAttention
from rmm.policies.oracle import Oracle
from rmm.policies.random_subset import RandomSubset
from rmm.policies.restkv import ReSTKV
from rmm.policies.rmm import RMM
from rmm.policies.snapkv import SnapKV
from rmm.policies.streaming_llm import StreamingLLM
from rmm.policies.tova import TOVA
from rmm.policies.window import Window


def registry(classes: Iterable[type[Policy]]) -> dict[str, type[Policy]]:
    """Policy classes by their ``name``; two classes with one name are refused."""
    table: dict[str, type[Policy]] = {}
    for cls in classes:
        if cls.name in table:
            raise ValueError(
                f"two policies are named {cls.name!r}: {table[cls.name].__name__} and {cls.__name__}"
            )
        table[cls.name] = cls
    return table


POLICIES = registry(
    (
        Full,
        Window,
        StreamingLLM,
        H2O,
        RMM,
        TOVA,
        RandomSubset,
        Oracle,
        ObservedAttention,
        SnapKV,
        KNorm,
        KeyDiff,
        LRU,
        LagKV,
        ReSTKV,
        ExpectedAttention,
    )
)

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
]
