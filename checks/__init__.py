"""The harness's own checks: speed and memory benches, the GPU check, the planner and its time model,
bad inputs, the mutation check, kvpress parity and the re-run of committed runs (docs/testing.md)."""
