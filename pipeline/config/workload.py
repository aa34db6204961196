"""What a study measures with (`workload:`): the prompts, their splits and lengths, and how requests arrive."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from serve.spec import FrozenModel

# Longest generation a workload may ask for: one measured request would otherwise run for hours.
MAX_NEW_TOKENS_LIMIT = 32_768


class ArrivalSettings(FrozenModel):
    """How measured requests arrive (`workload.arrival`). `closed` (the default): `concurrency` requests in flight,
    each client sends its next prompt when its previous one finished (pipeline/measure/load.py). `poisson`: open loop, seeded
    Poisson arrivals at `rate_per_s` whether or not earlier requests finished (pipeline/measure/openloop.py), bounded in count
    (the measured prompts) and in time (no request starts after `max_duration_s`). Warm-up stays closed loop."""

    model_config = ConfigDict(**FrozenModel.model_config, allow_inf_nan=False)

    mode: Literal["closed", "poisson"] = Field("closed", description="closed loop (concurrency) or open loop (rate)")
    rate_per_s: float | None = Field(None, gt=0, description="poisson: mean arrivals per second (offered load)")
    max_duration_s: float | None = Field(None, gt=0, description="poisson: no request starts after this many seconds "
                                         "from the first; started ones run to completion")

    @model_validator(mode="after")
    def _consistent(self) -> ArrivalSettings:
        given = {k: getattr(self, k) for k in ("rate_per_s", "max_duration_s") if getattr(self, k) is not None}
        if self.open_loop and len(given) < 2:
            raise ValueError(
                f"mode poisson needs {' and '.join(k for k in ('rate_per_s', 'max_duration_s') if k not in given)} "
                f"(got rate_per_s={self.rate_per_s!r}, max_duration_s={self.max_duration_s!r}). Fix: e.g. arrival: "
                "{mode: poisson, rate_per_s: 0.5, max_duration_s: 60}: open-loop load is bounded in time and count")
        if not self.open_loop and given:
            raise ValueError(f"{', '.join(f'{k}={v!r}' for k, v in given.items())} apply to mode poisson only, got "
                             "mode closed. Fix: set mode: poisson for open-loop arrivals, or remove them")
        return self

    @property
    def open_loop(self) -> bool:
        return self.mode == "poisson"

    def describe(self, concurrency: int) -> str:  # for logs and MLflow tags
        if self.open_loop:
            return f"open loop: poisson {self.rate_per_s:g} req/s, arrivals within {self.max_duration_s:g} s"
        return f"closed loop: concurrency {concurrency}"


class WorkloadSettings(FrozenModel):
    """Defaults sized so the default study (8 trials + 6 promotion re-runs) fits in 15 minutes on 2 CPU cores; on a
    GPU node use more prompts and tokens (examples/study-gpu.yaml)."""

    # templated: answers repeat across requests, the case where SGLang's NGRAM (a trie of generated text, not of
    # prompts) pays off once warm and loses when cold; see docs/benchmarks.md "Default study".
    source: str = Field("templated", description="bundled workload name or a JSONL/Parquet file of prompts")
    warmup_prompts: int = Field(8, ge=0, description="size of the warm-up split (warmup_requests draw from it)")
    measure_prompts: int = Field(4, ge=1)
    max_new_tokens: int = Field(24, ge=1, description=f"per-prompt default, at most {MAX_NEW_TOKENS_LIMIT}")
    temperature: float = Field(0.0, ge=0)
    arrival: ArrivalSettings = Field(default_factory=ArrivalSettings, description="closed loop (default) or "
                                     "open-loop poisson arrivals for the measurement")
    # pipeline/measure/window.py: the engine's run-queue wait and the hypervisor's steal over the window, and its
    # decode steps against the engine's calibration
    remeasure: int = Field(2, ge=0, le=5, description="a measurement window other work disturbed (the engine waited "
                           "for its cores, or the hypervisor took them) is measured again at most this often, after a "
                           "flush and the same warm-up; 0 = record it as it is, flagged")
    wait_limit: float = Field(0.15, gt=0, lt=1, description="a window is disturbed when the engine's threads waited "
                              "for a core more than this share of their runnable time, beyond what their own demand "
                              "past the node's cores makes them wait")
    steal_limit: float = Field(0.05, gt=0, lt=1, description="a window is disturbed when the hypervisor took more than "
                               "this share of the node's CPU time (steal); raise it on a VM whose steal never drops")
    step_limit: float = Field(1.5, gt=1, description="a window is disturbed when its lone plain decode steps, timed "
                              "by an engine that measured its own round table (the CPU engine), took more than this "
                              "many times the table's step: the machine ran slower than when the engine was "
                              "calibrated")

    @field_validator("max_new_tokens")
    @classmethod
    def _bounded(cls, value: int) -> int:
        if value > MAX_NEW_TOKENS_LIMIT:
            raise ValueError(
                f"must be <= {MAX_NEW_TOKENS_LIMIT} (one measured request would run for hours and no model the tuner "
                f"targets has a longer context); got {value}. Fix: use a value such as 24 (CPU) or 256 (GPU)")
        return value
