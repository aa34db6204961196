"""llama.cpp from a study to production, live: a short study whose speculative trial is the draft-model path
(`llama_draft`: llama-server `--spec-type draft-simple --spec-draft-model`; the smollm2-135m target in F32 drafted by
its own Q4_1 GGUF), then the production endpoint (serve/production.py) serving what the study registered on the
llama.cpp engine to the real `openai` client, and the exported bare `llama-server` command line
(deploy/llama_server_command.sh: the promoted one, and the draft trial's rendered as a winner's) pasted into a shell.
Local Ray + Serve, MLflow on SQLite. Skipped without llama-server (install command named)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from pipeline.config import TrialConfig, load_study
from pipeline.records.tracking import Tracker
from pipeline.search.space import load_space
from pipeline.study.driver import connect_ray, run_study
from pipeline.trial.replica_config import replica_config
from serve.engines.llama_cpp.adapter import LLAMA_SERVER_COMMAND_FILE
from serve.ports import free_port
from serve.production.settings import ProductionSettings
from serve.production.app import deploy, load_serving_config
from serve.serving import SERVING_FILE, Provenance, deploy_files, serving_config
from tests.conftest import TINY_STUDY
from tests.integration.llama_cpp_helpers import require_llama_server

pytestmark = [pytest.mark.integration, pytest.mark.engines]
TARGET = "smollm2-135m@f32"
# One speculative choice only: the study's second trial is the draft-model trial.
SPACE = ("algorithms: [none, llama_draft]\n"
         "common:\n  warmup_requests: {type: fixed, value: 1}\n"
         "branches:\n  llama_draft:\n"
         "    draft_model: {type: fixed, value: smollm2-135m}\n"
         "    draft_n_max: {type: fixed, value: 4}\n")


@pytest.fixture(scope="module")
def draft_study(tmp_path_factory):
    """(study, output folder, tracking uri) of a 2-trial study (baseline + llama_draft) that ran to its decision."""
    require_llama_server()
    out = tmp_path_factory.mktemp("llama-draft")
    space = out / "space.yaml"
    space.write_text(SPACE)
    study = load_study(None, {**TINY_STUDY, "name": "it-llama-draft", "output_dir": str(out),
                              "search_space": str(space), "budget.max_trials": 2, "engine.kind": "llama_cpp",
                              "model.target": TARGET, "engine.threads": 1, "workload.source": "code-edit",
                              "ray.address": "local"})
    assert run_study(study, load_space(space)) == 0
    return study, out, f"sqlite:///{out / 'mlflow.db'}"


def test_draft_model_trial_matches_the_baseline_and_records_accept_length(draft_study):
    study, out, uri = draft_study
    tracker = Tracker(uri, study.name)
    client = tracker.client()
    runs = {r.data.params["spec.algorithm"]: r for r in client.search_runs([tracker.experiment_id()], max_results=50)
            if r.data.tags.get("specdec.kind") == "trial"}
    assert set(runs) == {"none", "llama_draft"}
    draft = runs["llama_draft"]
    assert draft.data.tags["outcome"] == "COMPLETE", draft.data.tags.get("reason")
    assert draft.data.metrics["equiv_identical_share"] == 1.0  # greedy outputs identical to the baseline's
    # accept length recorded from llama-server's timings.draft_n_accepted (serve/engines/llama_cpp/protocol.py):
    # a Q4_1 copy of the same model accepts most drafts, so well above the 1.0 of no accepted draft at all
    assert draft.data.metrics["accept_len"] > 1.5
    info = json.loads(Path(client.download_artifacts(draft.info.run_id, "server_info.json", str(out))).read_text())
    argv = info["llama_server_argv"]
    assert argv[argv.index("--spec-type") + 1] == "draft-simple"
    assert argv[argv.index("--model") + 1].endswith(".f32.gguf")  # the target ran in F32 ...
    assert argv[argv.index("--spec-draft-model") + 1].endswith(".Q4_1.gguf")  # ... drafted by the Q4_1 file
    # the shim's own total over the measured requests (server_info.json is taken at start, before any request)
    assert info["internal_states_after"][0]["avg_spec_accept_length"] > 1.5


@pytest.fixture(scope="module")
def production(draft_study):
    """The production endpoint serving `models:/specdec-it-llama-draft@production` (what the study registered)."""
    study, _, uri = draft_study
    base_url = connect_ray("llama-production")
    settings = ProductionSettings(registered_model=f"specdec-{study.name}", tracking_uri=uri,
                                  app_name="llama-production", max_tokens_limit=64)
    served = deploy(settings)
    yield base_url, served
    from ray import serve

    serve.delete(settings.app_name)


def test_production_endpoint_serves_the_promoted_llama_cpp_config(draft_study, production):
    study, out, uri = draft_study
    base_url, served = production
    promoted = load_serving_config(uri, f"models:/specdec-{study.name}@production")
    assert promoted.replica.engine == "llama_cpp" and promoted.replica.model == TARGET
    config = httpx.get(f"{base_url}/v1/config", timeout=30).json()
    assert {k: config[k] for k in ("replica", "provenance", "policy")} == promoted.model_dump(mode="json")
    assert config["version"] == served["origin"]["version"]
    # the study's own deploy/serving_config.json is the same config the registry holds
    assert json.loads((out / "deploy" / SERVING_FILE).read_text()) == promoted.model_dump(mode="json")

    api = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused-localhost", max_retries=0, timeout=300)
    assert [m.id for m in api.models.list().data] == [TARGET]  # llama-server's --alias: the configured model name
    prompt = "def add(a, b):\n    return"
    completion = api.completions.create(model=TARGET, prompt=prompt, max_tokens=12, temperature=0)
    assert completion.choices[0].text and completion.usage and completion.usage.completion_tokens == 12
    streamed = "".join(c.choices[0].text for c in api.completions.create(
        model=TARGET, prompt=prompt, max_tokens=12, temperature=0, stream=True) if c.choices)
    assert streamed == completion.choices[0].text
    chat = api.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": "Say hello."}],
                                       max_tokens=12, temperature=0)
    assert chat.choices[0].message.content and chat.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("which", ["promoted", "draft trial"])
def test_exported_llama_server_command_starts_llama_server(draft_study, which):
    """deploy/llama_server_command.sh is the winner's llama-server alone (no shim, no Python): pasted into a shell it
    starts llama-server and answers. "promoted": the study's own deploy/ file; "draft trial": the draft trial's config
    rendered as finalize renders a winner (the tiny study may keep the baseline, and `-md` must be checked live too).
    Only host and port are changed here (another service may hold 30000)."""
    study, out, uri = draft_study
    if which == "promoted":
        model = load_serving_config(uri, f"models:/specdec-{study.name}@production").replica.model
        script = (out / "deploy" / LLAMA_SERVER_COMMAND_FILE).read_text()
    else:
        tracker = Tracker(uri, study.name)
        client = tracker.client()
        run = next(r for r in client.search_runs([tracker.experiment_id()], max_results=50)
                   if r.data.tags.get("specdec.kind") == "trial" and r.data.params["spec.algorithm"] == "llama_draft")
        trial = TrialConfig.model_validate_json(
            Path(client.download_artifacts(run.info.run_id, "trial_config.json", str(out))).read_text())
        provenance = Provenance(study=study.name, decision="promote", source="draft trial", workload="w",
                                workload_digest="d")
        serving = serving_config(replica_config(study, trial, out), provenance)
        model = serving.replica.model
        script = deploy_files(serving, {"config_file": "c"}, "1")[LLAMA_SERVER_COMMAND_FILE]
    line = next(ln for ln in script.splitlines() if ln.startswith("exec "))
    argv = shlex.split(line)[1:]
    assert Path(argv[0]).name == "llama-server"
    if which == "draft trial":
        assert argv[argv.index("--spec-type") + 1] == "draft-simple" and "--spec-draft-model" in argv
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    argv[argv.index("--host") + 1] = "127.0.0.1"
    log = out / f"pasted-llama-server-{which.replace(' ', '-')}.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(["sh", "-c", shlex.join(argv)], stdout=sink, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:  # poll readiness: llama-server loads the GGUF file(s) first
            assert process.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300, json={
            "model": model, "prompt": "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", "max_tokens": 16,
            "temperature": 0}).json()
        assert answer["usage"]["completion_tokens"] == 16 and answer["model"] == model
        if which == "draft trial":
            # llama-server's own count: the pasted command really drafted with the Q4_1 file
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
            drafted = [ln for ln in metrics.splitlines()
                       if ln.startswith("llamacpp:spec_decode_num_draft_tokens_total")]
            assert drafted and float(drafted[0].split()[-1]) > 0, metrics
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
