"""Measure: traffic and its figures. The closed-loop load generator at a fixed concurrency, streaming, seeded
(`load`), open-loop arrivals at a rate (`openloop`), and the pure per-request records -> summary (throughput, accept
length, TTFT/ITL/e2e percentiles, bootstrap CI) that every later stage reads (`summary`); the engine's own account
of what it runs, its `/server_info` answer parsed once (`server_info`); one engine pass's typed result, its summary
and its ending (`measurement`)."""

__all__ = ["load", "measurement", "openloop", "server_info", "summary"]
