"""The closed loop end to end, as a user runs it (issue #30): `python -m pipeline.tune` tunes config A on workload X
(the templated workload's edit requests without their file bodies, ~40 tokens; 8-token answers: NGRAM promoted),
`python -m serve.production` serves it with capture on, a bounded local load loop switches the traffic to workload
Y (contexts four times as long, 2-token answers: the kind of shift a classification or routing client brings; each
request's end-to-end throughput falls to a sixth of X's, since its prefill dominates), and `python -m
pipeline.loop` flags the drift (per-request throughput below the study's), re-tunes on the capture, canaries the
re-tune's config on live traffic and promotes it, with no failed request. The cycle is checked in MLflow and on
`/v1/config`. A rollback, the other outcome of a canary, is checked on its own (tests/end_to_end/test_loop_retune.py,
tests/unit/test_loop_cycle.py, tests/end_to_end/test_production_loop.py): a second cycle here only repeated it at
the price of another re-tune.

Both promotions need a throughput comparison to fall one way, and the rules can only force the other (a failed or
non-equivalent run keeps the baseline, a failing candidate rolls back), so each is forced by a CPU-engine test switch
(serve/engines/cpu/faults.py) that slows the side that must lose 6x, against the 2.4x that load moved two runs of one
config measured apart on a busy 2-core box (the 2x of 6x against 3x slowing was crossed once: the first study kept its
baseline beside another test's study). `slow-after=N` slows an engine from its (N+1)-th generation request on:
- the first study's baseline runs 6x slowed where it is measured: a baseline pass first answers 5 requests it does
  not measure, at full speed (1 warm-up and as many settle requests as it measures: `slow-after=5@baseline`); NGRAM
  is not slowed in the study (each of its engines answers 5 requests), so it is promoted at about 6x the baseline
  (unslowed, NGRAM on X is within a few % of the baseline here);
- production's NGRAM engine answers its first 8 requests at full speed (`slow-after=8@speculative`): the test waits
  for them before it starts the loop, whose drift test alarms on them, on Y's own drop, not the switch's; the engine
  is 6x slow from then on, the canary included;
- the re-tune re-measures nothing (`promotion.finalists: 0`), so it keeps its baseline, registered as the candidate
  with its study's engine flags: unslowed, about 6x production's slowed NGRAM per request in the canary, where
  both arms answer the same traffic in the same time blocks (a 2x margin once left a candidate's score, median -
  1.4826 MAD of 10 requests, under the bar on a loaded machine).
With the first study's outcome forced, its runs are not re-measured when they disagree (`spread_reruns: 0`): a re-run
only cost another slowed baseline engine.
Small on purpose: 2 trials in the first study, 1 in the re-tune (its baseline, the candidate: with finalists 0
nothing else it measured could be chosen, and production's config it seeds is re-tuned for real in
tests/end_to_end/test_loop_retune.py), 4 measured prompts of 8 tokens on ~40-token prompts (a slowed baseline's runs
cost most of the first study: slowed over its whole pass, 6x against 3x, its 4 runs took 90 of the study's 140 s),
Y's contexts ~190 tokens (production's answers in the canary are 6x-slowed prefills), canary of one step at share
0.75 deciding on 10 candidate requests in 3 blocks. The loop's accept-length detector runs too (the engine's
per-request counters reach the live records); Y's change shows in throughput.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from pipeline.errors import PipelineError
from pipeline.loop.state import load_state
from pipeline.records.registry import PRODUCTION, alias_version
from pipeline.records.tracking import Tracker
from pipeline.workloads import read_prompts
from serve.ports import free_port
from tests.integration.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]
NAME = "specdec-loop-e2e"
KEY, ADMIN = "user-key-0123456789abcdef", "admin-key-0123456789abcdef"
FAST = ["--verify-probe-seconds", "0"]  # no verify-cost probe at engine start: nothing here reads it
NGRAM = ("    num_draft_tokens: {type: fixed, value: 4}\n    max_bfs_breadth: {type: fixed, value: 2}\n"
         "    max_trie_depth: {type: fixed, value: 8}\n    capacity: {type: fixed, value: 100000}\n")
SPACE = ("algorithms: [none, ngram]\ncommon:\n  warmup_requests: {type: fixed, value: 1}\nbranches:\n  ngram:\n"
         + NGRAM)
MEASURE_PROMPTS = 4
# a baseline pass's unmeasured requests come first: 1 warm-up (space: warmup_requests) and as many settle requests as
# it measures (pipeline/trial/engine_pass.py settle_requests)
BASELINE_UNMEASURED = 1 + MEASURE_PROMPTS
PRODUCTION_FULL_SPEED = 8  # production's answers the test waits for before the loop starts: the drift judges them
# The canary's one step gives the candidate 3 requests of 4: each of production's 6x-slowed answers costs six of the
# candidate's, and at 0.5 they were most of the canary (20 of 30 requests once, 100 s). The step still waits until each
# of its blocks has a production answer; at concurrency 1 every request runs alone, so the share slows neither arm.
LOOP_SETTINGS = {"canary": {"start_share": 0.75, "steps": [], "min_requests_per_step": 10, "blocks": 3,
                            "lease_s": 300},
                 # the first study measures 4 prompts; with 4, a stationary stream false-alarms in ~2% (docs/loop.md),
                 # and the drop here is over half
                 "drift": {"window": 4, "min_prompts": 4}}
CAPTURE = {"sample_rate": 1, "flush_rows": 1}  # every answer, on disk at once
# Y's answers: with X's length (16 tokens then), live requests run alone at the end of a CI run were not slower per request
# than the study measured them beside another test's study: the machine's load moved the figure as much as the
# longer contexts did, and no drift showed. 2-token answers make Y's figure about a sixth of X's on any load.
Y_ANSWER_TOKENS = 2
DEADLINE_S = 900  # per stage; a healthy run takes 1-2 min a stage on a 2-core box


def study_file(folder: Path, uri: str, name: str, flags: list[str], finalists: int, source: str = "templated"
               ) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(json.dumps({
        "name": name, "search_space": str(folder / "space.yaml"), "seed": 0, "output_dir": str(folder / name),
        "workload": {"source": source, "warmup_prompts": 1, "measure_prompts": MEASURE_PROMPTS,
                     "max_new_tokens": 8, "remeasure": 0},
        "budget": {"max_trials": 2, "early_stopping": False}, "search": {"strategy": "tpe"},
        # no re-run of runs that disagree: the test switches decide by 6x (module docstring), far beyond a re-run's
        # MAD (beside another test's study one NGRAM run of three measured 3.31 tok/s against 4.83 and 5.99)
        "promotion": {"finalists": finalists, "spread_reruns": 0},
        "engine": {"threads": 1, "start_timeout_s": 300, "extra_flags": FAST + flags},
        "tracking": {"uri": uri, "registered_model": NAME}}))
    return path


def faults(*specs: str) -> list[str]:
    return [part for spec in specs for part in ("--test-fault", spec)]


def short_edits(folder: Path) -> Path:
    """Workload X: the templated workload's edit requests with their file bodies left out (~40 tokens: the
    instruction, the file's name, the change), as a JSONL file."""
    path = folder / "x.jsonl"
    rows = []
    for p in read_prompts("templated")[0]:
        text = p.text
        rows.append({"id": p.id, "prompt": text[:text.index("```")] + text[text.index("Change:"):]})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def long_contexts() -> list[str]:
    """Workload Y: 96 distinct prompts of ~190 tokens (12 of the free-text workload's topics in a row, rotated, and a
    question), about the templated workload's length. Alone on a 2-core box a request of Y took 0.55 s, 3.9 tok/s
    against X's 24 per request: a sixth, where load has moved a figure by 2.4x (up to 2.8x beside another study)."""
    topics = [p.text.strip() for p in read_prompts("free-text")[0]]
    return [" ".join(topics[(i + k) % len(topics)] for k in range(12)) + "\nWhich of these is the shortest? Answer:"
            for i in range(len(topics))]


class Traffic:
    """Workload Y against the endpoint, one request at a time (every other one streamed), until stopped or its
    deadline; counts the answers and keeps every failure. It holds while `watched` (a loop's state folder) says
    that loop re-tunes: the re-tune measures captured prompts on its own engines, and live requests meanwhile
    would only take the CPU from it (on 2 cores they doubled its time); drift watching, the canary and the roll
    all see traffic."""

    def __init__(self, base_url: str, deadline_s: float) -> None:
        self.prompts = long_contexts()
        self.api = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=120)
        self.deadline = time.monotonic() + deadline_s
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.answered = 0
        self.watched: Path | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _retuning(self) -> bool:
        try:
            return self.watched is not None and load_state(self.watched).phase == "retune"
        except PipelineError:  # written by the loop right now (atomically): read it at the next turn
            return False

    def _run(self) -> None:
        i = 0
        while not self.stop.is_set() and time.monotonic() < self.deadline:
            if self._retuning():
                self.stop.wait(1.0)  # wakes at once on close
                continue
            prompt = self.prompts[i % len(self.prompts)]
            try:
                if i % 2:
                    stream = self.api.completions.create(model="smollm2-135m", prompt=prompt,
                                                         max_tokens=Y_ANSWER_TOKENS, temperature=0,
                                                         extra_body={"ignore_eos": True}, stream=True)
                    tokens = "".join(c.choices[0].text for c in stream if c.choices)
                else:
                    tokens = self.api.completions.create(model="smollm2-135m", prompt=prompt,
                                                         max_tokens=Y_ANSWER_TOKENS, temperature=0,
                                                         extra_body={"ignore_eos": True}).choices[0].text
                if not tokens:
                    self.failures.append(f"request {i}: empty answer")
                self.answered += 1
            except Exception as exc:  # noqa: BLE001 - every failure is what the test reports
                self.failures.append(f"request {i}: {type(exc).__name__}: {exc}")
            i += 1

    def wait_for(self, answered: int) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while self.answered < answered and time.monotonic() < deadline and self.thread.is_alive():
            time.sleep(0.5)  # polling a counter under a deadline
        assert self.answered >= answered, (self.answered, self.failures[-3:])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=180)


def wait_until(what: str, check, log: Path | None = None, deadline_s: float = DEADLINE_S):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(1.0)  # polling a condition under a deadline
    tail = log.read_text(errors="replace")[-6000:] if log is not None and log.exists() else ""
    raise AssertionError(f"timed out waiting for {what}\n{tail}")


def spawn(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def stop(process: subprocess.Popen, timeout_s: float = 180) -> None:
    """SIGTERM to the driver alone, as `kill PID` or a service manager's main-process stop sends it; what is left of
    its group is killed after. A SIGTERM to the whole group also stops the local Ray's own processes at once, and the
    driver then waits out Ray's 60 s GCS reconnect before it exits (tests/end_to_end/test_production_driver.py
    signals the group)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone: nothing was left
        pass
    process.wait(timeout=60)


def test_drift_retune_canary_promote(tmp_path: Path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "space.yaml").write_text(SPACE)
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPECDEC_ADMIN_KEY": ADMIN}
    (tmp_path / "keys.txt").write_text(KEY + "\n")
    (tmp_path / "admin.txt").write_text(ADMIN + "\n")
    (tmp_path / "loop.yaml").write_text(json.dumps(LOOP_SETTINGS))

    # 1. Config A tuned on workload X, registered as production.
    first = subprocess.run([sys.executable, "-m", "pipeline.tune", "--study",
                            str(study_file(tmp_path, uri, "tuned-on-x",
                                           faults(f"slow-after={BASELINE_UNMEASURED}@baseline",
                                                  f"slow-after={PRODUCTION_FULL_SPEED}@speculative"), 1,
                                           source=str(short_edits(tmp_path))))],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=DEADLINE_S)
    assert first.returncode == 0 and "decision: PROMOTE" in first.stdout, first.stdout[-4000:] + first.stderr[-3000:]
    (tmp_path / "tuned-on-x.log").write_text(first.stdout)
    tracker = Tracker(uri, "loop-e2e-test")
    assert alias_version(tracker, NAME, PRODUCTION) == "1"

    # 2. The endpoint serves it, capturing its traffic, following the alias.
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    endpoint_log = tmp_path / "endpoint.log"
    endpoint = spawn(["-m", "serve.production", "--registered-model", NAME, "--tracking-uri", uri, "--port",
                      str(port), "--api-key-file", str(tmp_path / "keys.txt"), "--admin-key-file",
                      str(tmp_path / "admin.txt"), "--capture",
                      json.dumps(CAPTURE | {"dir": str(tmp_path / "capture")}), "--follow-alias-s", "2"],
                     endpoint_log, env)
    traffic = loop = None
    admin = {"Authorization": f"Bearer {ADMIN}"}

    def config() -> dict:
        return httpx.get(f"{base_url}/v1/config", headers=admin, timeout=60).json()

    def serving(version: str) -> bool:
        try:
            answer = httpx.get(f"{base_url}/v1/config", headers=admin, timeout=60)
        except httpx.HTTPError:  # not listening yet
            return False
        return answer.status_code == 200 and answer.json().get("version") == version  # 404: Serve up, app not yet

    try:
        wait_until("the endpoint to serve version 1", lambda: serving("1"), endpoint_log)

        # 3. Traffic switches to workload Y.
        traffic = Traffic(base_url, deadline_s=3 * DEADLINE_S)
        # The re-tune needs 6 captured prompts (4 measured, 2 warm-up). Y's drop is so large that the drift test can
        # alarm after 4 requests; started on an endpoint with less capture, the cycle ends `retune_failed` (seen in
        # CI: "4 distinct prompts since the last promotion"), which is the loop's right answer but not this test's.
        traffic.wait_for(PRODUCTION_FULL_SPEED)

        # 4. The loop: drift -> re-tune on the capture -> canary -> promote.
        state_a = tmp_path / "loop-a"
        traffic.watched = state_a
        loop_log = tmp_path / "loop-a.log"
        loop = spawn(["-m", "pipeline.loop", "--endpoint", base_url, "--tracking-uri", uri, "--every", "off",
                      "--min-gap", "0", "--poll", "1s", "--state-dir", str(state_a), "--settings",
                      str(tmp_path / "loop.yaml"), "--study", str(study_file(tmp_path, uri, "retune-a", [], 0)),
                      "--trials", "1", "--measure-prompts", str(MEASURE_PROMPTS), "--warmup-prompts", "2"], loop_log,
                     env)
        done = wait_until("the first cycle's outcome", lambda: (s := load_state(state_a)).outcome and s, loop_log)
        stop(loop)
        loop = None
        log_a = loop_log.read_text(errors="replace")
        assert done.outcome == "promoted", log_a[-6000:]
        assert "per-request tok/s" in (done.trigger or ""), done.trigger  # drift started it, not a schedule
        assert alias_version(tracker, NAME, PRODUCTION) == done.production_version == "2"
        shown = config()
        assert shown["version"] == "2" and shown["replica"]["spec"]["algorithm"] == "none"
        assert traffic.failures == [], traffic.failures[:5]  # nothing failed through drift, canary and roll

    finally:
        if loop is not None:
            stop(loop)
        if traffic is not None:
            traffic.close()
        stop(endpoint)

    # 5. The cycle in MLflow, linking its re-tune study and its outcome.
    cycles = Tracker(uri, f"{NAME}-loop")
    runs = cycles.client().search_runs([cycles.experiment_id()])
    assert [r.data.tags.get("outcome") for r in runs] == ["promoted"], [r.data.tags for r in runs]
    assert all(r.data.tags.get("retune_study") for r in runs)
