"""Distributed mode on one machine: PostgreSQL (Debian's server, started here) as the Optuna storage and the MLflow
backend, a Ray cluster started with `ray start --head` (token auth, as Ray 2.60 does by default), a small study run
against them by one driver, then a second driver with a fresh output folder continuing the same study from the
database. Skipped when PostgreSQL's binaries or psycopg2 are missing (.ci/run installs them)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import optuna
import pytest

from pipeline.search.space import BASELINE_ATTR
from serve.ports import free_port
from serve.production.app import load_serving_config

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]
REPO = Path(__file__).resolve().parents[2]
PG_BIN = sorted(glob.glob("/usr/lib/postgresql/*/bin"))[-1:] or [""]
psycopg2 = pytest.importorskip("psycopg2", reason="psycopg2-binary is not installed")
if not Path(PG_BIN[0], "initdb").exists():
    pytest.skip("PostgreSQL server binaries are not installed (apt-get install postgresql)", allow_module_level=True)


def as_postgres(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """initdb/pg_ctl refuse to run as root; run them as the postgres user when we are root."""
    if os.geteuid() == 0:
        argv = ["runuser", "-u", "postgres", "--", *argv]
    done = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stdout[-2000:]} {done.stderr[-2000:]}")
    return done


@pytest.fixture(scope="module")
def postgres(tmp_path_factory):
    # Not under pytest's tmp folder: the postgres user cannot traverse root's 0700 pytest directories.
    base = Path(tempfile.mkdtemp(prefix="specdec-pg-"))
    data, sock = base / "data", base / "sock"
    sock.mkdir()
    if os.geteuid() == 0:
        shutil.chown(base, "postgres")
        shutil.chown(sock, "postgres")
    port = free_port()
    as_postgres([f"{PG_BIN[0]}/initdb", "-D", str(data), "-U", "specdec", "--auth=trust"])
    as_postgres([f"{PG_BIN[0]}/pg_ctl", "-D", str(data), "-l", str(base / "pg.log"), "-w", "-o",
                 f"-p {port} -k {sock} -c listen_addresses=127.0.0.1", "start"])
    try:
        for db in ("optuna", "mlflow"):
            as_postgres([f"{PG_BIN[0]}/createdb", "-h", "127.0.0.1", "-p", str(port), "-U", "specdec", db])
        yield f"postgresql+psycopg2://specdec@127.0.0.1:{port}"
    finally:
        as_postgres([f"{PG_BIN[0]}/pg_ctl", "-D", str(data), "-m", "immediate", "stop"])
        shutil.rmtree(base, ignore_errors=True)


def run_driver(study_file: Path, output: Path, env: dict, resume: bool) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "pipeline.tune", "--study", str(study_file), "--output", str(output)]
    return subprocess.run(argv + (["--resume"] if resume else []), cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1500)


def test_study_on_postgres_and_a_ray_cluster_resumes_from_the_database(tmp_path, postgres, ray_head):
    address, env = ray_head.address, ray_head.env
    space = tmp_path / "space.yaml"
    # The second driver must promote (possible only with the baseline's outputs, which that driver, a new, empty
    # folder, can read from MLflow alone). Which way a measurement falls depends on the machine (on a 2-core EPYC the
    # finalist once measured 18.31 vs the baseline's 16.95 tok/s, under the 3% bar, and the study rightly kept the
    # baseline), so the outcome is forced: the baseline engine runs 4x slower (`slow-steps=4@baseline`, a CPU-engine
    # test switch) and any lossless NGRAM config beats it. 2x was not enough beside the end-to-end loop test: the
    # finalist's 3 runs spread 1.21x-3.95x the baseline (median 2.77x), and the rule's median - 1.48 MAD scored it
    # under the bar.
    space.write_text("algorithms: [none, ngram]\ncommon:\n  warmup_requests: {type: fixed, value: 1}\nbranches:\n"
                     "  ngram:\n    num_draft_tokens: {type: int, low: 8, high: 9}\n"
                     "    max_bfs_breadth: {type: fixed, value: 2}\n    max_trie_depth: {type: fixed, value: 12}\n"
                     "    capacity: {type: fixed, value: 100000}\n    warmup_requests: {type: fixed, value: 1}\n")
    study_file = tmp_path / "study.yaml"
    # Trust auth ignores the password, so the storage URL can carry one that must never be shown (issue #15 item 6).
    storage = postgres.replace("specdec@", "specdec:hunter2@") + "/optuna"
    # 1 warm-up request (of 2 warm-up prompts) and 4 measured prompts of 8 new tokens, from the free-text workload's
    # one-line prompts (~10 tokens): short runs keep the 8 engine runs cheap. The slowed baseline's 4 runs are most of
    # the test, and with the templated workload's ~200-token prompts, whose prefills the fault slows too, each took
    # 37-40 s.
    common = (f"search_space: {space}\nray: {{address: '{address}'}}\n"
              f"storage: {{url: '{storage}'}}\ntracking: {{uri: '{postgres}/mlflow'}}\n"
              "workload: {source: free-text, warmup_prompts: 2, measure_prompts: 4, max_new_tokens: 8,"
              " remeasure: 0}\n"
              "search: {strategy: tpe}\n"  # a search over launches resumed across drivers
              "engine: {start_timeout_s: 300, extra_flags: ['--test-fault', 'slow-steps=4@baseline']}\n")
    # The first driver only measures the baseline (finalists 0: no re-runs); the promotion policy may change on resume
    # (pipeline/study/resume.py), and the search and the promotion that matter here are the second driver's.
    study_file.write_text("name: dist\nbudget: {max_trials: 1}\npromotion: {finalists: 0}\n" + common)
    first = run_driver(study_file, tmp_path / "driver1", env, resume=False)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "hunter2" not in first.stdout + first.stderr + (tmp_path / "driver1" / "study.yaml").read_text()

    # A second driver, elsewhere, continues the same study from the database up to 2 trials.
    study_file.write_text("name: dist\nbudget: {max_trials: 2}\npromotion: {finalists: 1, spread_reruns: 0}\n" + common)
    second = run_driver(study_file, tmp_path / "driver2", env, resume=True)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "decision: PROMOTE" in second.stdout, second.stdout[-3000:]
    assert not list((tmp_path / "driver2").rglob("baseline_outputs*"))  # nothing but the tracking store to read
    command = (tmp_path / "driver2" / "deploy" / "engine_command.sh").read_text()
    assert "--speculative-algorithm" in command and "hunter2" not in command

    # A third driver with another workload must not continue this study's history (issue #15 item 13).
    study_file.write_text("name: dist\nbudget: {max_trials: 3}\npromotion: {finalists: 1, spread_reruns: 0}\n"
                          + common.replace("max_new_tokens: 8", "max_new_tokens: 16"))
    third = run_driver(study_file, tmp_path / "driver3", env, resume=True)
    assert third.returncode == 2 and "--resume refused" in third.stderr and "workload:" in third.stderr, third.stderr
    assert "hunter2" not in third.stderr

    trials = optuna.load_study(study_name="dist", storage=f"{postgres}/optuna").get_trials()
    assert [t.number for t in trials] == [0, 1]
    assert [t.user_attrs.get(BASELINE_ATTR, False) for t in trials] == [True, False]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"{postgres}/mlflow", registry_uri=f"{postgres}/mlflow")
    experiment = client.get_experiment_by_name("dist")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id], filter_string="tags.`specdec.kind` = 'trial'")
    assert len(runs) == 2
    studies = client.search_runs([experiment.experiment_id], filter_string="tags.`specdec.kind` = 'study'")
    assert len(studies) == 1  # the second driver continued the same parent run
    production = client.get_model_version_by_alias("specdec-dist", "production")
    assert f"registered specdec-dist version {production.version} as alias 'production'" in second.stdout
    served = load_serving_config(f"{postgres}/mlflow", "models:/specdec-dist@production")
    assert served.replica.spec.algorithm == "ngram" and served.provenance.decision == "promote"
    # The second driver's finalist re-runs were checked against the baseline's outputs, read from MLflow.
    finalists = [r for r in client.search_runs([experiment.experiment_id],
                                               filter_string="tags.`specdec.kind` = 'finalist'")
                 if r.data.tags.get("finalist") == served.provenance.source]
    assert len(finalists) >= 3 and all(r.data.tags["outcome"] == "COMPLETE" for r in finalists)
    for run in finalists[:3]:
        report = json.loads(Path(client.download_artifacts(run.info.run_id, "equivalence.json", str(tmp_path))).read_text())
        assert report["passed"] and report["n_prompts"] == 4, report
