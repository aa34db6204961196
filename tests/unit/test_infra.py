"""infra/ and examples/ files parse and agree with the code that reads them."""

import importlib
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import DeploymentSchema, ServeDeploySchema

from pipeline.config import load_study
from serve.production.settings import ProductionSettings

ROOT = Path(__file__).resolve().parents[2]
OUR_DEPLOYMENTS = {"EngineBackend", "OpenAIIngress"}


def docs(path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def check_serve_config(config: dict) -> None:
    schema = ServeDeploySchema.model_validate(config)
    assert schema.http_options.host and schema.applications
    for app, raw in zip(schema.applications, config["applications"]):
        module, attr = app.import_path.split(":")
        assert callable(getattr(importlib.import_module(module), attr))
        ProductionSettings.model_validate(app.args)  # the builder's arguments are real settings
        for deployment in raw.get("deployments", []):
            assert deployment["name"] in OUR_DEPLOYMENTS
            assert set(deployment) <= set(DeploymentSchema.model_fields), deployment  # Serve ignores typos; we don't
            assert deployment.get("max_surge_percent") == 100  # zero-downtime promotion


def test_serve_config_file():
    check_serve_config(yaml.safe_load((ROOT / "infra/serve-production.yaml").read_text()))


def test_rayservice_embeds_a_valid_serve_config():
    (service,) = docs(ROOT / "infra/kuberay/rayservice.yaml")
    assert service["apiVersion"] == "ray.io/v1" and service["kind"] == "RayService"
    check_serve_config(yaml.safe_load(service["spec"]["serveConfigV2"]))
    workers = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert any("nvidia.com/gpu" in c["resources"]["limits"] for w in workers
               for c in w["template"]["spec"]["containers"])


def test_raycluster_has_a_cpu_head_and_gpu_workers():
    (cluster,) = docs(ROOT / "infra/kuberay/raycluster.yaml")
    assert cluster["kind"] == "RayCluster" and cluster["spec"]["rayVersion"] == "2.60.0"
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    worker = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) >= 1


def test_postgres_and_mlflow_manifests():
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs(ROOT / "infra/k8s/postgres.yaml")}
    assert {("StatefulSet", "postgres"), ("Service", "postgres"), ("Secret", "postgres")} <= kinds
    mlflow = {d["kind"]: d for d in docs(ROOT / "infra/k8s/mlflow.yaml")}
    command = " ".join(mlflow["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"])
    assert "--backend-store-uri postgresql+psycopg2://" in command and "--artifacts-destination" in command


def test_cluster_launcher_installs_the_gpu_extra():
    config = yaml.safe_load((ROOT / "infra/ray-cluster-gpu.yaml").read_text())
    assert config["provider"]["type"] == "local" and config["head_start_ray_commands"]
    assert any("[gpu]" in c for c in config["setup_commands"])
    assert not any("torch==2.13.0" in c or "[cpu]" in c for c in config["setup_commands"])


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")) + [ROOT / "infra/study-cluster.yaml"],
                         ids=lambda p: p.name)
def test_study_files_load(path):
    study = load_study(path)
    assert study.search_space_path().exists()


def test_cluster_study_selects_distributed_backends():
    study = load_study(ROOT / "infra/study-cluster.yaml")
    assert study.tracking.uri is not None and study.tracking.uri.startswith("http")
    assert study.storage.url is not None and study.storage.url.startswith("postgresql")
    assert study.ray.address == "auto" and study.engine.kind == "sglang"


def test_no_deployment_file_ships_an_api_key():
    # A key in a checked-in file is a placeholder at best (the ingress refuses those) and a leak at worst: keys come
    # from a mounted secret (api_key_file) or the cluster's environment.
    for path in sorted((ROOT / "infra").rglob("*.yaml")):
        text = path.read_text()
        assert "SPECDEC_API_KEYS:" not in text, path
