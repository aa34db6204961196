"""Engine launches: which trial configs may share a running engine (serve/replica/sharing.py), the dry run's launch plan on
examples/study-gpu.yaml's shape, a trial following its replica's start phases (a deadline per phase, not one total),
and corpus figures read where SGLang reports them. Pure, plus a real local HTTP server scripted as a replica."""

from __future__ import annotations

import json

import pytest

from pipeline.config import TrialConfig, load_study
from pipeline.vocabulary.resolution import Resolution
from pipeline.trial.corpus import CorpusFile, corpus_record
from pipeline.trial.launches import plan_launches
from pipeline.trial.engine_pass import launch_of
from pipeline.trial.replicas import LiveApp, overdue, wait_started
from serve.engines.base import ReplicaConfig
from serve.engines.phases import StartState
from serve.replica.sharing import can_share, launch_config
from serve.spec import NgramSpec
from tests.local_http import local_server

BASE = dict(model="smollm2-135m", threads=1, extra_flags=["--verify-probe-seconds", "0"])


def ngram(**fields) -> ReplicaConfig:
    return ReplicaConfig(**BASE, spec=NgramSpec(num_draft_tokens=8, max_bfs_breadth=2, **fields),
                         log_dir=f"/t/{len(fields)}")


def test_equal_engine_settings_share_a_launch_whatever_the_log_folder_timeout_or_corpus():
    a = ngram()
    assert can_share(a, a.model_copy(update={"log_dir": "/elsewhere", "start_timeout_s": 5}))
    with_corpus = ngram(external_corpus="/t/c.jsonl", external_sam_budget=3)
    other_corpus = ngram(external_corpus="/t/d.jsonl", external_sam_budget=3)
    assert can_share(with_corpus, other_corpus)  # a corpus is loaded at runtime, never a launch flag
    launched = launch_config(with_corpus)
    assert isinstance(launched.spec, NgramSpec) and launched.spec.external_corpus is None


def test_a_config_without_corpus_runs_on_any_sam_budget_but_a_corpus_needs_its_own():
    budget = ngram(external_corpus="/t/c.jsonl", external_sam_budget=3)
    plain = ngram()
    assert can_share(budget, plain)  # no SAM loaded: the trie drafts alone with the whole budget
    assert not can_share(plain, budget)  # the budget is a launch flag
    assert not can_share(budget, ngram(external_corpus="/t/c.jsonl", external_sam_budget=2))


def test_other_engine_settings_never_share():
    a = ngram()
    assert not can_share(a, a.model_copy(update={"spec": NgramSpec(num_draft_tokens=4, max_bfs_breadth=2)}))
    assert not can_share(a, a.model_copy(update={"extra_flags": ["--verify-probe-seconds", "1"]}))
    assert not can_share(a, a.model_copy(update={"max_running_requests": 8}))
    assert not can_share(a, a.model_copy(update={"env": {"X": "1"}}))


def test_the_dry_run_plan_on_the_gpu_example_shape():
    """examples/study-gpu.yaml: levels [8, 1], 3 finalists x 3 runs. The finalists cost a launch per run, not per run
    and level (12 instead of 24); equal consecutive engine settings share one launch in the search."""
    study = load_study("examples/study-gpu.yaml")
    base = TrialConfig()
    spec = NgramSpec(num_draft_tokens=4, max_bfs_breadth=2)
    same_engine = [TrialConfig(spec=spec, warmup_requests=w) for w in (0, 8, 16)]  # warm-up only differs
    other = TrialConfig(spec=NgramSpec(num_draft_tokens=6, max_bfs_breadth=2))
    sampled = [Resolution(params={}, config=c, violations=[]) for c in (base, *same_engine, other)]
    plan = plan_launches(study, sampled)
    assert (plan.trials, plan.search) == (5, 3)  # baseline, one launch for the three warm-ups, the other config
    assert (plan.finalists, plan.finalists_unshared) == (12, 24)
    assert plan.deterministic == 0 and plan.noise == 1  # baseline-noise: the noise pass on a fresh launch
    assert plan.total == 16 and plan.unshared == 30
    deterministic = load_study(None, {"concurrency": [8, 1], "promotion.finalists": 3,
                                      "promotion.equivalence": "deterministic"})
    assert plan_launches(deterministic, sampled).deterministic == 0  # the CPU engine: deterministic is exact


def _status(phase: str | None, elapsed: float, limit: float, phases: dict[str, float], done: bool = False,
            seq: int = 0) -> dict:
    return {"seq": seq, "running": not done, "done": done, "ok": True if done else None, "error": None,
            "shared": False, "phase": phase, "phase_elapsed_s": elapsed, "phase_limit_s": limit, "phases": phases}


# A big model's start as the replica reports it: stopping the old engine, SGLang's preflight, waiting for the GPUs,
# then a load that takes most of start_timeout_s=1200. 1465 s in all: past the old single deadline of 1200 + 60 s.
BIG_START = [
    _status("stopping", 15, 25, {}, seq=1),
    _status("preflight", 250, 600, {"stopping": 15}, seq=2),
    _status("waiting_for_gpus", 100, 120, {"stopping": 15, "preflight": 250}, seq=3),
    _status("loading", 1100, 1200, {"stopping": 15, "preflight": 250, "waiting_for_gpus": 100}, seq=4),
    _status(None, 0, 0, {"stopping": 15, "preflight": 250, "waiting_for_gpus": 100, "loading": 1100}, done=True,
            seq=5),
]


@pytest.fixture
def scripted_replica():
    """A local HTTP server answering /replica/start with the statuses in `script`, one per call."""
    script: list[dict] = []

    with local_server(lambda method, path: (200, json.dumps(script.pop(0) if script else {}).encode())) as url:
        yield LiveApp("study~trial-a", url, {}), script


def test_the_deadline_follows_each_phase_so_a_long_start_is_waited_for(scripted_replica):
    """Defect: the driver gave the whole start start_timeout_s + 60 s, but before the load began the replica could
    spend 20 s stopping, 300 s in preflight and 120 s waiting for GPUs: a slow big-model start became TIMEOUT."""
    live, script = scripted_replica
    script.extend(BIG_START)
    assert sum(BIG_START[-1]["phases"].values()) > 1200 + 60
    final = wait_started(live, poll_s=0)
    assert final["done"] and final["phases"]["loading"] == 1100 and not script


def test_a_phase_past_its_own_limit_is_given_up_naming_the_phase(scripted_replica):
    live, script = scripted_replica
    script.extend([BIG_START[0], _status("loading", 1300, 1200, {"stopping": 15, "preflight": 250}, seq=2)])
    with pytest.raises(TimeoutError, match=r"stuck in phase loading for 1300 s, past its limit of 1200 s"):
        wait_started(live, poll_s=0)
    assert overdue(_status("loading", 1250, 1200, {})) is None  # within the grace


def test_a_failed_start_raises_the_replicas_reason(scripted_replica):
    live, script = scripted_replica
    script.append({**BIG_START[-1], "ok": False, "error": "[engine rejected the config] bad flag"})
    with pytest.raises(RuntimeError, match=r"\[engine rejected the config\] bad flag"):
        wait_started(live, poll_s=0)


def test_start_state_times_each_phase_and_the_trial_records_them():
    state = StartState()
    state.begin()
    state.enter("stopping", 25)
    state.enter("loading", 300)
    state.finish(None)
    snap = state.snapshot()
    phases = snap["phases"]
    assert isinstance(phases, dict)  # the snapshot is JSON-shaped: its values are typed object
    assert snap["done"] and snap["ok"] and list(phases) == ["stopping", "loading"]
    answer = {"phases": snap["phases"], "launch": {"shared": True, "launched": ngram(external_sam_budget=3)
                                                   .model_dump(mode="json")}}
    launch = launch_of(answer, ngram())
    assert launch.shared and launch.launches == 0 and set(launch.timings) == {"start_stopping_s", "start_loading_s"}
    assert isinstance(launch.config.spec, NgramSpec)
    assert launch.config.spec.external_sam_budget == 3  # the diff compares against what was launched


def test_corpus_figures_come_from_the_engines_corpus_list_and_the_replicas_load():
    """Defect: the corpus tokens were read from `/server_info` keys SGLang does not have (`internal_states[0]
    .external_corpora`, `startup_time.load_external_corpus`), so every SGLang corpus trial logged 0 tokens. The
    figures come from `GET /list_external_corpora` (SGLang's `corpus_token_counts`) and the replica's timed load."""
    corpus = CorpusFile("/t/corpora/warmup-1.jsonl", 3, 120, "ab")
    figures, problem = corpus_record({corpus.path: 42}, {"id": corpus.path, "load_s": 1.25}, corpus)
    assert problem is None and figures == {"corpus_tokens": 42.0, "corpus_documents": 3.0, "corpus_bytes": 120.0,
                                           "corpus_load_s": 1.25}
    _, other = corpus_record({"/elsewhere.jsonl": 9}, {"id": corpus.path}, corpus)
    assert other and "/elsewhere.jsonl" in other  # the engine's own list, never a silent 0
    _, stale = corpus_record({corpus.path: 42}, None, None)  # a shared launch must not keep the last trial's corpus
    assert stale and "did not ask for" in stale
    assert corpus_record(None, None, None) == ({}, None)
