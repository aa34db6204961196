"""The equivalence modes end to end on the real CPU engine made batch-dependent the way a GPU is (`--test-fault
batch-noise`: decode logits perturbed by noise seeded by each round's batch composition). Under that noise `exact`
refuses a lossless NGRAM config (its outputs drift from the baseline's), `baseline-noise` accepts it (it drifts no
more than the baseline's own second pass), and both refuse a config that emits wrong tokens (`wrong-tokens`).
Real trials (`run_trial`: local Ray Serve replica, MLflow on SQLite), one baseline for all; the second mode's trial
of each config shares the first one's engine launch, as the search does for equal engine settings.

The noise makes every outcome here a random event: `exact` passing the lossless config needs all 12 outputs to stay
identical (about 2^-12 at this noise), and `baseline-noise` refusing it is the sign test's false reject, at most
its alpha, set to 0.001 here (the wrong-token config's p is 2^-12 = 0.00024).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipeline.config import TrialConfig, load_study
from pipeline.records.tracking import Tracker
from pipeline.records.trial_runs import NOISE_ARTIFACT
from pipeline.vocabulary.resolution import Resolution
from pipeline.study.driver import build_context, connect_ray
from pipeline.trial.lifecycle import run_trial
from pipeline.vocabulary.outcome import Outcome
from pipeline.trial.replicas import delete_study_apps
from serve.spec import NgramSpec, NoSpec
from tests.integration.conftest import SMOL, TEST_THREADS

pytestmark = pytest.mark.integration
NAME = "it-equivalence"
NOISE = "batch-noise=0.7"
LOSSLESS = NgramSpec(num_draft_tokens=4, max_bfs_breadth=1)
STUDY = {"name": NAME, "model": {"target": SMOL}, "concurrency": [4], "budget": {"early_stopping": False},
         "engine": {"threads": TEST_THREADS, "start_timeout_s": 300,
                    "extra_flags": ["--verify-probe-seconds", "0", "--test-fault", NOISE]},
         "workload": {"source": "free-text", "warmup_prompts": 1, "measure_prompts": 12, "max_new_tokens": 10,
                      "remeasure": 0},
         "promotion": {"equivalence": "baseline-noise", "equivalence_alpha": 0.001}}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    out = tmp_path_factory.mktemp("equivalence")
    study = load_study(None, {**{k: v for k, v in _flat(STUDY).items()}, "output_dir": str(out)})
    tracker = Tracker(f"sqlite:///{out / 'mlflow.db'}", NAME, artifact_dir=out / "mlartifacts")
    parent = tracker.start_study(NAME, "name: it-equivalence\n", resume=False)
    context = build_context(study, out, connect_ray(NAME), tracker, parent)
    yield context
    delete_study_apps(NAME)


def _flat(tree: dict, prefix: str = "") -> dict:
    out: dict = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key not in ("env",):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def trial(ctx, label: str, spec, mode: str, faults: tuple[str, ...] = ()):
    study = ctx.study
    engine = study.engine.model_copy(update={"extra_flags": [*study.engine.extra_flags, *faults]})
    promotion = study.promotion.model_copy(update={"equivalence": mode})
    mode_ctx = dataclasses.replace(ctx, study=study.model_copy(update={"engine": engine, "promotion": promotion}))
    result = run_trial(mode_ctx, label, Resolution(params={"algorithm": spec.algorithm},
                                                   config=TrialConfig(spec=spec, concurrency=4)))
    run = ctx.tracker.client().get_run(result.run_id)
    return result, run


@pytest.fixture(scope="module")
def baseline(ctx):
    return trial(ctx, "baseline", NoSpec(), "baseline-noise")


def test_the_baseline_measures_its_own_noise_on_a_fresh_launch(ctx, baseline):
    result, run = baseline
    assert result.outcome is Outcome.COMPLETE, result.reason
    metrics = run.data.metrics
    assert metrics["engine_launches"] == 2  # the noise pass ran on a launch of its own, as every trial does
    assert metrics["time_start_loading_s"] > 0 and "time_start_preflight_s" in metrics
    # the engine's own divergence at the search level: the noise diverges the baseline from itself
    assert 0 <= metrics["self_identical_share"] < 1 and 0 < metrics["self_token_agreement"] < 1
    path = ctx.tracker.client().download_artifacts(run.info.run_id, NOISE_ARTIFACT)
    assert len(json.loads(Path(path).read_text())) == 12


def test_exact_refuses_a_lossless_config_under_batch_noise_and_baseline_noise_accepts_it(ctx, baseline):
    noisy, noisy_run = trial(ctx, "ngram-noise", LOSSLESS, "baseline-noise")
    assert noisy.outcome is Outcome.COMPLETE, noisy.reason
    assert noisy.equivalence is not None and noisy.equivalence.noise is not None and noisy.equivalence.passed
    exact, exact_run = trial(ctx, "ngram-exact", LOSSLESS, "exact")
    assert exact.outcome is Outcome.NOT_EQUIVALENT, exact.reason
    assert exact.equivalence is not None and exact.equivalence.identical_share < 1.0
    # equal engine settings: the second trial ran on the first one's engine
    assert (noisy_run.data.metrics["engine_launches"], exact_run.data.metrics["engine_launches"]) == (1, 0)
    assert exact_run.data.tags["engine_launch"] == "shared"


def test_both_modes_refuse_wrong_tokens(ctx, baseline):
    wrong = ("--test-fault", "wrong-tokens@speculative")
    noisy, _ = trial(ctx, "wrong-noise", LOSSLESS, "baseline-noise", wrong)
    assert noisy.outcome is Outcome.NOT_EQUIVALENT, noisy.reason
    assert noisy.equivalence is not None and noisy.equivalence.noise is not None
    assert noisy.equivalence.noise.worse == 12 and noisy.equivalence.noise.better == 0
    exact, _ = trial(ctx, "wrong-exact", LOSSLESS, "exact", wrong)
    assert exact.outcome is Outcome.NOT_EQUIVALENT and exact.equivalence is not None
    assert exact.equivalence.identical_share == 0.0
