"""Deploy files that deploy as written: the engine scripts executable (the rest private), the RayService patch's Serve
config readable YAML that requires the API keys of the secret it names, a registry the cluster reaches (or the file
says what to set), and what the config was tuned on (engine and version, hardware, whether the decision's runs were
disturbed) in every file."""

from __future__ import annotations

import os
import stat

import yaml

from pipeline.measure.server_info import ServerInfo
from pipeline.records.provenance import engine_text, hardware_text, machine
from serve.engines.base import ReplicaConfig
from serve.serving import (API_KEY_FILE, API_KEY_SECRET, COMMAND_FILE, RAYSERVICE_PATCH_FILE, SERVE_CONFIG_FILE,
                           SERVING_FILE, Provenance, deploy_files, serving_config, write_deploy_folder)

SOURCE = {"registered_model": "specdec-x", "version": "3", "tracking_uri": "sqlite:////home/me/out/mlflow.db"}
CLUSTER = {**SOURCE, "tracking_uri": "http://mlflow.specdec.svc:5000"}


def serving(**provenance):
    return serving_config(
        ReplicaConfig(model="smollm2-135m", spec={"algorithm": "ngram", "num_draft_tokens": 4}),
        Provenance(study="s", decision="promote", source="f", workload="w", workload_digest="d", **provenance))


def test_the_engine_scripts_run_as_written_and_the_rest_stay_private(tmp_path):
    files = deploy_files(serving(), SOURCE, "3")
    written = write_deploy_folder(tmp_path / "deploy", files)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in written}
    assert modes[COMMAND_FILE] == 0o755 and os.access(tmp_path / "deploy" / COMMAND_FILE, os.X_OK)
    assert {modes[n] for n in (SERVING_FILE, SERVE_CONFIG_FILE, RAYSERVICE_PATCH_FILE)} == {0o600}
    assert not list((tmp_path / "deploy").glob(".*.tmp"))  # nothing half-written is left beside them
    write_deploy_folder(tmp_path / "deploy", files)  # a second export over the first keeps the modes
    assert stat.S_IMODE((tmp_path / "deploy" / COMMAND_FILE).stat().st_mode) == 0o755


def test_the_rayservice_patch_embeds_readable_yaml_requiring_the_secrets_keys_and_a_reachable_registry():
    files = deploy_files(serving(engine="cpu 0.4.0", hardware="AMD EPYC 7B13, 2 CPUs", measurement="disturbed"),
                         SOURCE, "3", CLUSTER)
    text = files[RAYSERVICE_PATCH_FILE]
    assert "serveConfigV2: |\n" in text and "\\n" not in text  # a literal block, not an escaped string
    patch = yaml.safe_load(text)
    app = yaml.safe_load(patch["spec"]["serveConfigV2"])["applications"][0]
    assert app["args"]["tracking_uri"] == CLUSTER["tracking_uri"] and app["args"]["api_key_file"] == API_KEY_FILE
    assert f"secret {API_KEY_SECRET}" in text and "set args.tracking_uri" not in text
    assert "image" not in patch["spec"] and "# Image: the RayService's own" in text and "cpu 0.4.0" in text
    assert patch["metadata"]["annotations"] == {
        "specdec.io/promotion": "3", "specdec.io/engine": "cpu 0.4.0", "specdec.io/hardware": "AMD EPYC 7B13, 2 CPUs",
        "specdec.io/measurement": "disturbed"}
    for name in (COMMAND_FILE, SERVE_CONFIG_FILE):
        assert "# Tuned on: cpu 0.4.0; AMD EPYC 7B13, 2 CPUs\n" in files[name]
        assert "a provisional decision" in files[name]
    served = yaml.safe_load(files[SERVE_CONFIG_FILE])["applications"][0]["args"]
    assert served == SOURCE  # this machine's view: a local `serve deploy` reads the study's own store


def test_without_a_registry_the_cluster_reaches_the_patch_says_what_to_set():
    text = deploy_files(serving(), SOURCE, "3")[RAYSERVICE_PATCH_FILE]
    assert "set it to the MLflow server your cluster reaches, or run the study with tracking.deploy_uri" in text
    assert "Tuned on" not in text  # nothing known is said as nothing


def test_what_a_config_was_tuned_on_reads_in_a_line():
    assert hardware_text({"cpu": "AMD EPYC 9654", "cpus": 192, "gpus": ["NVIDIA H100 80GB HBM3"] * 2}) == \
        "2 x NVIDIA H100 80GB HBM3; AMD EPYC 9654, 192 CPUs"
    here = machine()
    assert here["cpus"] == os.cpu_count() and here["cpu"]
    assert engine_text("sglang", ServerInfo.parse({"version": "0.5.2"})) == "sglang 0.5.2"
    assert engine_text("cpu", None) == "cpu (version unknown)"
