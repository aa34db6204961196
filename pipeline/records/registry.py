"""MLflow model-registry action of promotion: register a serving config, move aliases, roll back, load.

A "model version" here is a `serve.serving.ServingConfig` (the replica the winning trial ran + provenance), not
weights. It is logged as an MLflow 3 LoggedModel of the study's experiment: params = the replica's fields (engine,
model, spec.*, tp_size, extra_flags, env_from names), tags = decision and algorithm, so the Models page shows the spec;
its artifacts hold `serving_config.json`; the study run records the workload (name + digest) as its dataset input and
the model as its output, and the re-measured medians are logged as the model's metrics on that dataset. The version is
created from the model's artifact location, so `load_serving_config("models:/<name>@production")` downloads that file.

What a version page shows (MLflow 3.17's version page renders the description, the tags and the aliases, and links a
LoggedModel only from a `models:/<model id>` source, which production's loader cannot download with an explicit
tracking URI): the description is a table of the spec and the measured figures; the tags carry the model, the spec
fields set away from their defaults (`spec.*`) and the figures (`measured.*`), so the versions table lists them
side by side; `model_id` names the LoggedModel, whose `mlflow.modelVersions` tag lists its versions (its page links
back to them).

Aliases: `production` is the served one, `previous` the one before it (a promotion keeps it, a rollback swaps the
two), `candidate` a re-tune's result waiting for its canary (`register_config(..., alias=CANDIDATE)` never touches
production). Every move of `production` stamps the version with `promoted_at_ms`: the re-tune captures traffic
since then.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.records.tracking import Tracker
from serve.production.app import CONFIG_FILE, load_serving_config  # noqa: F401 - re-exported
from serve.production.settings import PRODUCTION
from serve.serving import ServingConfig, spec_params

PREVIOUS = "previous"
CANDIDATE = "candidate"
PROMOTED_AT_TAG = "promoted_at_ms"
MODEL_VERSIONS_TAG = "mlflow.modelVersions"  # the LoggedModel's list of its registered versions (MLflow's own tag)


def _alias_version(client: Any, name: str, alias: str) -> str | None:
    # lazy: MLflow takes seconds to import; only the paths that read or write runs pay for it
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def alias_version(tracker: Tracker, name: str, alias: str) -> str | None:
    """The version `alias` of `name` points at, or None (no such alias, or no such model)."""
    return _alias_version(tracker.client(), name, alias)


def version_description(serving: ServingConfig, model_id: str) -> str:
    """The version page's description: what the config is and what it was measured to do (Markdown)."""
    prov = serving.provenance
    rows = [f"| `{key}` | {value} |" for key, value in spec_params(serving).items()]
    figures = [f"| `{key}` | {value:.4g} |" for key, value in sorted(prov.medians.items())]
    text = (f"**{serving.replica.spec.algorithm}** on `{serving.replica.model}` ({serving.replica.engine}): "
            f"decision `{prov.decision}` ({prov.source}) of study `{prov.study}`, measured on workload "
            f"`{prov.workload}` (digest `{prov.workload_digest}`).\n\n| setting | value |\n|---|---|\n"
            + "\n".join(rows))
    if figures:
        text += "\n\n| measured | value |\n|---|---|\n" + "\n".join(figures)
    if serving.policy is not None and serving.policy.switch_above is not None:
        text += f"\n\nServing policy: {serving.policy.text}"
    text += f"\n\nLogged model `{model_id}` holds the same params and metrics."
    return text if len(text) <= 5000 else text[:4990] + "\n\n(cut)"  # the store's limit


def version_tags(serving: ServingConfig) -> dict[str, str]:
    """The tags the versions table lists side by side: the model, every field of the spec (a field left at its
    default is still what the engine runs: draft tokens, breadth, depth, ...; unset ones are left out), the engine's
    running-request cap when set, and the measured figures."""
    spec = serving.replica.spec.model_dump(mode="json", exclude_none=True)
    tags = {"model": serving.replica.model, "spec.algorithm": serving.replica.spec.algorithm}
    tags.update({f"spec.{key}": str(value)[:5000] for key, value in spec.items()})
    if serving.replica.max_running_requests is not None:
        tags["max_running_requests"] = str(serving.replica.max_running_requests)
    tags.update({f"measured.{key}": f"{value:.6g}" for key, value in serving.provenance.medians.items()})
    # what it was tuned on, and whether other work disturbed the re-runs it was decided on (a provisional decision)
    prov = serving.provenance
    tags.update({key: value[:5000] for key, value in (("engine", prov.engine), ("hardware", prov.hardware),
                                                        ("measurement", prov.measurement)) if value})
    return tags


def register_config(tracker: Tracker, run_id: str, name: str, serving: ServingConfig,
                    move_production: bool, alias: str = PRODUCTION) -> str | None:
    """Register `serving` as a new version of `name`. With `alias` production (the default): moves `production` to
    it when `move_production`, or when no version is in production yet (a first study's baseline becomes what the
    endpoint serves), and registers nothing otherwise. With any other alias (a re-tune's `candidate`): always
    registers and points that alias at it; production is not touched. Returns the version (None: not registered)."""
    # lazy: MLflow takes seconds to import; only the paths that read or write runs pay for it
    from mlflow.entities import Dataset, DatasetInput, InputTag, LoggedModelOutput
    from mlflow.exceptions import MlflowException

    client = tracker.client()
    current = None
    try:
        client.get_registered_model(name)
        current = _alias_version(client, name, PRODUCTION)
    except MlflowException:
        client.create_registered_model(name, description="specdec-tuner serving configs (engine + speculative settings)")
    if alias == PRODUCTION and not move_production and current is not None:
        return None
    prov = serving.provenance
    tags = {"decision": prov.decision, "algorithm": serving.replica.spec.algorithm, "engine": serving.replica.engine,
            "study": prov.study, "source": prov.source, "workload_digest": prov.workload_digest}
    model = client.create_logged_model(tracker.experiment_id(), name=f"{prov.study}-serving", source_run_id=run_id,
                                       tags=tags, params=spec_params(serving), model_type="specdec-serving-config")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / CONFIG_FILE).write_text(serving.model_dump_json(indent=2))
        client.log_model_artifacts(model.model_id, tmp)
    client.finalize_logged_model(model.model_id, "READY")
    dataset = Dataset(name=prov.workload, digest=prov.workload_digest, source_type="specdec-workload",
                      source=prov.workload)
    client.log_inputs(run_id, datasets=[DatasetInput(dataset, [InputTag("mlflow.data.context", "measure")])])
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, 0)])
    for key, value in prov.medians.items():
        client.log_metric(run_id, f"serving_{key}", value, model_id=model.model_id, dataset_name=prov.workload,
                          dataset_digest=prov.workload_digest)
    # Source = the model's artifact folder, not `models:/<model id>`: the store resolves that form through the
    # process-global tracking URI, not this client's. SQL stores drop `model_id`, so it is a tag as well.
    version = client.create_model_version(name, source=model.artifact_location, run_id=run_id,
                                          tags={**tags, **version_tags(serving), "model_id": model.model_id},
                                          description=version_description(serving, model.model_id),
                                          model_id=model.model_id)
    number = str(version.version)
    client.set_logged_model_tags(model.model_id, {MODEL_VERSIONS_TAG: json.dumps([{"name": name, "version": number}])})
    if alias == PRODUCTION:
        set_production(tracker, name, number)
    else:
        client.set_registered_model_alias(name, alias, number)
    return number


def production_version(tracker: Tracker, name: str) -> str | None:
    """The version alias `production` of `name` points at, or None."""
    return _alias_version(tracker.client(), name, PRODUCTION)


def set_production(tracker: Tracker, name: str, version: str) -> None:
    """Point `production` at `version`, keeping the version it pointed at as `previous`."""
    client = tracker.client()
    current = _alias_version(client, name, PRODUCTION)
    if current is not None and current != version:
        client.set_registered_model_alias(name, PREVIOUS, current)
    client.set_registered_model_alias(name, PRODUCTION, version)
    if current != version:
        client.set_model_version_tag(name, version, PROMOTED_AT_TAG, str(int(time.time() * 1000)))


def rollback(tracker: Tracker, name: str) -> tuple[str, str]:
    """Swap `production` and `previous`; returns (new production, new previous)."""
    client = tracker.client()
    current, previous = _alias_version(client, name, PRODUCTION), _alias_version(client, name, PREVIOUS)
    if previous is None or current is None:
        raise PipelineError(f"registered model '{name}' has no alias '{PREVIOUS}' to roll back to "
                            f"(production={current}, previous={previous})")
    client.set_registered_model_alias(name, PRODUCTION, previous)
    client.set_registered_model_alias(name, PREVIOUS, current)
    client.set_model_version_tag(name, previous, PROMOTED_AT_TAG, str(int(time.time() * 1000)))
    return previous, current


def production_since_ms(tracker: Tracker, name: str) -> int | None:
    """When `production` last moved to the version it points at (`promoted_at_ms`; for a version promoted before
    that tag existed, its creation time); None when nothing is in production."""
    client = tracker.client()
    version = _alias_version(client, name, PRODUCTION)
    if version is None:
        return None
    mv = client.get_model_version(name, version)
    stamp = mv.tags.get(PROMOTED_AT_TAG)
    return int(stamp) if stamp and stamp.isdigit() else int(mv.creation_timestamp)


def remove_alias(tracker: Tracker, name: str, alias: str) -> None:
    """Delete `alias` of `name` if it exists (production cannot be removed this way)."""
    # lazy: MLflow takes seconds to import; only the paths that read or write runs pay for it
    from mlflow.exceptions import MlflowException

    if alias == PRODUCTION:
        raise PipelineError(f"refusing to remove alias '{PRODUCTION}' of '{name}': the endpoint would have nothing "
                            "to serve; point it at another version instead")
    try:
        tracker.client().delete_registered_model_alias(name, alias)
    except MlflowException:
        pass


def tag_version(tracker: Tracker, name: str, version: str, tags: dict[str, str]) -> None:
    client = tracker.client()
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, str(value)[:5000])
