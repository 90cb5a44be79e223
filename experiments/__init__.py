"""Experiment scripts: benchmark, collection of run directories, figures (runnable as scripts)."""
