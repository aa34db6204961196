"""Typed study configuration: `TrialConfig` (one point to measure) and `StudyConfig` (the study file).

Precedence for a study: command line > study file > the defaults below. `load_study` does the merge and raises
`ConfigError` with every problem named (file, dotted key, value, fix). Pure apart from reading the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ConfigDict, Field, ValidationError, field_serializer, field_validator, model_validator

from pipeline.errors import ConfigError, format_validation_error
from pipeline.measure.summary import Summary
from pipeline.redact import mask_study_dict
from serve.engines.settings import ENGINE_OWNED_FLAGS
from serve.engines import algorithms_of, engine_for
from serve.engines.base import EngineKind, redact_env
from serve.spec import FrozenModel, NoSpec, SpecConfig, Violation, validate_spec

DEFAULT_STUDY_NAME = "default"
# Longest generation a workload may ask for: one measured request would otherwise run for hours.
MAX_NEW_TOKENS_LIMIT = 32_768
SEARCH_SPACES_DIR = Path(__file__).resolve().parent.parent / "search_spaces"



class TrialConfig(FrozenModel):
    """One configuration to deploy and measure: what the engine is told plus how the trial drives it."""

    spec: SpecConfig = Field(default_factory=NoSpec)
    warmup_requests: int = Field(0, ge=0, description="requests sent after the flush and before measuring")
    max_running_requests: int | None = Field(None, ge=1, description="engine batch bound; None = engine default")
    concurrency: int = Field(1, ge=1, description="client requests in flight while measuring")


def validate_trial(trial: TrialConfig, engine: str = "cpu") -> list[Violation]:
    """Every reason this trial must not be deployed on `engine`; empty means valid. Pure."""
    found = list(validate_spec(trial.spec))
    # Engines implement different algorithms; static knowledge of the engine kind, so validation, not preflight.
    supported = algorithms_of(engine)
    if trial.spec.algorithm not in supported:
        found.append(Violation(
            "spec.algorithm", f"{engine_for(engine).label} implements only {sorted(supported)}",
            f"algorithm={trial.spec.algorithm}"))
    return found


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
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="cpu engine: fp32 is exact, bf16 is faster")

    @field_validator("drafts")
    @classmethod
    def _known_algorithms(cls, value: dict[str, str]) -> dict[str, str]:
        bad = sorted(set(value) - {"eagle", "eagle3", "standalone"})
        if bad:
            raise ValueError(f"drafts keys must be eagle, eagle3 or standalone; got {bad}")
        return value


class EngineSettings(FrozenModel):
    kind: EngineKind = "cpu"
    tp_size: int = Field(1, ge=1, description="GPUs per replica (sglang)")
    replica_cpus: float | None = Field(None, ge=0, description="CPUs reserved per engine replica; None = the engine's "
                                       "default (sglang: 2 per GPU, since NGRAM drafts on the host; cpu: 0.1)")
    replica_resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources each replica "
                                                "needs, e.g. {specdec_engine: 1} to keep replicas on engine nodes")
    threads: int | None = Field(None, ge=1, description="cpu engine torch threads; None = all cores")
    weights: Literal["auto", "fp32", "gguf"] = Field("auto", description="cpu engine --weights (decode kernel)")
    start_timeout_s: float = Field(600.0, gt=0, description="readiness timeout; minutes for big models")
    request_timeout_s: float = Field(300.0, gt=0)
    extra_flags: list[str] = Field(default_factory=list, description="passed to the engine after validation")
    env: dict[str, str] = Field(default_factory=dict, description="engine environment; values are never logged, "
                                "printed or written (names only)")

    _redact = field_serializer("env")(redact_env)

    @field_validator("extra_flags")
    @classmethod
    def _not_owned(cls, value: list[str]) -> list[str]:
        problems = [p for p in map(owned_flag_problem, value) if p]
        if problems:
            raise ValueError("; ".join(problems) + ". Fix: remove it from engine.extra_flags and set the study key "
                             "or search-space parameter that renders it")
        return value

    @model_validator(mode="after")
    def _weights_cpu_only(self) -> EngineSettings:
        if self.weights != "auto" and self.kind != "cpu":
            raise ValueError(f"engine.weights={self.weights!r} applies to the cpu engine only (engine.kind is "
                             f"{self.kind!r}). Fix: remove engine.weights")
        return self


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

    @field_validator("max_new_tokens")
    @classmethod
    def _bounded(cls, value: int) -> int:
        if value > MAX_NEW_TOKENS_LIMIT:
            raise ValueError(
                f"must be <= {MAX_NEW_TOKENS_LIMIT} (one measured request would run for hours and no model the tuner "
                f"targets has a longer context); got {value}. Fix: use a value such as 24 (CPU) or 256 (GPU)")
        return value


class BudgetSettings(FrozenModel):
    max_trials: int = Field(8, ge=1, description="trials including the baseline")
    time_budget_s: float | None = Field(None, gt=0, description="stop starting new trials after this")
    # On by default: on the recorded grid's replay it never stopped a point within 2% of the best nor one faster than
    # the baseline (docs/configuration.md "Early stopping").
    early_stopping: bool = Field(True, description="measure trials request by request and stop (PRUNED) one that "
                                 "provably cannot beat the baseline (pipeline/search/stopping.py); search concurrency 1")
    early_stopping_sigma: float = Field(0.05, ge=0, le=1, description="run-to-run sd of log throughput the rule "
                                        "allows for (the recorded grid's pooled figure is 0.034)")


# Latency figures an SLA limit may name, and every numeric figure an objective may name: taken from what
# `pipeline.measure.summary.Summary` reports, so a misspelt name is an error at load, not a silent None per trial.
SLA_METRICS: tuple[str, ...] = tuple(
    name for name in Summary.model_fields if name.endswith("_ms") and name.split("_")[0] in ("ttft", "itl", "e2e"))
OBJECTIVE_METRICS: tuple[str, ...] = tuple(
    name for name, field in Summary.model_fields.items()
    if name not in ("seed", "n_boot", "concurrency", "offered_rate_per_s", "arrival_rate_per_s")  # load, not result
    and field.annotation in (int, float, float | None))


class SlaConstraint(FrozenModel):
    """One service-level limit: `metric` (a latency percentile in ms) must be <= `max_ms` at `concurrency`
    (None = at every level in the study's `concurrency` list). Checked on the median over re-measured runs."""

    model_config = ConfigDict(**FrozenModel.model_config, allow_inf_nan=False)

    metric: str = Field(description=f"one of {', '.join(SLA_METRICS)}")
    max_ms: float = Field(gt=0, description="the limit, milliseconds")
    concurrency: int | None = Field(None, ge=1, description="level the limit holds at; None = every level")

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, value: str) -> str:
        if value not in SLA_METRICS:
            raise ValueError(f"unknown SLA metric {value!r}. Fix: use one of {list(SLA_METRICS)} (latency "
                             "percentiles in milliseconds, as pipeline.measure.summary.Summary reports them)")
        return value


class ObjectiveSettings(FrozenModel):
    metrics: list[str] = Field(default_factory=lambda: ["tput_tok_s"], min_length=1)
    modes: list[Literal["max", "min"]] = Field(default_factory=lambda: list[Literal["max", "min"]](["max"]),
                                               min_length=1)
    constraints: list[SlaConstraint] = Field(default_factory=list, description="SLA limits; a finalist that breaks "
                                             "one is refused, trials that break one are infeasible for the search")

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, value: list[str]) -> list[str]:
        bad = [m for m in value if m not in OBJECTIVE_METRICS]
        if bad:
            raise ValueError(f"unknown objective metric(s) {bad}. Fix: use names pipeline.measure.summary.Summary reports: "
                             f"{list(OBJECTIVE_METRICS)}")
        if len(set(value)) != len(value):
            raise ValueError(f"each objective metric may appear once, got {value}")
        return value

    @model_validator(mode="after")
    def _same_length(self) -> ObjectiveSettings:
        if len(self.metrics) != len(self.modes):
            raise ValueError(f"metrics and modes must have the same length, got {self.metrics} and {self.modes}")
        return self


class PromotionPolicy(FrozenModel):
    """How sure the tuner must be before replacing the baseline: the study file's `promotion:` section and the input
    of the pure decision (`pipeline.decide.decision.decide`). One type for both, so the file and the rule cannot drift."""

    model_config = ConfigDict(**FrozenModel.model_config, allow_inf_nan=False)  # an infinite margin decides nothing

    finalists: int = Field(1, ge=0, description="best trials re-measured against the baseline; 0 = search only: "
                                               "nothing is re-measured, so the study keeps the baseline")
    runs: int = Field(3, ge=3, description="re-measurements per finalist and baseline (a freshly started engine "
                                           "each); a MAD of fewer than 3 runs is meaningless")
    margin: float = Field(0.03, ge=0, description="score must beat the baseline's median by this fraction")
    tie_tolerance: float = Field(0.01, ge=0, description="scores within this fraction of the best tie: fewer drafts "
                                                         "win")
    equivalence_threshold: float = Field(1.0, description="share of greedy outputs identical to the baseline's")
    require_equivalence: bool = Field(True, description="a finalist that failed an equivalence check cannot win")

    @field_validator("tie_tolerance")
    @classmethod
    def _tie_fraction(cls, value: float) -> float:
        if not 0 <= value < 1:
            raise ValueError(f"must be a fraction in [0, 1) of the best score; got {value}. Fix: e.g. 0.01 for 1% "
                             "(1 or more would make every finalist a tie)")
        return value

    @field_validator("equivalence_threshold")
    @classmethod
    def _share(cls, value: float) -> float:
        if not 0 < value <= 1:
            raise ValueError(f"must be a share in (0, 1]; got {value}. Fix: 1.0 for fp32 (outputs are bit-exact), "
                             "e.g. 0.9 for bf16 (0 would accept any output)")
        return value


class TrackingSettings(FrozenModel):
    uri: str | None = Field(None, description="MLflow tracking URI; None = sqlite under the output folder")
    experiment: str | None = Field(None, description="None = the study name")
    registered_model: str | None = Field(None, description="None = specdec-<study name>")


class StorageSettings(FrozenModel):
    url: str | None = Field(None, description="Optuna RDB URL; None = sqlite under the output folder")


class RaySettings(FrozenModel):
    address: str | None = Field(None, description="None = start a local Ray; 'auto' or ray://... for a cluster")


class StudyConfig(FrozenModel):
    """A study file (YAML). Every key is optional; `python -m pipeline.tune --dry-run` prints the resolved one."""

    name: str = Field(DEFAULT_STUDY_NAME, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    seed: int = 0
    model: ModelSettings = Field(default_factory=ModelSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    workload: WorkloadSettings = Field(default_factory=WorkloadSettings)
    search_space: str = Field("default.yaml", description="a file in search_spaces/ or a path")
    budget: BudgetSettings = Field(default_factory=BudgetSettings)
    objective: ObjectiveSettings = Field(default_factory=ObjectiveSettings)
    concurrency: list[int] = Field(default_factory=lambda: [1], min_length=1, description="first = search level; finalists and baseline are re-measured at every level")
    promotion: PromotionPolicy = Field(default_factory=PromotionPolicy)
    tracking: TrackingSettings = Field(default_factory=TrackingSettings)
    storage: StorageSettings = Field(default_factory=StorageSettings)
    ray: RaySettings = Field(default_factory=RaySettings)
    output_dir: str | None = Field(None, description="None = ./runs/<name> in the current directory")

    @field_validator("concurrency")
    @classmethod
    def _positive(cls, value: list[int]) -> list[int]:
        if any(isinstance(level, bool) or level < 1 for level in value):
            raise ValueError(f"every concurrency level must be an integer >= 1, got {value}")
        if len(set(value)) != len(value):
            raise ValueError(f"concurrency levels must be distinct, got {value}. Fix: list each level once; the "
                             "first is the search level")
        return value

    @model_validator(mode="after")
    def _open_loop_level(self) -> StudyConfig:
        # Open-loop load has no concurrency to vary: re-measuring finalists "per level" would repeat one
        # measurement; the single level is the warm-up's closed-loop concurrency and the records' label.
        if self.workload.arrival.open_loop and len(self.concurrency) > 1:
            raise ValueError(
                f"workload.arrival.mode=poisson measures at an arrival rate, not at concurrency levels; got "
                f"concurrency={self.concurrency}. Fix: list one level (e.g. concurrency: [1]; it is the warm-up's "
                "concurrency), or use mode: closed to compare levels")
        return self

    @model_validator(mode="after")
    def _constraint_levels(self) -> StudyConfig:
        for i, limit in enumerate(self.objective.constraints):
            if limit.concurrency is not None and limit.concurrency not in self.concurrency:
                raise ValueError(
                    f"objective.constraints.{i}.concurrency={limit.concurrency} is not a measured level; "
                    f"concurrency={self.concurrency}. Fix: add {limit.concurrency} to concurrency, or name one of "
                    "the listed levels")
        return self

    @property
    def search_concurrency(self) -> int:
        """The one level trials are measured at during the search: the first listed (finalists and the baseline
        are re-measured at every level)."""
        return self.concurrency[0]

    def output_path(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path.cwd() / "runs" / self.name

    def search_space_path(self) -> Path:
        return resolve_space_path(self.search_space)


def resolve_space_path(name: str) -> Path:
    """A bare name ("ngram" or "ngram.yaml") is looked up in search_spaces/ first, then relative to the current
    directory."""
    candidate = Path(name)
    if not candidate.is_absolute() and candidate.parent == Path("."):
        for bundled in (SEARCH_SPACES_DIR / name, SEARCH_SPACES_DIR / f"{name}.yaml"):
            if bundled.is_file():
                return bundled
    return candidate


def read_yaml(path: Path, what: str) -> dict[str, Any]:
    """Read a YAML mapping; any problem is a ConfigError naming the file."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read it ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path}: the top level must be a mapping of keys, got {type(data).__name__}")
    return data


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set data['a']['b'] = value for 'a.b', creating mappings on the way."""
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def known_keys(model: type[FrozenModel], prefix: str = "") -> dict[str, list[str]]:
    """Allowed keys per dotted parent path, for did-you-mean hints on misspelled keys."""
    table = {prefix: list(model.model_fields)}
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, FrozenModel):
            table.update(known_keys(kind, f"{prefix}.{name}" if prefix else name))
    return table


def load_study(path: str | Path | None, overrides: dict[str, Any] | None = None) -> StudyConfig:
    """Defaults < file < overrides (dotted keys, e.g. {"budget.max_trials": 4}). Raises ConfigError."""
    data: dict[str, Any] = read_yaml(Path(path), "study file") if path else {}
    for dotted, value in (overrides or {}).items():
        set_dotted(data, dotted, value)
    source = f"study file {path}" if path else "study (defaults + command line)"
    try:
        return StudyConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source, known_keys(StudyConfig))) from None


def study_to_yaml(study: StudyConfig) -> str:
    """The resolved study as YAML, passwords in URLs masked: what --dry-run prints, `study.yaml` holds and MLflow
    gets (pipeline/redact.py)."""
    return yaml.safe_dump(mask_study_dict(study.model_dump(mode="json")), sort_keys=False)
