"""Eviction policies, one per file, and the registry that builds them from a config."""

from __future__ import annotations

import dataclasses
import importlib
import numbers
import pkgutil
import typing
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
    _check_types(POLICIES[name], params)
    try:
        return POLICIES[name](budget=budget, chunk=chunk, **params)
    except TypeError as err:
        raise ValueError(f"bad parameters for policy {name!r}: {err}") from err


def _check_types(cls: type[Policy], params: Mapping[str, Any]) -> None:
    """Refuse a parameter whose value is not of its field's plain type (int, float, str, bool, or a union
    of them), naming it: ``policy.rho=abc`` fails here rather than inside the policy's own checks."""
    fields = {field.name: field for field in dataclasses.fields(cls)}
    for key, value in params.items():
        names = _type_names(fields[key].type) if key in fields else []
        if not names or not set(names) <= _PLAIN.keys():
            continue  # no such field (the constructor names it) or not a plain type
        if not any(_is_a(value, _PLAIN[kind][0]) for kind in names):
            raise ValueError(
                f"policy.{key} must be {' or '.join(_PLAIN[kind][1] for kind in names)}, got {value!r}"
            )


def _type_names(annotation: Any) -> list[str]:
    """The names of the types a field's annotation allows (``int | None`` -> ["int", "None"]), whether the
    annotation was postponed (a string) or not."""
    if isinstance(annotation, str):
        return [part.strip() for part in annotation.split("|")]
    members = typing.get_args(annotation) or (annotation,)
    return ["None" if member is type(None) else getattr(member, "__name__", "?") for member in members]


# a plain type's name -> the type and how a message names it
_PLAIN = {
    "int": (int, "an integer"),
    "float": (float, "a number"),
    "str": (str, "a string"),
    "bool": (bool, "true or false"),
    "None": (type(None), "null"),
}


def _is_a(value: Any, kind: type) -> bool:
    """Whether ``value`` is of the plain type ``kind`` (NumPy numbers too; an integer counts as a float, a
    bool as neither)."""
    if kind is type(None):
        return value is None
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, {int: numbers.Integral, float: numbers.Real}.get(kind, kind))


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
