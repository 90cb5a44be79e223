"""The harness's own errors (a leaf module: anything may raise them without importing what raises them)."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The model's attention asks for something the bounded attention does not reproduce."""
