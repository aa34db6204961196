"""A study run beside a running endpoint (issue 42): `python -m serve.production` and `python -m pipeline.tune` each
start their own local Ray on one machine, as an operator runs them (the endpoint serving, a re-tune or a new study
beside it), with HOME a fresh folder (no `~/.ray` left by earlier runs: each Ray makes its own token; the model and
kernel cache stays the machine's, `SPECDEC_CACHE`, or the endpoint would fetch and convert the model again: 2 of the
test's 4 minutes). The study runs to its decision, and the endpoint answers before, during and after it; neither
joins or stops the other's Ray. One baseline trial on two short prompts: what is checked is the two processes side by
side, not the study.

The study runs with `--quiet` (`specdec-tune --quiet`, as a user runs it from a shell: tests/cli_run.py's
environment), so the same command also shows the quiet console: the decision and where to look, nothing of the
progress, while `<output>/study.log` holds everything, the progress and the internals included, without a progress
bar (the levels themselves are unit-tested: tests/unit/test_console_log.py). One study for both: each is a whole
study's start-up, search and finalize."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from pipeline.console_log import LOG_FILE
from serve.engines.base import ReplicaConfig, child_env
from serve.model_store import cache_root
from serve.ports import free_port
from serve.serving import Provenance, ServingConfig
from tests.cli_run import clean_env
from tests.integration.production_helpers import alive, app_processes, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]
REPO = Path(__file__).resolve().parents[2]
LINKS = ("report: ", "deploy files: ", "promoted config: ", "compare the trials", "  runs table: ")


@dataclass
class Beside:
    study: subprocess.CompletedProcess[str]  # `python -m pipeline.tune --quiet`, run to its end
    output: Path  # the study's output folder
    answers: bool  # the endpoint answered right after the study
    engines: list[psutil.Process]  # the endpoint's engine processes, found before the study
    engines_alive: list[psutil.Process]  # those of them still running after it


@pytest.fixture(scope="module")
def beside(tmp_path_factory) -> Iterator[Beside]:
    tmp_path = tmp_path_factory.mktemp("beside")
    home = tmp_path / "home"
    home.mkdir()
    env = {**{k: v for k, v in child_env().items() if k not in ("SPECDEC_API_KEYS", "RAY_AUTH_MODE",
                                                                "RAY_ADDRESS")}, "HOME": str(home),
           "SPECDEC_CACHE": str(cache_root())}
    config = ServingConfig(replica=ReplicaConfig(model="smollm2-135m", threads=1),
                           provenance=Provenance(study="beside", decision="keep_baseline", source="baseline",
                                                 workload="w", workload_digest="0123456789abcdef"))
    (tmp_path / "serving.json").write_text(config.model_dump_json())
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "endpoint.log"
    with open(log_path, "wb") as log:
        endpoint = subprocess.Popen([sys.executable, "-m", "serve.production", "--config-file",
                                     str(tmp_path / "serving.json"), "--port", str(port), "--threads", "1",
                                     "--follow-alias-s", "0"], cwd=REPO, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
    everything: list[psutil.Process] = []

    def answers() -> bool:
        assert endpoint.poll() is None, log_path.read_text(errors="replace")[-3000:]
        try:
            reply = httpx.post(f"{base_url}/v1/completions", timeout=120,
                               json={"model": "m", "prompt": "One,", "max_tokens": 2, "temperature": 0})
        except httpx.HTTPError:
            return False
        return reply.status_code == 200

    try:
        wait_for(answers, "the endpoint answering", 600, period_s=0.5)
        everything = psutil.Process(endpoint.pid).children(recursive=True)
        engines = app_processes("production", root=endpoint.pid)["engine"]
        assert len(engines) == 1
        space = tmp_path / "space.yaml"
        space.write_text("algorithms: [none, ngram]\nbranches:\n  ngram:\n    num_draft_tokens: {type: fixed, value: 4}\n")
        study = tmp_path / "study.yaml"
        study.write_text(f"name: beside\nsearch_space: {space}\nbudget: {{max_trials: 1}}\n"
                         "workload: {warmup_prompts: 1, measure_prompts: 2, max_new_tokens: 4, remeasure: 0}\n"
                         "engine: {threads: 1, start_timeout_s: 300}\npromotion: {finalists: 0}\n")
        # the study as a user types it in a shell (tests/cli_run.py: PATH, the locale, this HOME, the caches): no
        # TQDM_DISABLE or other setting of this process's that would hide a progress bar the command failed to quiet
        done = subprocess.run([sys.executable, "-m", "pipeline.tune", "--study", str(study), "--output",
                               str(tmp_path / "out"), "--quiet"], cwd=REPO, env=clean_env(home), capture_output=True,
                              text=True, timeout=1200)
        (tmp_path / "tune.log").write_text(done.stdout + done.stderr)  # kept with the test's folder for a failure's reader
        yield Beside(done, tmp_path / "out", answers(), engines, alive(engines))
    finally:
        if endpoint.poll() is None:
            os.killpg(endpoint.pid, signal.SIGINT)
            try:
                endpoint.wait(timeout=180)
            except subprocess.TimeoutExpired:
                os.killpg(endpoint.pid, signal.SIGKILL)
                endpoint.wait(timeout=60)
        for proc in alive(everything):
            proc.kill()


def test_a_study_runs_to_its_decision_beside_a_serving_endpoint(beside):
    done = beside.study
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "decision:" in done.stdout
    assert beside.answers  # the endpoint's Ray and engine were neither joined nor stopped by the study's
    assert beside.engines_alive == beside.engines


def test_a_quiet_study_prints_its_decision_last_and_logs_the_rest(beside):
    result = beside.study
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    out = result.stdout
    assert "decision: " in out, out[-3000:]
    for progress in ("[trial 1/1]", "starting the engine", "study 'beside'", "search: "):
        assert progress not in out, out[-3000:]
    lines = out.rstrip().splitlines()
    rule = max(i for i, line in enumerate(lines) if set(line) == {"="})  # the headline's closing rule
    after = lines[rule + 1:]
    assert after and all(line.startswith(LINKS) for line in after), after
    logged = (beside.output / LOG_FILE).read_text()
    for kept in ("[trial 1/1]", "(the baseline)", "HEADLINE", "decision: "):
        assert kept in logged, logged[-3000:]
    assert "\r" not in logged
