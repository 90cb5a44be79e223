"""Perplexity under a bounded KV memory: a harness for KV-cache eviction policies."""

from rmm.config import register_resolvers

register_resolvers()
