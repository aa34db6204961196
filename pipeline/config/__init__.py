"""Typed study configuration: `TrialConfig` (one point to measure) and `StudyConfig` (the study file), one module per
section of the file: `engine` (model:, engine:), `workload` (workload:), `policy` (budget:, objective:,
promotion:), `search` (search:), `study` (the file itself, its loading and merge), `trial` (one point). Import from `pipeline.config`:
the names below are its public surface."""

from pipeline.config.engine import EngineSettings, ModelSettings, owned_flag_problem
from pipeline.config.policy import (
    OBJECTIVE_METRICS, SLA_METRICS, BudgetSettings, ObjectiveSettings, PromotionPolicy, SlaConstraint,
)
from pipeline.config.study import (
    DEFAULT_STUDY_NAME, SEARCH_SPACES_DIR, RaySettings, StorageSettings, StudyConfig, TrackingSettings, known_keys,
    load_study, read_yaml, resolve_space_path, resolve_study, set_dotted, study_to_yaml,
)
from pipeline.config.search import SearchSettings, SimulateSettings
from pipeline.config.trial import TrialConfig, validate_trial
from pipeline.config.workload import MAX_NEW_TOKENS_LIMIT, ArrivalSettings, WorkloadSettings

__all__ = [
    "DEFAULT_STUDY_NAME", "MAX_NEW_TOKENS_LIMIT", "OBJECTIVE_METRICS", "SEARCH_SPACES_DIR", "SLA_METRICS",
    "ArrivalSettings", "BudgetSettings", "EngineSettings", "ModelSettings", "ObjectiveSettings", "PromotionPolicy",
    "RaySettings", "SearchSettings", "SimulateSettings", "SlaConstraint", "StorageSettings", "StudyConfig", "TrackingSettings", "TrialConfig",
    "WorkloadSettings", "known_keys", "load_study", "owned_flag_problem", "read_yaml", "resolve_space_path", "resolve_study",
    "set_dotted", "study_to_yaml", "validate_trial",
]
