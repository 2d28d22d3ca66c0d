"""Benchmarks (hurray-bench) and the producer-stall timing used by scripts/gpu-check."""
