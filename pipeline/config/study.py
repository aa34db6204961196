"""`StudyConfig`, the study file, and its loading: command line > study file > defaults. `load_study` does the merge
and raises `ConfigError` with every problem named (file, dotted key, value, fix). Pure apart from reading the file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from pipeline.cli_common import env_tracking_uri
from pipeline.config.engine import EngineSettings, ModelSettings, dtype_problem
from pipeline.config.engine_defaults import EngineDefault, apply_engine_defaults
from pipeline.config.policy import BudgetSettings, ObjectiveSettings, PromotionPolicy, check_equivalence_setup
from pipeline.config.search import SearchSettings
from pipeline.config.workload import WorkloadSettings
from pipeline.config.yamlfile import DuplicateKeyError, safe_load_unique
from pipeline.errors import ConfigError, format_validation_error
from pipeline.redact import mask_study_dict
from serve.engines import engine_for, gpu_here
from serve.engines.base import ReplicaConfig
from serve.spec import FrozenModel

DEFAULT_STUDY_NAME = "default"
SEED_MAX = 2**32 - 1
SEARCH_SPACES_DIR = Path(__file__).resolve().parents[2] / "search_spaces"


class TrackingSettings(FrozenModel):
    uri: str | None = Field(None, description="MLflow tracking URI; None = sqlite under the output folder")
    experiment: str | None = Field(None, description="None = the study name")
    registered_model: str | None = Field(None, description="None = specdec-<study name>")
    deploy_uri: str | None = Field(None, description="the MLflow tracking URI the serving cluster reaches the registry "
                                   "at, named in the deploy files; None = `uri` where it is a server (http/https), "
                                   "else the deploy files say what to set")
    alias: Literal["production", "candidate"] = Field(
        "production", description="where the result goes: production (a promotion moves it) or candidate "
                                  "(registered beside production, which stays: a re-tune, docs/loop.md)")


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
    search: SearchSettings = Field(default_factory=SearchSettings)
    objective: ObjectiveSettings = Field(default_factory=ObjectiveSettings)
    concurrency: list[int] = Field(default_factory=lambda: [1], min_length=1, description="first = search level; finalists and baseline are re-measured at every level")
    promotion: PromotionPolicy = Field(default_factory=PromotionPolicy)
    tracking: TrackingSettings = Field(default_factory=TrackingSettings)
    storage: StorageSettings = Field(default_factory=StorageSettings)
    ray: RaySettings = Field(default_factory=RaySettings)
    output_dir: str | None = Field(None, description="None = ./runs/<name> in the current directory")

    @field_validator("seed")
    @classmethod
    def _numpy_seed(cls, value: int) -> int:
        # numpy's generators (the bootstrap, the workload's sampling) take 0..2**32-1 and raise mid-study otherwise
        if not 0 <= value <= SEED_MAX:
            raise ValueError(f"seed={value} is outside 0..{SEED_MAX} (numpy's seed range). Fix: a seed in that "
                             "range, e.g. --seed 0")
        return value

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

    @model_validator(mode="after")
    def _dtype_for_engine(self) -> StudyConfig:
        problem = dtype_problem(self.engine.kind, self.model.dtype)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _equivalence_setup(self) -> StudyConfig:
        engine = engine_for(self.engine.kind)
        flags = engine.deterministic_flags(ReplicaConfig(engine=self.engine.kind, model=self.model.target,
                                                         dtype=self.model.dtype, device=self.engine.device))
        problem = check_equivalence_setup(self.promotion, self.workload.measure_prompts, flags, engine.label)
        if problem:
            raise ValueError(problem)
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
        data = safe_load_unique(text)
    except DuplicateKeyError as exc:
        raise ConfigError(f"{what} {path}: {exc.problem}") from None
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


def resolve_study(path: str | Path | None, overrides: dict[str, Any] | None = None,
                  has_gpu: Callable[[], bool] = gpu_here) -> tuple[StudyConfig, tuple[EngineDefault, ...]]:
    """Defaults < engine defaults < $MLFLOW_TRACKING_URI (tracking.uri only) < file < overrides (dotted keys, e.g.
    {"budget.max_trials": 4}), and the engine defaults applied (pipeline/config/engine_defaults.py: an SGLang study on
    a GPU). Raises ConfigError."""
    data: dict[str, Any] = read_yaml(Path(path), "study file") if path else {}
    for dotted, value in (overrides or {}).items():
        set_dotted(data, dotted, value)
    tracking = data.get("tracking")
    if env_tracking_uri() and not (isinstance(tracking, dict) and tracking.get("uri")):
        set_dotted(data, "tracking.uri", env_tracking_uri())  # MLflow's own variable, below the file and the CLI
    data, applied = apply_engine_defaults(data, has_gpu)
    source = f"study file {path}" if path else "study (defaults + command line)"
    try:
        return StudyConfig.model_validate(data), applied
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source, known_keys(StudyConfig))) from None


def load_study(path: str | Path | None, overrides: dict[str, Any] | None = None) -> StudyConfig:
    """Defaults < engine defaults < file < overrides (`resolve_study`). Raises ConfigError."""
    return resolve_study(path, overrides)[0]


def study_to_yaml(study: StudyConfig) -> str:
    """The resolved study as YAML, passwords in URLs masked: what --dry-run prints, `study.yaml` holds and MLflow
    gets (pipeline/redact.py)."""
    return yaml.safe_dump(mask_study_dict(study.model_dump(mode="json")), sort_keys=False)
