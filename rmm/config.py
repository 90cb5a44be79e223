"""The OmegaConf resolvers the configs in conf/ use, registered when ``rmm`` is imported.

- ``${when:A,B,TEXT}``: TEXT when A equals B, else the empty string (a run-name part that only one
  value of a parameter needs, e.g. the oracle's query weight, which only ``future_utility`` reads).
"""

from __future__ import annotations

from omegaconf import OmegaConf


def when(value: object, expected: object, text: str) -> str:
    return str(text) if value == expected else ""


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("when", when, replace=True)
