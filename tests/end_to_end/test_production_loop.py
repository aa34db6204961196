"""The production endpoint's side of the closed loop (issue #30), on the CPU engine through Ray Serve: streamed
answers measured to their [DONE] with the engine's usage, the live feed as the loop reads it, drift reports, the
capture's parts for admin keys only, and a canary on the candidate's own engine."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from pipeline.loop.client import EndpointClient, EndpointError
from serve.closed_loop.control import CandidateRef, CanaryStart, DriftLine, DriftReport
from serve.closed_loop.live import LiveSummary
from tests.integration.production_endpoint import ADMIN, AUTH, KEY, MODEL, capture_rows, client, endpoint  # noqa: F401 (endpoint: a fixture)
from tests.integration.production_helpers import openai_error, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]
LIVE = {"version": "1", "arm": "production", "route": "low", "bucket": "1"}  # one request at a time, version 1
_LIVE_SAMPLES = {"tokens": ("specdec_completion_tokens_total", LIVE), "prompt": ("specdec_prompt_tokens_total", LIVE),
                 "e2e": ("specdec_e2e_seconds_sum", LIVE), "ttft": ("specdec_ttft_seconds_count", LIVE),
                 "itl": ("specdec_itl_seconds_count", LIVE), "tput": ("specdec_output_tokens_per_second_count", LIVE),
                 "ok": ("specdec_generation_requests_total", {**LIVE, "status": "200"}),
                 "latency": ("specdec_request_latency_seconds_sum", {"route": "/v1/completions"}),
                 "chat_latency": ("specdec_request_latency_seconds_sum", {"route": "/v1/chat/completions"})}


def _sample(text: str, name: str, labels: dict[str, str]) -> float:
    """One sample of a /metrics text with exactly these labels, in whatever order they are printed (0 if absent)."""
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != name or "{" not in head:
            continue
        pairs = dict(p.split("=", 1) for p in head[len(name) + 1:-1].split(","))
        if pairs == {k: f'"{v}"' for k, v in labels.items()}:
            total += float(value)
    return total


def _samples(base_url: str, wanted: dict | None = None) -> dict[str, float]:
    """The samples of `wanted` (default _LIVE_SAMPLES) from one /metrics answer."""
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).text
    return {key: _sample(text, name, labels) for key, (name, labels) in (wanted or _LIVE_SAMPLES).items()}


def test_streamed_answers_are_measured_to_their_done_with_the_engines_usage(endpoint):
    """Streams counted no completion tokens and their latency stopped at the first byte (issue 30)."""
    base_url, _, _ = endpoint
    api = client(base_url)
    before = _samples(base_url)
    plain = list(api.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=8, temperature=0,
                                        stream=True, extra_body={"ignore_eos": True}))
    chat = list(api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to five."}],
                                            max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    after = _samples(base_url)
    delta = {key: after[key] - before[key] for key in after}
    # the client that did not ask for usage gets no usage chunk; the one that asked gets it
    assert all(c.choices and c.usage is None for c in plain)
    usage = chat[-1].usage
    assert chat[-1].choices == [] and usage is not None and usage.completion_tokens == 4
    assert delta["tokens"] == 8 + 4 and delta["prompt"] > usage.prompt_tokens
    assert delta["ok"] == delta["ttft"] == delta["tput"] == 2
    texts = sum(1 for c in plain if c.choices[0].text) + sum(1 for c in chat if c.choices and c.choices[0].delta.content)
    assert delta["itl"] == texts - 2  # the gaps after each stream's first text chunk
    # each stream's latency ends once its [DONE] has passed the ingress, not at its first byte
    assert delta["latency"] + delta["chat_latency"] >= delta["e2e"] > 0


def test_the_live_feed_holds_each_answered_request_as_the_loop_reads_it(endpoint):
    base_url, _, _ = endpoint
    loop = EndpointClient(base_url, ADMIN)  # the closed loop's own client: it validates every answer's shape
    after = loop.live(0, limit=10_000).next
    api = client(base_url)
    streamed = list(api.completions.create(model=MODEL, prompt="Count: 4, 5,", max_tokens=8, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}))
    plain = api.completions.create(model=MODEL, prompt="Count: 4, 5,", max_tokens=4, temperature=0)
    feed = loop.live(after)
    assert feed.dropped == 0 and feed.next == feed.records[-1].seq
    first, second = feed.records  # nothing else was answered meanwhile
    assert (first.version, first.arm, first.route, first.api, first.concurrency) == \
        ("1", "production", "low", "/v1/completions", 1)
    assert first.streamed and first.status == 200 and first.completion_tokens == 8 and first.prompt_tokens > 0
    assert len(first.itl_s) == sum(1 for c in streamed if c.choices and c.choices[0].text) - 1
    assert first.ttft_s is not None and first.e2e_s >= first.ttft_s + sum(first.itl_s) - 1e-9
    assert not second.streamed and second.itl_s == () and second.seq == first.seq + 1
    assert plain.usage is not None
    assert (second.completion_tokens, second.prompt_tokens) == (plain.usage.completion_tokens,
                                                                plain.usage.prompt_tokens)
    summary = LiveSummary.model_validate(httpx.get(f"{base_url}/v1/live/summary", headers=AUTH, timeout=60).json())
    group = next(f for f in summary.figures if (f.version, f.arm, f.route, f.bucket) == ("1", "production", "low", "1"))
    assert group.requests >= 2 and group.tput_tok_s_p50 is not None and group.itl_p50_ms is not None
    bad = httpx.get(f"{base_url}/v1/live", params={"after": "-1"}, headers=AUTH, timeout=60)
    assert bad.status_code == 400 and "after" in openai_error(bad)["message"]


def _drift(statistic: float, metric_name: str) -> DriftReport:
    line = DriftLine(metric=metric_name, bucket=4, alarm=statistic >= 8.0, statistic=statistic, threshold=8.0,
                     requests=64, live_mean=1.2, reference_mean=2.0, text=f"{metric_name} at 4: CUSUM {statistic}")
    return DriftReport(at_ms=int(time.time() * 1000), reference_version="1", lines=(line,), shift="no shift")


def test_drift_reports_show_on_config_and_metrics_and_take_an_admin_key(endpoint):
    base_url, _, _ = endpoint
    loop = EndpointClient(base_url, ADMIN)
    refused = httpx.post(f"{base_url}/v1/drift", headers=AUTH, timeout=60, content=_drift(1, "tput").model_dump_json())
    assert refused.status_code == 403 and "admin key" in openai_error(refused)["message"]
    loop.post_drift(_drift(9.5, "accept_length"))
    loop.post_drift(report := _drift(2.5, "tput"))  # the latest replaces the last whole
    assert loop.config()["drift"] == report.model_dump(mode="json")
    shown = _samples(base_url, {"tput": ("specdec_drift_statistic", {"metric": "tput", "bucket": "4"}),
                                "alarm": ("specdec_drift_alarm", {"metric": "tput", "bucket": "4"}),
                                "old": ("specdec_drift_alarm", {"metric": "accept_length", "bucket": "4"})})
    assert shown == {"tput": 2.5, "alarm": 0.0, "old": 0.0}  # the earlier report's alarm line is gone
    bad = httpx.post(f"{base_url}/v1/drift", headers={**AUTH, "Authorization": f"Bearer {ADMIN}"}, timeout=60,
                     json={"at_ms": 1, "reference_version": "1", "lines": [{"metric": "tput"}]})
    assert bad.status_code == 422 and "lines.0.bucket" in openai_error(bad)["message"]


def test_capture_parts_are_served_to_admin_keys_only_and_by_part_name(endpoint):
    base_url, settings, _ = endpoint
    folder = Path(settings.capture.dir)
    client(base_url).completions.create(model=MODEL, prompt="Ship me:", max_tokens=2, temperature=0)
    capture_rows(folder, 1)
    for path in ("/v1/capture", "/v1/capture/part-x-1.parquet"):
        assert httpx.get(base_url + path, headers=AUTH, timeout=60).status_code == 403  # a user key
        assert httpx.get(base_url + path, timeout=60).status_code == 401
    with pytest.raises(EndpointError, match="403"):
        EndpointClient(base_url, KEY).capture_listing()
    loop = EndpointClient(base_url, ADMIN)
    listing = loop.capture_listing()
    on_disk = sorted(p.name for p in folder.glob("part-*.parquet"))
    assert [p.name for p in listing.parts] == on_disk and listing.max_rows == settings.capture.max_rows
    first = listing.parts[0]
    assert loop.capture_part(first.name) == (folder / first.name).read_bytes() and first.bytes > 0
    admin = {"Authorization": f"Bearer {ADMIN}"}
    (folder.parent / "secret.parquet").write_bytes(b"not for you")
    for name, status in (("..%2Fsecret.parquet", (400, 404)), ("part-..-1.parquet", (400,)),
                         (".part-a-1.parquet.1.tmp", (400,)), ("part-nothere-1.parquet", (404,))):
        response = httpx.get(f"{base_url}/v1/capture/{name}", headers=admin, timeout=60)
        assert response.status_code in status and b"not for you" not in response.content, (name, response.text)


def test_a_canary_serves_its_share_on_the_candidates_own_engine_and_stops(endpoint):
    from ray import serve

    base_url, settings, _ = endpoint
    loop = EndpointClient(base_url, ADMIN)
    start = CanaryStart(candidate=CandidateRef(registered_model="specdec-prod", version="2"), share=1.0)
    refused = httpx.post(f"{base_url}/v1/canary/start", headers=AUTH, content=start.model_dump_json(), timeout=60)
    assert refused.status_code == 403
    assert loop.canary_start(start).state == "starting"
    with pytest.raises(EndpointError, match="409"):
        loop.canary_start(start)
    status = wait_for(lambda: (s := loop.canary()).state != "starting" and s, "the candidate's engine started", 420)
    assert status.state == "running", status.reason
    after = loop.live(0, limit=10_000).next
    api = client(base_url)
    answer = api.completions.create(model=MODEL, prompt="x = 1\ny = 2\nx = 1\ny = 2\n", max_tokens=8,
                                    temperature=0, extra_body={"ignore_eos": True})
    record = loop.live(after).records[-1]
    assert (record.arm, record.version, record.status) == ("candidate", "2", 200)  # share 1: every request
    # the candidate (NGRAM) reported its verify steps to the ingress, which kept them from this client
    assert record.completion_tokens == 8 and 0 < (record.spec_verify_ct or 0) <= 8
    assert record.spec_verify_ct is not None
    assert record.accept_length == 8 / record.spec_verify_ct and "sglext" not in (answer.model_extra or {})
    shown = loop.config()
    assert shown["version"] == "1" and shown["canary"]["requests"]["candidate"] == 1
    assert loop.canary_share(0.5).share == 0.5
    assert loop.canary_stop("test over").state == "stopping"
    wait_for(lambda: loop.canary().state == "off", "the canary stopped", 120)
    api.completions.create(model=MODEL, prompt="x = 1\n", max_tokens=2, temperature=0)
    assert loop.live(record.seq).records[-1].arm == "production"
    assert f"{settings.app_name}-canary" not in serve.status().applications
    assert loop.canary().reason == "test over"


def test_a_nan_drift_post_is_refused_and_config_keeps_answering(endpoint):
    # issue 42 item 3: "NaN" as a string was stored; /v1/drift and every later /v1/config answered 500
    base_url, _, _ = endpoint
    admin = {"Authorization": f"Bearer {ADMIN}"}
    line = _drift(1.0, "tput").model_dump(mode="json")
    for bad in ("NaN", "Infinity", "1e999"):
        body = {**line, "lines": [{**line["lines"][0], "statistic": bad}]}
        refused = httpx.post(f"{base_url}/v1/drift", headers=admin, json=body, timeout=60)
        assert refused.status_code == 422 and "lines.0.statistic" in openai_error(refused)["message"]
        for key in (ADMIN, KEY):
            shown = httpx.get(f"{base_url}/v1/config", headers={"Authorization": f"Bearer {key}"}, timeout=60)
            assert shown.status_code == 200 and shown.json()["version"] == "1"


def _candidate_processes() -> list:
    from tests.integration.production_helpers import alive, app_processes

    found = app_processes("production-canary")
    return alive(found["engine"] + found["watchdog"] + found["backend"])


def test_a_killed_candidate_costs_users_no_errors(endpoint):
    """Issue 42 item 8: with the candidate's engine killed at share 0.5, 21 of 107 user requests got 503 for ~10 s
    and the canary still said `running`. Here the candidate holds its requests (`hang-after=0`), so both are in
    flight on it, one streamed, when its engine is SIGKILLed: production answers both in full, and the canary ends
    `failed` with the reason."""
    from concurrent.futures import ThreadPoolExecutor

    from pipeline.records.registry import CANDIDATE, register_config
    from tests.integration.production_endpoint import NGRAM, serving
    from tests.integration.production_helpers import alive, app_processes

    base_url, _, tracker = endpoint
    holding = serving(NGRAM, "promote").model_copy(update={"replica": serving(NGRAM, "promote").replica.model_copy(
        update={"extra_flags": ["--test-fault", "hang-after=0"]})})
    run = tracker.client().create_run(tracker.experiment_id(), run_name="holding-candidate")
    version = register_config(tracker, run.info.run_id, "specdec-prod", holding, move_production=False,
                              alias=CANDIDATE)
    loop = EndpointClient(base_url, ADMIN)
    loop.canary_start(CanaryStart(candidate=CandidateRef(registered_model="specdec-prod", version=version),
                                  share=1.0))
    status = wait_for(lambda: (s := loop.canary()).state != "starting" and s, "the candidate's engine started", 420)
    assert status.state == "running", status.reason
    after = loop.live(0, limit=10_000).next
    api = client(base_url)
    prompt = "x = 1\ny = 2\nx = 1\ny = 2\n"

    def plain() -> str:
        return api.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text

    def streamed() -> str:
        return "".join(c.choices[0].text for c in api.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True})
            if c.choices)

    with ThreadPoolExecutor(2) as pool:
        answers = [pool.submit(plain), pool.submit(streamed)]
        wait_for(lambda: loop.canary().requests.get("candidate") == 2, "both requests sent to the candidate", 60)
        engines = alive(app_processes("production-canary")["engine"])
        assert len(engines) == 1
        engines[0].kill()
        texts = [answer.result(timeout=300) for answer in answers]  # an error here is what users saw before
    assert texts[0] == texts[1] == plain() and len(texts[0]) > 0
    ended = wait_for(lambda: (s := loop.canary()).state == "failed" and s, "the canary failed", 120)
    assert "the candidate's engine failed" in (ended.reason or "")
    records = loop.live(after).records
    assert sorted((r.arm, r.status) for r in records if r.arm == "candidate") == [("candidate", 503)] * 2
    assert [r.status for r in records if r.arm == "production"] == [200, 200, 200]
    try:
        wait_for(lambda: not _candidate_processes(), "the failed candidate's processes gone", 120)
    except AssertionError as exc:  # say what is left and what Serve thinks of the app, for whoever reads CI's log
        from ray import serve

        left = [(p.pid, p.status(), " ".join(p.cmdline())[:160]) for p in _candidate_processes()]
        raise AssertionError(f"{exc}: left {left}; canary {loop.canary()}; "
                             f"apps {serve.status().applications.get('production-canary')}") from None


def test_a_loop_promotion_leaves_no_canary_behind(endpoint):
    """Issue 42 item 1: the loop stopped the canary once the endpoint served the candidate; the roll had replaced
    the ingress replica that owned the canary, so the stop reached one that knew none and the candidate's engine
    ran on (2 min 44 s and counting, on a GPU node a GPU held indefinitely). The loop's own promotion runs here on
    the real endpoint, and the roll is what `python -m serve.production` does when the alias moves. Last in this
    file: the endpoint serves version 2 afterwards."""
    from ray import serve

    from pipeline.loop.cycle import Loop, LoopSettings
    from pipeline.loop.state import LoopState
    from pipeline.records.registry import PRODUCTION, alias_version
    from serve.production.app import deploy

    base_url, settings, tracker = endpoint
    client_ = EndpointClient(base_url, ADMIN)
    client_.canary_start(CanaryStart(candidate=CandidateRef(registered_model="specdec-prod", version="2"),
                                     share=0.5))
    wait_for(lambda: client_.canary().state == "running", "the candidate's engine started", 420)
    assert _candidate_processes()
    loop = Loop(LoopSettings(registered_model="specdec-prod", state_dir=str(Path(settings.capture.dir).parent /
                                                                                "loop")), client_, tracker,
                lambda out, resume: None)
    run_id = loop.recorder.start(1, "test", "1", "[]")
    state = LoopState(phase="promote", cycle=1, cycle_run_id=run_id, candidate_version="2", production_version="1",
                      reason="promoted by the test")
    rolled, deadline = False, time.monotonic() + 900
    while state.phase != "idle" and time.monotonic() < deadline:
        state = loop.tick(state)
        if alias_version(tracker, "specdec-prod", PRODUCTION) == "2" and not rolled:
            assert client_.canary().state in ("off", "failed")  # the canary ended before the alias moved
            deploy(settings)  # what the endpoint's alias follower does when the alias moves
            rolled = True
        time.sleep(0.5)  # the loop's poll, under the deadline above
    assert (state.phase, state.outcome) == ("idle", "promoted") and client_.served_version() == "2"
    assert f"{settings.app_name}-canary" not in serve.status().applications
    wait_for(lambda: not _candidate_processes(), "the candidate's engine gone", 60)
