"""The model and the engine a study runs (`model:`, `engine:`), and the flags the tuner owns."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_serializer, field_validator, model_validator

from serve.engines.base import EngineKind, redact_env
from serve.engines.spec_flags import ENGINE_OWNED_FLAGS
from serve.spec import DRAFT_MODEL_ALGORITHMS, FrozenModel

# What a POSIX shell accepts as a variable name: the deploy script references each env name as `NAME="$NAME"`.
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def env_name_problem(name: str) -> str | None:
    """Why `name` cannot be an engine environment variable (None: it can). Pure."""
    if ENV_NAME.fullmatch(name):
        return None
    return (f"the name {name!r} is not a variable name (letters, digits and _, not starting with a "
            "digit: [A-Za-z_][A-Za-z0-9_]*); a shell could not set it and the deploy script could not name it. "
            "Fix: rename the key")


def owned_flag_problem(item: str) -> str | None:
    """Why `item` of engine.extra_flags would override a flag the tuner renders itself (None if it does not).
    `--flag=value` counts, and so does a prefix of an owned flag: argparse (SGLang's and the CPU engine's) accepts
    unambiguous prefixes, so `--spec` would reach `--speculative-...`."""
    if not item.startswith("--") or item == "--":
        return None
    name = item.split("=", 1)[0]
    if name in ENGINE_OWNED_FLAGS:
        return f"{item!r} sets {name}, which the tuner renders from the study and the trial"
    prefixed = sorted(flag for flag in ENGINE_OWNED_FLAGS if flag.startswith(name))
    if prefixed:
        return f"{item!r} is a prefix of {prefixed[0]}, which the tuner renders (argparse accepts prefixes)"
    return None


class ModelSettings(FrozenModel):
    target: str = Field("smollm2-135m", description="model id (cpu engine) or path / HF id (sglang)")
    drafts: dict[str, str] = Field(default_factory=dict, description="draft model per algorithm, e.g. standalone: ...")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32", description="cpu engine: float32 (exact) or bfloat16 (faster); sglang: its --dtype, rendered as "
        "given (auto = SGLang's choice on a GPU; float32 on CPU, where SGLang's auto means float16)")

    @field_validator("drafts")
    @classmethod
    def _known_algorithms(cls, value: dict[str, str]) -> dict[str, str]:
        bad = sorted(set(value) - set(DRAFT_MODEL_ALGORITHMS))
        if bad:
            raise ValueError(f"drafts keys must be among {', '.join(DRAFT_MODEL_ALGORITHMS)}; got {bad}")
        return value


def dtype_problem(kind: str, dtype: str) -> str | None:
    """Why `model.dtype` cannot run on engine `kind` (None: it can). Pure."""
    if kind == "cpu" and dtype not in ("float32", "bfloat16"):
        return (f"model.dtype={dtype!r} is not a dtype of the cpu engine (float32 or bfloat16). Fix: set "
                "model.dtype: float32 (exact) or bfloat16, or use engine.kind: sglang")
    return None


class EngineSettings(FrozenModel):
    kind: EngineKind = "cpu"
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="sglang: where SGLang runs; auto = cuda where the cluster has GPUs, else cpu (SGLang's "
        "own server on CPU, from the venv of bash infra/install-sglang-cpu.sh)")
    attention_backend: str | None = Field(
        None, description="sglang --attention-backend, the same for the baseline and every trial; None = decided at "
        "study start: on a GPU what SGLang 0.5.23 picks on engine.gpu_arch for the model and the widest tree of the "
        "search space (flashinfer for MHA, triton for MLA where that one's verify would ignore the mask of one of "
        "the space's trees; docs/configuration.md); cpu: torch_native")
    gpu_arch: Literal["auto", "sm80", "sm90", "sm100", "sm120"] = Field(
        "auto", description="sglang: the GPU architecture the attention backend is chosen for; auto = this "
        "machine's GPU, else a GPU node of the Ray cluster (set it to see the backend in --dry-run elsewhere)")
    tp_size: int = Field(1, ge=1, description="GPUs per replica (sglang)")
    serving_gpus: int | None = Field(
        None, ge=1, description="GPUs production has for the served engines (all its nodes together). A split "
        "across concurrency levels runs two engines of tp_size GPUs each and is chosen only where they fit; "
        "None = the GPU count of the largest node of the study's Ray cluster, else tp_size (one engine)")
    replica_cpus: float | None = Field(None, ge=0, description="CPUs reserved per engine replica; None = the engine's "
                                       "default (sglang: 2 per GPU, since NGRAM drafts on the host; cpu: 0.1)")
    replica_resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources each replica "
                                                "needs, e.g. {specdec_engine: 1} to keep replicas on engine nodes")
    threads: int | None = Field(None, ge=1, description="cpu engine torch threads; None = all cores")
    cpus: tuple[int, ...] | None = Field(None, min_length=1, description="CPUs the engine runs on (Linux affinity, "
                                         "the same for every trial); None = any")
    weights: Literal["auto", "fp32", "gguf"] = Field("auto", description="cpu engine --weights (decode kernel)")
    start_timeout_s: float = Field(600.0, gt=0, description="readiness timeout; minutes for big models")
    request_timeout_s: float = Field(300.0, gt=0)
    extra_flags: list[str] = Field(default_factory=list, description="passed to the engine after validation")
    env: dict[str, str] = Field(default_factory=dict, description="engine environment; values are never logged, "
                                "printed or written (names only)")

    _redact = field_serializer("env")(redact_env)

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        problems = [p for p in map(env_name_problem, value) if p]
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @field_validator("extra_flags")
    @classmethod
    def _not_owned(cls, value: list[str]) -> list[str]:
        problems = [p for p in map(owned_flag_problem, value) if p]
        if problems:
            raise ValueError("; ".join(problems) + ". Fix: remove it from engine.extra_flags and set the study key "
                             "or search-space parameter that renders it")
        return value

    @model_validator(mode="after")
    def _sglang_only(self) -> EngineSettings:
        for key, value, default in (("device", self.device, "auto"), ("attention_backend", self.attention_backend,
                                                                       None), ("gpu_arch", self.gpu_arch, "auto")):
            if value != default and self.kind != "sglang":
                raise ValueError(f"engine.{key}={value!r} applies to engine.kind sglang only (engine.kind is "
                                 f"{self.kind!r}). Fix: remove engine.{key}")
        return self

    @model_validator(mode="after")
    def _weights_cpu_only(self) -> EngineSettings:
        if self.weights != "auto" and self.kind != "cpu":
            raise ValueError(f"engine.weights={self.weights!r} applies to the cpu engine only (engine.kind is "
                             f"{self.kind!r}). Fix: remove engine.weights")
        return self
