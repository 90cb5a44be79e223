"""Perplexity under a bounded KV memory: a harness for KV-cache eviction policies.

The public API (everything else is internal):

- :func:`evaluate`: perplexity of a loaded Hugging Face causal LM under an eviction policy;
- :func:`compare`: the paired difference of two evaluations with its 95 % interval;
- :class:`Evaluation`: what :func:`evaluate` returns (``ppl``, ``metrics``, ``tokens``, ``save(dir)``);
- :func:`load_model`: (model, tokenizer) of a shipped model config (``smollm2_135m`` offline), a local
  directory or a hub id.

``import rmm`` imports nothing else (no torch, no transformers, no OmegaConf); the API is imported on first
use. Code that composes the configs in conf/ imports :mod:`rmm.config` first, which registers their
resolvers.
"""

from typing import Any

__all__ = ["Evaluation", "compare", "evaluate", "load_model"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from rmm import api

        return getattr(api, name)
    raise AttributeError(f"module 'rmm' has no attribute {name!r}")
