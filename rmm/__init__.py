"""Perplexity under a bounded KV memory: a harness for KV-cache eviction policies."""
