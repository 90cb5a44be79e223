"""Run-config checks that need neither torch nor transformers, and the OmegaConf resolvers of conf/.

:func:`check_config` validates a composed config in milliseconds, before any heavy import, so that a typo
fails a run (or every job of a sweep) at once with a message that names the fix. What needs the policy
classes or the dataset code (policy parameters, dataset generator settings) is checked next by
:func:`check_run`, still before a model is loaded.

Resolvers, registered when this module is imported (every code path that composes conf/ imports it):

- ``${when:A,B,TEXT}``: TEXT when A equals B, else the empty string (a run-name part that only one
  value of a parameter needs, e.g. the oracle's query weight, which only ``future_utility`` reads).
- ``${unless:A,B,TEXT}``: TEXT unless A equals B, else the empty string (a run-name part that the
  default value of a parameter leaves out, so that run directories written before it keep their names).
"""

from __future__ import annotations

import netrc
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from rmm.options import StreamOptions

if TYPE_CHECKING:  # imported by check_run only: this module stays free of torch
    from rmm.data import DatasetConfig
    from rmm.policies import Policy

DTYPES = ("auto", "float32", "bfloat16", "float16")
WANDB_MODES = ("offline", "online", "disabled")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_WANDB_HOST = "api.wandb.ai"


def when(value: object, expected: object, text: str) -> str:
    return str(text) if value == expected else ""


def unless(value: object, expected: object, text: str) -> str:
    return "" if value == expected else str(text)


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("when", when, replace=True)
    OmegaConf.register_new_resolver("unless", unless, replace=True)


def _positive_int(value: Any, key: str, nullable: bool = False) -> None:
    if value is None and nullable:
        return
    if type(value) is not int or value < 1:
        raise ValueError(f"{key} must be an integer >= 1{' or null' if nullable else ''}, got {value!r}")


def check_config(cfg: Mapping[str, Any]) -> StreamOptions:
    """Validate the options of a composed run config that need no heavy import; raises ValueError naming
    the key and the fix. Returns its stream options."""
    _positive_int(cfg["budget"], "budget", nullable=True)
    _positive_int(cfg["chunk"], "chunk")
    if cfg["budget"] is not None and cfg["chunk"] > cfg["budget"]:
        raise ValueError(
            f"chunk ({cfg['chunk']}) must not exceed budget ({cfg['budget']}); set chunk<={cfg['budget']}"
        )
    if cfg["lag"] != "auto" and (type(cfg["lag"]) is not int or cfg["lag"] < 0):
        raise ValueError(f"lag must be an integer >= 0 or auto (rmm chooses it online), got {cfg['lag']!r}")
    if str(cfg["dtype"]) not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {cfg['dtype']!r}")
    oracle = cfg["oracle"]
    if not isinstance(oracle["tau"], int | float) or oracle["tau"] <= 0:
        raise ValueError(f"oracle.tau must be > 0, got {oracle['tau']!r}")
    _positive_int(oracle["context"], "oracle.context", nullable=True)
    check_device(str(cfg["device"]))
    check_wandb(cfg["wandb"])
    return StreamOptions.from_config(cfg)  # positions, scope, allocation, layers, batch


def check_device(name: str) -> None:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``; CUDA must have a driver on this machine."""
    name = name.strip().lower()
    if not _DEVICE.match(name):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if name.startswith("cuda") and not _nvidia_driver():
        raise ValueError(
            f"device={name} was requested but this machine has no NVIDIA driver (no /proc/driver/nvidia); "
            "run with device=cpu or device=auto"
        )


def _nvidia_driver() -> bool:
    return Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidiactl").exists()


def check_wandb(wandb_cfg: Mapping[str, Any]) -> None:
    """The W&B mode is known, and ``online`` has an API key (WANDB_API_KEY or a ``wandb login``)."""
    mode = str(wandb_cfg.get("mode", "offline"))
    if mode not in WANDB_MODES:
        raise ValueError(f"wandb.mode must be one of {WANDB_MODES}, got {mode!r}")
    if mode == "online" and not _wandb_key():
        raise ValueError(
            "wandb.mode=online needs a W&B API key, and none is configured: set WANDB_API_KEY=<key> "
            "(or run `wandb login`), or log locally with wandb.mode=offline (sync later with `wandb sync`), "
            "or turn tracking off with wandb.mode=disabled"
        )


def _wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return path.is_file() and netrc.netrc(path).authenticators(_WANDB_HOST) is not None
    except (netrc.NetrcParseError, OSError):
        return False


@dataclass(frozen=True)
class CheckedRun:
    """What :func:`check_run` resolved, for the run to build with: the dataset's options, the policy and
    the stream options."""

    dataset: DatasetConfig
    policy: Policy
    options: StreamOptions


def check_run(cfg: Mapping[str, Any]) -> CheckedRun:
    """:func:`check_config`, then the policy's parameters and the dataset's options (imports torch and the
    policy and dataset code, not transformers, and loads no model); returns what it resolved."""
    options = check_config(cfg)
    from rmm.data import check_dataset
    from rmm.policies import make_policy
    from rmm.policies.select import check_allocation, check_positions

    dataset = check_dataset(cfg["dataset"])
    policy = make_policy(cfg["policy"], budget=cfg["budget"], chunk=cfg["chunk"])
    check_allocation(options.allocation, options.scope, options.positions, policy)
    check_positions(policy, options.positions)
    return CheckedRun(dataset, policy, options)


register_resolvers()
