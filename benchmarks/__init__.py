"""Benchmarks (not tests): see docs/benchmarks.md."""
