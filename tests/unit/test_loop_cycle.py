"""The loop's state machine (pipeline/loop/cycle.py) end to end against the endpoint contract (serve/closed_loop/live.py,
serve/closed_loop/control.py) and a real MLflow registry on SQLite: drift starts a cycle, a faster candidate is
canaried and promoted, a slower one rolled back, an operator's abort honoured, and a loop restarted mid-canary
carries on. Every HTTP call goes through the loop's real client; the endpoint here is `ContractEndpoint`, a
stand-in that serves the contract's routes from memory (the production endpoint's own implementation of them is
tested with the endpoint), and the re-tune is a stand-in that registers a candidate (the real one is
tests/end_to_end/test_loop_retune.py)."""

from __future__ import annotations

import json
import random
import shutil
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from pipeline.loop.canary import CanarySettings
from pipeline.loop.client import EndpointClient
from pipeline.loop.cycle import Loop, LoopSettings
from pipeline.loop.split import SplitReport
from pipeline.loop.state import load_state, send_command
from pipeline.measure.summary import RequestRecord, to_table
from pipeline.records.registry import CANDIDATE, PREVIOUS, PRODUCTION, alias_version, register_config
from pipeline.records.tracking import Tracker
from pipeline.loop.retune import RetuneResult
from pipeline.vocabulary.outcome import Outcome
from serve.closed_loop.control import CanaryStart, CanaryStatus
from serve.engines.base import ReplicaConfig
from serve.closed_loop.live import LiveFeed, LiveRecord
from serve.serving import Provenance, ServingConfig

NAME = "specdec-loop-unit"
NGRAM = {"algorithm": "ngram", "num_draft_tokens": 4}


class Clock:
    def __init__(self) -> None:
        self.t = 1_700_000_000.0

    def __call__(self) -> float:
        return self.t


class ContractEndpoint:
    """The contract's routes from memory. `traffic` answers requests, each going to the candidate with the canary's
    share; before it, the endpoint has rolled to the registry's production alias (the real one polls the alias and
    rolls), so a promotion shows on `/v1/config` only a poll later, as it does for real."""

    def __init__(self, tracker: Tracker, clock: Clock) -> None:
        self.tracker, self.clock = tracker, clock
        self.records: list[LiveRecord] = []
        self.canary = CanaryStatus(state="off")
        self.calls: list[str] = []
        self.stops: list[str] = []
        self.drift: list[dict] = []
        self.rng = random.Random(0)
        self.speed = {"1": (20.0, 2.5)}  # version -> (tok/s, accept length)
        self.serving = "1"
        server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server = server
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        threading.Thread(target=server.serve_forever, daemon=True).start()

    def served(self) -> str:
        return self.serving

    def traffic(self, n: int, production_accept: float | None = None) -> None:
        self.serving = str(alias_version(self.tracker, NAME, PRODUCTION))  # it rolled to the alias meanwhile
        for _ in range(n):
            self.clock.t += 1.0
            arm = "candidate" if self.canary.state == "running" and self.rng.random() < self.canary.share \
                else "production"
            version = self.canary.candidate.version if arm == "candidate" and self.canary.candidate else self.served()
            tok_s, accept = self.speed[version]
            if arm == "production" and production_accept is not None:
                accept = production_accept
            tokens = 64
            self.records.append(LiveRecord(
                seq=len(self.records) + 1, t_ms=int(self.clock.t * 1000), version=version, arm=arm, route="low",
                api="/v1/chat/completions", concurrency=1, status=200, streamed=True, prompt_tokens=40,
                completion_tokens=tokens, e2e_s=tokens / (tok_s * self.rng.uniform(0.95, 1.05)), ttft_s=0.05,
                spec_verify_ct=max(1, round(tokens / (accept * self.rng.uniform(0.8, 1.2))))))

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, data: Any) -> None:
                body = json.dumps(data).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                url = urllib.parse.urlparse(self.path)
                endpoint.calls.append(f"GET {url.path}")
                if url.path == "/v1/config":
                    return self._send({"version": endpoint.served(), "origin": {"registered_model": NAME}})
                if url.path == "/v1/live":
                    after = int(urllib.parse.parse_qs(url.query)["after"][0])
                    rows = [r for r in endpoint.records if r.seq > after]
                    feed = LiveFeed(records=tuple(rows), next=rows[-1].seq if rows else after, capacity=100_000)
                    return self._send(feed.model_dump(mode="json"))
                if url.path == "/v1/canary":
                    return self._send(endpoint.canary.model_dump(mode="json"))
                self.send_error(404)

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                endpoint.calls.append(f"POST {self.path}")
                now = int(endpoint.clock.t * 1000)
                if self.path == "/v1/canary/start":
                    start = CanaryStart.model_validate(body)
                    endpoint.canary = CanaryStatus(state="running", candidate=start.candidate, share=start.share,
                                                   started_ms=now)
                elif self.path == "/v1/canary/share":
                    endpoint.canary = endpoint.canary.model_copy(update={"share": body["share"]})
                elif self.path == "/v1/drift":
                    endpoint.drift.append(body)
                    return self._send({})
                elif self.path == "/v1/canary/stop":
                    # what production served, and where its alias pointed, when the canary ended
                    endpoint.stops.append(f"{endpoint.served()}@{alias_version(endpoint.tracker, NAME, PRODUCTION)}")
                    endpoint.canary = CanaryStatus(state="off", reason=body["reason"])
                else:
                    return self.send_error(404)
                return self._send(endpoint.canary.model_dump(mode="json"))

        return Handler


def production_study(tracker: Tracker) -> None:
    """Version 1: an NGRAM config whose finalist re-runs measured 16 prompts x 3 runs at accept length ~2.5."""
    run_id = tracker.start_study("unit", "name: unit\n", resume=False)
    rng = random.Random(1)
    for k in range(3):
        records = [RequestRecord(request_id=f"measure-{i}", phase="measure", prompt_index=i, concurrency=1,
                                 start_s=float(i), ttft_s=0.05, e2e_s=64 / 20.0 * rng.uniform(0.9, 1.1),
                                 prompt_tokens=40, completion_tokens=64,
                                 spec_verify_ct=round(64 / (2.5 + (i % 4) * 0.1)),
                                 finish_reason="length") for i in range(16)]
        tracker.log_trial(run_id, study_name="unit", run_name=f"final-0-run{k}", kind="finalist", config={},
                          outcome=Outcome.COMPLETE, reason="", metrics={}, requests=to_table(records), texts={},
                          extra_tags={"finalist": "final-0", "concurrency": "1"})
    register_config(tracker, run_id, NAME, serving(NGRAM, "final-0"), move_production=True)


def serving(spec: dict, source: str) -> ServingConfig:
    return ServingConfig(replica=ReplicaConfig(model="smollm2-135m", spec=spec),
                         provenance=Provenance(study="unit", decision="promote", source=source, workload="templated",
                                               workload_digest="0" * 16, medians={"tput_tok_s": 20.0}))


@pytest.fixture(scope="module")
def registry(tmp_path_factory: Any) -> Path:
    """A store holding version 1 and its study, made once; each test gets a copy of the database (the artifacts
    folder is shared: every version's files are named by their own model id)."""
    folder = tmp_path_factory.mktemp("registry")
    production_study(Tracker(f"sqlite:///{folder / 'mlflow.db'}", "unit", artifact_dir=folder / "artifacts"))
    return folder


@pytest.fixture()
def world(tmp_path: Path, registry: Path):
    shutil.copy(registry / "mlflow.db", tmp_path / "mlflow.db")
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "unit", artifact_dir=registry / "artifacts")
    clock = Clock()
    endpoint = ContractEndpoint(tracker, clock)
    yield tracker, clock, endpoint, tmp_path
    endpoint.server.shutdown()
    endpoint.server.server_close()


def make_loop(world: Any, spec: dict, tok_s: float) -> Loop:
    tracker, clock, endpoint, tmp_path = world

    def retune(out: Path, resume: bool) -> RetuneResult:
        version = register_config(tracker, tracker.start_study("retune", "name: retune\n", resume=False), NAME,
                                  serving(spec, "final-1"), move_production=False, alias=CANDIDATE)
        endpoint.speed[str(version)] = (tok_s, 2.5)
        return RetuneResult(registered_model=NAME, production_version="1", candidate_version=version,
                            same_as_production=spec == NGRAM, study="retune", output=str(out),
                            split=SplitReport(since_ms=0, rows=40, older=0, untimed=0, prompts=40, measure=16,
                                              warmup=8, corpus=16, corpus_dropped=0), seeded={}, mismatches=())

    settings = LoopSettings(registered_model=NAME, state_dir=str(tmp_path / "loop"), every_s=None, min_gap_s=0,
                            canary=CanarySettings(start_share=0.2, steps=(0.5,), min_requests_per_step=40, blocks=4))
    loop = Loop(settings, EndpointClient(endpoint.url), tracker, retune, clock)
    loop.log = lambda text: None
    return loop


def run_until_idle(loop: Loop, endpoint: ContractEndpoint, state: Any, limit: int = 60) -> Any:
    for _ in range(limit):
        state = loop.tick(state)
        if state.phase == "idle":
            return state
        endpoint.traffic(40)
    raise AssertionError(f"the loop did not finish its cycle in {limit} ticks: {state}")


def cycle_run(tracker: Tracker) -> Any:
    client = tracker.client()
    experiment = client.get_experiment_by_name(f"{NAME}-loop")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    return runs[0]


def test_drift_starts_a_cycle_and_a_faster_candidate_is_promoted(world):
    tracker, clock, endpoint, _ = world
    loop = make_loop(world, {**NGRAM, "num_draft_tokens": 3}, tok_s=26.0)
    state = load_state(loop.folder)
    endpoint.traffic(200)  # as measured: no drift
    state = loop.tick(state)
    assert state.phase == "idle" and state.detectors and not any(d.alarm_at for d in state.detectors.values())
    endpoint.traffic(200, production_accept=1.3)  # the traffic changed: accept length fell by half
    state = loop.tick(state)
    assert state.phase == "retune" and state.trigger is not None
    assert state.trigger.startswith("DRIFT: accept length at concurrency 1")
    shown = endpoint.drift[-1]  # what the endpoint shows on /v1/config and /metrics
    assert shown["reference_version"] == "1" and any(line["alarm"] for line in shown["lines"])
    state = run_until_idle(loop, endpoint, state)
    assert state.outcome == "promoted" and state.production_version == state.reference_version == "2"
    assert {alias: alias_version(tracker, NAME, alias) for alias in (PRODUCTION, PREVIOUS, CANDIDATE)} == \
        {PRODUCTION: "2", PREVIOUS: "1", CANDIDATE: None}
    # the canary was stopped once, before the alias moved (issue 42 item 1: stopped after the roll, the stop reached
    # a new ingress replica that knew no canary, and the candidate's engine ran on)
    assert endpoint.stops == ["1@1"] and endpoint.calls.count("POST /v1/canary/share") == 1
    assert endpoint.canary.state == "off" and "promoted" in (endpoint.canary.reason or "")
    run = cycle_run(tracker)
    assert run.data.tags["outcome"] == "promoted" and run.data.tags["candidate_version"] == "2"
    assert run.data.tags["trigger"].startswith("DRIFT") and run.info.status == "FINISHED"
    artifacts = {a.path for a in tracker.client().list_artifacts(run.info.run_id)}
    assert {"drift.json", "shift.json", "retune.json", "outcome.txt", "canary"} <= artifacts
    assert run.data.tags["workload_shift"].startswith("workload as tuned: completion_tokens: median 64 -> 64")
    assert [m.step for m in tracker.client().get_metric_history(run.info.run_id, "canary_share")] == [0, 1]
    assert tracker.client().get_model_version(NAME, "2").tags["loop_outcome"] == "promoted"


def test_a_slower_candidate_is_rolled_back_and_production_stays(world):
    tracker, _, endpoint, _ = world
    loop = make_loop(world, {**NGRAM, "num_draft_tokens": 8}, tok_s=14.0)
    state = loop.start_cycle(load_state(loop.folder), "manual")
    state = run_until_idle(loop, endpoint, state)
    assert state.outcome == "rolled_back" and "clearly slower" in (state.reason or "")
    assert alias_version(tracker, NAME, PRODUCTION) == "1" and alias_version(tracker, NAME, CANDIDATE) is None
    assert all(call != "POST /v1/canary/share" for call in endpoint.calls)  # it never got past the first share
    assert endpoint.stops == ["1@1"]
    assert cycle_run(tracker).data.tags["outcome"] == "rolled_back"


def test_an_operators_abort_rolls_back_and_a_restarted_loop_carries_on(world):
    tracker, _, endpoint, _ = world
    loop = make_loop(world, {**NGRAM, "num_draft_tokens": 3}, tok_s=26.0)
    state = loop.start_cycle(load_state(loop.folder), "manual")
    state = loop.tick(loop.tick(state))  # re-tune, then the canary starts
    assert state.phase == "canary" and endpoint.canary.state == "running"
    endpoint.traffic(40)
    loop.tick(state)
    # the loop dies; the endpoint restarts too and forgets the canary
    endpoint.canary = CanaryStatus(state="off")
    again = make_loop(world, {**NGRAM, "num_draft_tokens": 3}, tok_s=26.0)
    state = load_state(again.folder)
    assert state.phase == "canary" and state.candidate_version == "2"
    state = again.tick(state)
    assert endpoint.canary.state == "running" and endpoint.canary.candidate.version == "2"
    send_command(again.folder, "abort", "aborted by operator")
    state = run_until_idle(again, endpoint, state)
    assert (state.outcome, state.reason) == ("rolled_back", "aborted by operator")
    assert alias_version(tracker, NAME, PRODUCTION) == "1" and endpoint.canary.state == "off"


def test_a_retune_that_confirms_production_makes_its_figures_the_reference(world):
    tracker, _, endpoint, _ = world
    loop = make_loop(world, NGRAM, tok_s=20.0)
    state = run_until_idle(loop, endpoint, loop.start_cycle(load_state(loop.folder), "manual"))
    assert state.outcome == "confirmed" and state.reference_version == "2" and state.production_version == "1"
    assert alias_version(tracker, NAME, PRODUCTION) == "1" and alias_version(tracker, NAME, CANDIDATE) is None
    assert "POST /v1/canary/start" not in endpoint.calls
