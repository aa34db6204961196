"""`pipeline.retune` for real: a capture written by the endpoint's capture writer (`serve.closed_loop.capture.Capture`), a study
on local Ray + the CPU engine (SmolLM2-135M) + MLflow on SQLite, production's config enqueued beside the baseline,
the result registered as alias `candidate` while production stays. Small on purpose: 2 trials (baseline and
production's config), 2 measured + 2 warm-up prompts of 8 tokens, nothing re-measured (about a minute)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.records.registry import CANDIDATE, PRODUCTION, alias_version, register_config
from pipeline.records.tracking import Tracker
from pipeline.loop.retune import RetuneOptions, retune
from pipeline.workloads import load_workload
from serve.closed_loop.capture import Capture, CaptureSettings
from serve.engines.base import ReplicaConfig
from serve.serving import Provenance, ServingConfig

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]
NAME = "specdec-retune-it"
SPEC = {"algorithm": "ngram", "num_draft_tokens": 3, "max_bfs_breadth": 2, "capacity": 100000}
SPACE = ("algorithms: [none, ngram]\ncommon:\n  warmup_requests: {type: fixed, value: 1}\nbranches:\n  ngram:\n"
         "    num_draft_tokens: {type: int, low: 2, high: 4}\n    max_bfs_breadth: {type: int, low: 1, high: 2}\n"
         "    capacity: {type: fixed, value: 100000}\n")
TEMPLATED = "Thanks! Your ticket is open and our team will answer soon."


def test_retune_on_a_capture_registers_a_candidate_and_leaves_production(tmp_path: Path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "production-study", artifact_dir=tmp_path / "artifacts")
    run_id = tracker.start_study("production-study", "name: production-study\n", resume=False)
    production = ServingConfig(replica=ReplicaConfig(model="smollm2-135m", spec=SPEC, start_timeout_s=420.0),
                               provenance=Provenance(study="production-study", decision="promote", source="final-0",
                                                     workload="templated", workload_digest="0" * 16))
    assert register_config(tracker, run_id, NAME, production, move_production=True) == "1"
    capture = Capture(CaptureSettings(dir=str(tmp_path / "parts"), sample_rate=1, flush_rows=4, seed=0), 64)
    for i in range(12):
        answer = TEMPLATED if i % 4 == 0 else f"Ticket {i} was closed yesterday."
        capture.record("/v1/chat/completions", {"messages": [{"role": "user", "content": f"Status of ticket {i}?"}],
                                                "max_tokens": 8}, answer)
    capture.flush()
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)

    options = RetuneOptions(
        tracking_uri=uri, registered_model=NAME, capture=str(tmp_path / "parts"), output=str(tmp_path / "retune"),
        trials=2, measure_prompts=2, warmup_prompts=2, seed=0,
        overrides={"search_space": str(space), "promotion.finalists": 0, "engine.start_timeout_s": 300,
                   "budget.early_stopping": False,
                   "workload.remeasure": 0})
    result = retune(options)
    # a loop that died after the study finished resumes to the same result, registering nothing again
    assert retune(options.model_copy(update={"resume": True})) == result
    assert len(tracker.client().search_model_versions(f"name='{NAME}'")) == 2

    assert (result.production_version, result.candidate_version) == ("1", "2")
    assert alias_version(tracker, NAME, PRODUCTION) == "1" and alias_version(tracker, NAME, CANDIDATE) == "2"
    assert result.seeded == {"algorithm": "ngram", "ngram.num_draft_tokens": 3, "ngram.max_bfs_breadth": 2}
    assert not result.same_as_production  # nothing re-measured: the study keeps its baseline
    tags = tracker.client().get_model_version(NAME, "2").tags
    assert tags["retune_of"] == "1" and tags["seeded_from"] == "True"
    # the study measured production's own config beside the baseline, on the captured prompts
    study = Tracker(uri, result.study)
    runs = [r for r in study.client().search_runs([study.experiment_id()], max_results=50)
            if r.data.tags.get("specdec.kind") == "trial"]
    assert sorted(r.data.params.get("spec.algorithm") for r in runs) == ["ngram", "none"]
    seeded = next(r for r in runs if r.data.params.get("spec.algorithm") == "ngram")
    assert (seeded.data.params["spec.num_draft_tokens"], seeded.data.params["spec.max_bfs_breadth"]) == ("3", "2")
    assert {r.data.tags["outcome"] for r in runs} == {"COMPLETE"}
    # what the study replayed holds prompts only; the corpus holds no measured answer
    folder = Path(result.output) / "capture"
    workload = pq.read_table(folder / "workload.parquet").to_pylist()
    assert len(workload) == 4 and "output" not in workload[0]
    split = json.loads((folder / "split.json").read_text())
    assert split["measure"] == 2 and split["warmup"] == 2 and split["prompts"] == 12
    corpus = [json.loads(line) for line in (folder / "corpus.jsonl").read_text().splitlines()]
    assert corpus and len(corpus) == split["corpus"]
    measured = load_workload(folder / "workload.parquet", seed=0, n_warmup=2, n_measure=2).measure
    answers = {f"Ticket {i} was closed yesterday." if i % 4 else TEMPLATED for i in range(12)
               if any(f"Status of ticket {i}?" in p.text for p in measured)}
    assert len(answers) >= 1
    assert not [doc for doc in corpus for answer in answers if answer in doc]
    assert (folder / "corpus.jsonl").stat().st_mode & 0o777 == 0o600
