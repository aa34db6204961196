"""One deploy-and-measure pass of a config: start the engine -> read back -> flush -> warm up -> measure.

`measure_config` runs it in steps; a step that ends the pass raises `TrialFailure` (the outcome it means and why),
turned into `Measurement.failure` in one place, so nothing here raises for a bad config or a dead engine. The engine
runs behind a Ray Serve app named `<study>~trial-<label>` (route the same), which the process keeps for its next
pass: that pass restarts only the engine in it (pipeline/trial/replicas.py); after any engine or replica failure the
app is deleted and the next pass deploys a fresh one. Trials (`pipeline.trial.lifecycle`), their equivalence passes
(`pipeline.trial.gate`) and finalist re-runs all measure through it, and get one `Measurement`, summarized here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pipeline.config import StudyConfig, TrialConfig
from pipeline.measure.load import LoadRequest, run_phase
from pipeline.measure.measurement import Measurement
from pipeline.measure.server_info import PlainSteps, ServerInfo
from pipeline.measure.shape import measure_shape
from pipeline.measure.summary import RequestRecord, summarize
from pipeline.measure.window import judge_window, step_ratio
from pipeline.records.console import note_phase
from pipeline.records.labels import config_label
from pipeline.simulate.cost import plain_step
from pipeline.trial.pruning import Watch, measure_phase
from pipeline.trial.corpus import CorpusFile, corpus_for_trial, corpus_record, listed_corpora, ship_corpus
from pipeline.trial.replica_config import replica_config
from pipeline.trial.replicas import cluster_cannot_host, live_app, release, start_engine
from pipeline.trial.context import TrialContext
from pipeline.vocabulary.outcome import Ending, Outcome, TrialFailure
from serve.engines.base import ConfigRejected, Engine, ReplicaConfig
from serve.engines.spec_flags import effective_diff
from serve.engines.load_failures import repeating_cause, with_cause
from serve.engines.waits import trial_wait_s
from serve.replica.placement import START_TIMEOUT_MARKER, log_tail
from serve.replica.sharing import launch_config
from serve.replica.usage import Usage

__all__ = ["FLUSH_DEADLINE_S", "FLUSH_WAIT_S", "Launch", "flush", "launch_of", "lost_requests", "measure_config",
           "settle_requests", "shipped_replica_config", "start_failure", "usage"]

FLUSH_WAIT_S = 5.0  # what a flush asks the engine to wait for idle
FLUSH_DEADLINE_S = 120.0


def shipped_replica_config(study: StudyConfig, trial: TrialConfig, warmup: Sequence[LoadRequest],
                           log_dir: Path) -> tuple[ReplicaConfig, CorpusFile | None]:
    """`replica_config` with the trial's corpus resolved (`corpus_for_trial`: the `warmup` choice written from the
    warm-up split, a user file read) and its documents shipped in the config, so a replica on any node can load it.
    Trials and promotion both use it. ValueError for a corpus that cannot be used."""
    trial, corpus = corpus_for_trial(trial, warmup, log_dir, target=study.model.target)
    return ship_corpus(replica_config(study, trial, log_dir), corpus), corpus


def flush(client: httpx.Client, deadline_s: float = FLUSH_DEADLINE_S) -> str | None:
    """`/flush_cache` until it succeeds; the last refusal after `deadline_s`, else None.

    SGLang refuses a flush (400) while any request is queued or running (a trial's own last request may still be
    finishing), so one refusal is expected: ask it to wait for idle (`?timeout=`), then retry. Serve's health checks
    do not generate (`serve.engines.sglang.engine.HEALTH_ENV`)."""
    deadline, answer = time.monotonic() + deadline_s, ""
    while True:
        response = client.post("/flush_cache", params={"timeout": FLUSH_WAIT_S}, timeout=FLUSH_WAIT_S + 30)
        if response.status_code == 200:
            return None
        answer = f"{response.status_code}: {response.text[:300]}"
        if time.monotonic() >= deadline:
            return f"/flush_cache was refused for {deadline_s:.0f} s (last answer {answer})"
        time.sleep(0.5)


def _engine_log(url: str | None, log_dir: Path) -> str:
    try:
        response = httpx.get(f"{url}/replica/log", timeout=10) if url else None
        if response is not None and response.status_code == 200:
            return response.text
    except httpx.HTTPError:
        pass
    return "\n".join(log_tail(p, 200_000) for p in sorted(log_dir.glob("engine-*.log")))


def measure_config(ctx: TrialContext, trial: TrialConfig, label: str, log_dir: Path,
                   watch: Watch | None = None) -> Measurement:
    """Start `trial`'s engine (a restart in this process's live replica, else a fresh app), read back, flush, warm
    up, measure; the app stays for the next trial unless anything failed. Never raises for engine trouble: each step
    raises `TrialFailure`, recorded as `Measurement.failure`.
    With a `watch` (a search trial with early stopping on) the measurement runs in chunks of `concurrency` requests
    and stops as PRUNED when the watch's rule says so.

    The engine kind's node checks and preflight run inside the replica (on the node that runs the engine); a config
    the engine refuses there comes back as INVALID with the engine's words, a node that cannot run it as
    LAUNCH_FAILED. A measurement window that other work disturbed (`pipeline.measure.window`) is measured again,
    after a flush and the same warm-up, at most `workload.remeasure` times; every window is kept in `windows`. The
    records' summary is computed here, where they were measured (under open loop with the offered rate)."""
    out = Measurement()
    started = time.monotonic()
    clean = False  # measured without an engine or replica failure: the app may serve the next trial
    try:
        try:  # a corpus travels in the replica's config: the engine may run on a node without the driver's files
            config, corpus = shipped_replica_config(ctx.study, trial, ctx.warmup, log_dir)
        except ValueError as exc:
            raise TrialFailure(Outcome.INVALID, str(exc)) from None
        problem = cluster_cannot_host(config, ctx.engine)
        if problem:
            raise TrialFailure(Outcome.LAUNCH_FAILED, problem)
        note_phase(log_dir, "engine", config=config_label(trial))
        try:  # `trial_wait_s`: a cold node's allowance too
            live, out.replica = start_engine(ctx.study.name, label, ctx.serve_url, config,
                                             trial_wait_s(config, ctx.engine), ctx.engine)
        except TimeoutError as exc:
            raise TrialFailure(Outcome.TIMEOUT, str(exc)) from None
        except RuntimeError as exc:
            raise start_failure(str(exc)) from None
        out.timings["deploy_s"] = time.monotonic() - started
        _read_back(live.url, ctx.engine, config, corpus, log_dir, out)
        _measure(ctx, trial, live.url, watch, log_dir, out)
        clean = out.failure is None or out.failure.outcome is Outcome.PRUNED
    except TrialFailure as failure:
        out.failure = failure.ending
    except (httpx.HTTPError, ValueError) as exc:
        out.failure = Ending(Outcome.UNHEALTHY, f"{type(exc).__name__}: {exc}")
    finally:
        tried = live_app(ctx.study.name)  # the app this trial started its engine in (also when that failed)
        out.engine_log = _engine_log(tried.url if tried else None, log_dir)
        if not clean:
            release(ctx.study.name)
        out.timings["total_s"] = time.monotonic() - started
    arrival = ctx.study.workload.arrival
    if out.records:
        out.summary = summarize(out.records, seed=ctx.study.seed,
                                offered_rate_per_s=arrival.rate_per_s if arrival.open_loop else None)
    return out


def start_failure(message: str) -> TrialFailure:
    """What a failed engine start means for the trial, from the replica's error text: INVALID where the engine
    refused the config (`ConfigRejected`: SGLang's own verdict, not a preflight that could not answer), TIMEOUT where
    it did not get ready in time (a cold node's first launch, not a broken one), else LAUNCH_FAILED, with the cause
    named where a retry would fail the same way (`serve.engines.load_failures`). Pure."""
    if ConfigRejected.MARKER in message:
        return TrialFailure(Outcome.INVALID, message.split(ConfigRejected.MARKER, 1)[1].strip().splitlines()[0])
    if START_TIMEOUT_MARKER in message:
        return TrialFailure(Outcome.TIMEOUT, message)
    cause = repeating_cause(message)  # recorded, so that a baseline's start is not tried again in vain
    return TrialFailure(Outcome.LAUNCH_FAILED, with_cause(message, cause) if cause else message)


@dataclass(frozen=True)
class Launch:
    """How a trial's engine started, from the replica's `/replica/argv`: a launch of its own or one shared with an
    earlier config, each start phase's seconds (`start_<phase>_s`), and the config the engine was launched with (the
    effective-settings diff compares against it: a shared launch may differ from the trial in what cannot matter)."""

    shared: bool
    timings: dict[str, float]
    config: ReplicaConfig

    @property
    def launches(self) -> int:
        return 0 if self.shared else 1


def launch_of(answer: dict[str, Any], config: ReplicaConfig) -> Launch:
    """The `Launch` in a replica's `/replica/argv` answer for a start of `config`. Pure."""
    launch = answer.get("launch") or {}
    launched = launch.get("launched")
    timings = {f"start_{k}_s": float(v) for k, v in (answer.get("phases") or {}).items()}
    base = ReplicaConfig.model_validate(launched) if isinstance(launched, dict) else config
    return Launch(bool(launch.get("shared")), timings, launch_config(base))


def _read_back(url: str, engine: Engine, config: ReplicaConfig, corpus: CorpusFile | None, log_dir: Path,
               out: Measurement) -> None:
    """What the engine says it runs (`/server_info`, the replica's argv and launch), diffed against what was asked."""
    with httpx.Client(base_url=url, timeout=30) as client:
        replica = client.get("/replica/argv").json()
        launch = launch_of(replica, config)  # start phases' seconds, shared or not, the launch's own config
        out.timings |= launch.timings
        out.launch, out.launches = ("shared" if launch.shared else "new"), launch.launches
        if isinstance(replica.get("startup_s"), (int, float)):
            out.timings["engine_start_s"] = float(replica["startup_s"])
        note_phase(log_dir, "ready", phases=replica.get("phases"), **out.timings)
        prepared = replica.get("prepared") or {}
        # the engine's answer with the replica's word on where and how it started, parsed once here
        out.server_info = ServerInfo.parse(client.get("/server_info").json()).with_keys(
            replica_node_id=replica.get("node_id"), argv=replica.get("argv"),
            **({"preflight": prepared.pop("preflight")} if "preflight" in prepared else {}), node_checks=prepared)
        preflight = out.server_info.raw.get("preflight")
        if isinstance(preflight, dict) and preflight.get("ok"):
            out.diffs |= effective_diff(launch.config.spec, launch.config.max_running_requests,
                                        preflight["resolved"])
        out.diffs |= effective_diff(launch.config.spec, launch.config.max_running_requests,
                                    out.server_info.as_json(), engine.pinned_settings(launch.config))
        listed = listed_corpora(client) if config.spec.algorithm == "ngram" else None
        if listed is not None:  # the trial's record of what its engine held (SGLang's list route)
            out.server_info = out.server_info.with_keys(list_external_corpora=listed)
        out.corpus, held_wrong = corpus_record(listed, replica.get("corpus"), corpus)  # load time: every start
        if held_wrong:
            raise TrialFailure(Outcome.LAUNCH_FAILED, held_wrong)


def _flush(url: str) -> None:
    with httpx.Client(base_url=url, timeout=30) as client:
        refused = flush(client)
    if refused:
        raise TrialFailure(Outcome.TIMEOUT, refused)


def usage(url: str) -> Usage | None:
    """The engine's node's CPU counters now (`/replica/usage`), None when the replica cannot say."""
    try:
        response = httpx.get(f"{url}/replica/usage", timeout=30)
        return Usage.model_validate(response.json()) if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _measure(ctx: TrialContext, trial: TrialConfig, url: str, watch: Watch | None, log_dir: Path,
             out: Measurement) -> None:
    """Flush, warm up, measure; again (flush and the same warm-up first) while the window was disturbed, at most
    `workload.remeasure` times; then the baseline's `reference` phase. `out.records` holds the warm-up and the last
    window's measured requests."""
    study = ctx.study
    kwargs = dict(concurrency=trial.concurrency, temperature=study.workload.temperature,
                  timeout_s=study.engine.request_timeout_s)
    # warmup_requests may exceed the warm-up split: cycle it (the trie then sees some prompts twice).
    warm = [ctx.warmup[i % len(ctx.warmup)] for i in range(trial.warmup_requests)] if ctx.warmup else []
    baseline = trial.spec.algorithm == "none"
    settle, flush_after = settle_requests(ctx.measure, ctx.warmup) if baseline else ([], False)
    warm += settle
    measured: list[RequestRecord] = []
    pruned: str | None = None
    # plain decoding on an engine that measured its own round table and times its lone plain steps: the window's
    # steps are judged against that calibration (a speculative engine times none, so its counters are not read)
    step = plain_step(out.server_info.verify_cost) if baseline else None
    for attempt in range(study.workload.remeasure + 1):
        _flush(url)
        phase_start = time.monotonic()
        note_phase(log_dir, "warmup", requests=len(warm), attempt=attempt)
        warmed = run_phase(url, warm, phase="warmup", **kwargs) if warm else []
        if flush_after:
            _flush(url)
        out.timings["warmup_s"] = time.monotonic() - phase_start
        phase_start = time.monotonic()
        note_phase(log_dir, "measure", requests=len(ctx.measure), attempt=attempt)
        before, state = usage(url), step_counters(url) if step else None
        measured, pruned = measure_phase(url, list(ctx.measure), kwargs, watch, out.server_info,
                                         arrival=study.workload.arrival, seed=study.seed)
        after = usage(url)
        steps = step_ratio(state, step_counters(url), lambda context: step(1, context)) if step else None
        window = judge_window(before, after, [r for r in measured if r.phase == "measure"],
                              wait_limit=study.workload.wait_limit, steal_limit=study.workload.steal_limit,
                              steps=steps, step_limit=study.workload.step_limit)
        out.windows.append(window)
        out.timings["measure_s"] = time.monotonic() - phase_start
        out.records = warmed + measured
        note_phase(log_dir, "window", attempt=attempt, check=window.line())
        # A disturbed window is measured again, also when early stopping stopped it: a config slowed by other work
        # is not a slow config.
        if not window.disturbed or lost_requests(measured):
            break
    try:
        final = ServerInfo.parse(httpx.get(f"{url}/server_info", timeout=30).json())
        out.server_info = out.server_info.with_keys(internal_states_after=final.raw.get("internal_states"))
    except (httpx.HTTPError, ValueError):
        pass
    if baseline and ctx.reference and not lost_requests(measured):
        answered = {r.prompt_index for r in out.records if r.ok}
        todo = [item for item in ctx.reference if item.index not in answered]
        phase_start = time.monotonic()
        out.records += run_phase(url, todo, phase="reference", **kwargs) if todo else []
        out.timings["reference_s"] = time.monotonic() - phase_start
    # --- simulate-first on an engine that reports no round table (SGLang, llama-server): its verify-cost shape,
    # measured over its HTTP API now and recorded as the baseline's `verify_cost` (pipeline/measure/shape.py) ---
    if baseline and ctx.reference and not lost_requests(measured) and not out.server_info.has_round_table:
        phase_start = time.monotonic()
        # one attempt more when the window was disturbed (none with `workload.remeasure: 0`): what held the CPU during
        # the baseline's windows (a study's own start-up work) often still holds it, and each attempt costs about as
        # much as the baseline's measurement
        probed = measure_shape(url, ctx.engine, study.concurrency,
                               max_running=out.server_info.max_running_requests,
                               attempts=1 + min(1, study.workload.remeasure), wait_limit=study.workload.wait_limit,
                               timeout_s=study.engine.request_timeout_s, seed=study.seed)
        out.server_info = out.server_info.with_keys(verify_cost=probed)
        out.timings["shape_probe_s"] = time.monotonic() - phase_start
        note_phase(log_dir, "shape-probe", check=probed.get("window"))
    # A lost request fails the trial whatever the rule said: a dead engine is not a slow config.
    out.failure = lost_requests(measured) or (Ending(Outcome.PRUNED, pruned) if pruned else None)


def step_counters(url: str) -> PlainSteps | None:
    """The engine's plain-step counters now (`/server_info`'s `internal_states[0]`), None when it does not answer
    with them."""
    try:
        answer = httpx.get(f"{url}/server_info", timeout=30).json()
    except (httpx.HTTPError, ValueError):
        return None
    return ServerInfo.parse(answer).plain_steps


def settle_requests(measure: Sequence[LoadRequest], warmup: Sequence[LoadRequest]
                    ) -> tuple[list[LoadRequest], bool]:
    """The baseline's settle pass, recorded as warm-up, never measured, and whether the engine must be flushed after
    it. The baseline has no draft state to warm, but it is the study's first trial: measured at once it ran 9-15%
    below its own re-runs (start-up work of Ray, Serve, the standby replica and MLflow still running, and an engine's
    first requests paying first-use costs), which inflated every `vs_baseline` of the search and lowered early
    stopping's bar. As many requests as are measured, drawn from the warm-up split (cycled): the measured prompts
    themselves would stay in SGLang's radix cache (the trial's flush runs before its warm-up), and the baseline's
    measured prefills would be cache hits that no other trial gets. Without a warm-up split: the measured prompts,
    then a flush (True). Pure."""
    if warmup:
        return [warmup[i % len(warmup)] for i in range(len(measure))], False
    return list(measure), bool(measure)


def lost_requests(measured: list[RequestRecord]) -> Ending | None:
    """A measurement that lost any request is no measurement: its throughput counts less work, and a missing output
    cannot be compared (it would read as NOT_EQUIVALENT). TIMEOUT when every loss was a timeout, else UNHEALTHY."""
    failed = [r for r in measured if r.error]
    if not failed:
        return None
    kind = Outcome.TIMEOUT if all("timeout" in (r.error or "") for r in failed) else Outcome.UNHEALTHY
    return Ending(kind, f"{len(failed)} of {len(measured)} measured requests failed (prompts "
                        f"{sorted(r.prompt_index for r in failed)}); first: {failed[0].error}")
