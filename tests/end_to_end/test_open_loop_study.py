"""Open-loop load end to end (issue #17): a 2-trial study with `workload.arrival: {mode: poisson}` on the real stack
(local Ray, Ray Serve replicas of the CPU engine, MLflow and Optuna on SQLite). Every trial and every finalist re-run
sends the measured prompts on the study's seeded Poisson schedule, records the offered and drawn rates, and runs with
early stopping off."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from pipeline.config import load_study
from pipeline.measure.summary import to_records
from pipeline.measure.openloop import poisson_schedule
from pipeline.records.tracking import Tracker
from pipeline.search.space import load_space
from pipeline.study.driver import run_study
from tests.conftest import TINY_SPACE, TINY_STUDY

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]
RATE, BOUND, MEASURED = 20.0, 60.0, 4


def test_a_poisson_study_measures_trials_and_finalists_open_loop(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text(TINY_SPACE)
    study = load_study(None, {
        **TINY_STUDY, "name": "it-open-loop", "output_dir": str(tmp_path), "search_space": str(space), "seed": 0,
        "workload.measure_prompts": MEASURED, "budget.max_trials": 2, "promotion.finalists": 1,
        # one-line prompts (~10 tokens): the 8 runs' four requests arrive together, and ~200-token prompts made each
        # window mostly prefill
        "workload.source": "free-text",
        "workload.arrival": {"mode": "poisson", "rate_per_s": RATE, "max_duration_s": BOUND}})
    schedule = poisson_schedule(MEASURED, RATE, seed=study.seed, max_duration_s=BOUND)
    assert len(schedule) == MEASURED

    assert run_study(study, load_space(space)) == 0

    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", study.name)
    client = tracker.client()
    runs = client.search_runs([tracker.experiment_id()], order_by=["attributes.start_time ASC"], max_results=100)
    trials = [r for r in runs if r.data.tags.get("specdec.kind") == "trial"]
    finalists = [r for r in runs if r.data.tags.get("specdec.kind") == "finalist"]
    assert [r.data.params.get("spec.algorithm") for r in trials] == ["none", "ngram"]
    assert [r.data.tags["outcome"] for r in trials] == ["COMPLETE", "COMPLETE"], [r.data.tags.get("reason")
                                                                                 for r in trials]
    # baseline and the one finalist, promotion.runs fresh runs each, all on the same schedule
    assert len(finalists) == 2 * study.promotion.runs
    orders: set[tuple[int, ...]] = set()
    for run in trials + finalists:
        metrics = run.data.metrics
        assert metrics["offered_rate_per_s"] == RATE
        assert metrics["arrival_rate_per_s"] > 0 and metrics["req_per_s"] > 0
        assert metrics["n_requests"] == MEASURED and metrics["tput_tok_s"] > 0
        path = client.download_artifacts(run.info.run_id, "requests.parquet", str(tmp_path))
        measured = [r for r in to_records(pq.read_table(path)) if r.phase == "measure"]
        orders.add(tuple(r.prompt_index for r in measured))
        seen = [(r.start_s, offset, r.error) for r, offset in zip(measured, schedule)]
        assert all(r.ok for r in measured), (run.data.tags, seen)
        assert all(r.start_s >= offset for r, offset in zip(measured, schedule)), seen  # never before arrival
        # Arrivals (all within a fraction of a second at 20/s) do not wait for earlier answers (12 CPU-decoded
        # tokens each): in a closed loop at concurrency 1 no request could start before its predecessor ended.
        assert any(b.start_s < a.start_s + a.e2e_s for a, b in zip(measured, measured[1:]))
    assert len(orders) == 1  # the same prompts in the same order everywhere
    for run in trials:
        assert run.data.tags["early_stopping"].startswith("off (workload.arrival.mode: poisson")
    for run in finalists:
        assert run.data.tags["arrival"] == "open loop: poisson 20 req/s, arrivals within 60 s"
        # each re-run's window checked and recorded as a trial's is: the promotion rule decides on these figures
        assert run.data.tags["measurement_flag"] in ("clean", "re-measured", "disturbed", "unchecked")
        assert "window_remeasured" in run.data.metrics and run.data.tags["measurement_window"]
