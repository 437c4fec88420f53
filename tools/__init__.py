"""Benchmarks, the NVML profiler and training scripts; they use the public API only."""
