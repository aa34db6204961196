"""The closed loop's state machine: watch -> re-tune -> canary -> promote or roll back, one step per `tick`.

idle     poll the live feed, feed the drift detectors (production's records only); start a cycle on a drift alarm
         (after `min_gap_s` since the last cycle) or when `every_s` has passed, unless paused
retune   `pipeline.loop.retune.retune` on the capture since the promotion (resumes its study after a restart); a result
         equal to production's config ends the cycle "confirmed" (its figures, measured on the new traffic, become
         the drift reference); a new config is the candidate
canary   start it on the endpoint at the first share, then per poll: operator commands, the step's records (kept in
         `cycles/<n>/canary-step-<k>.jsonl`), `pipeline.loop.canary.canary_decision`: step up, promote or roll back
promote  stop the canary and wait until it is off (production serves every request), then alias `production` -> the
         candidate (`previous` keeps the old one); wait until the endpoint serves it (it follows the alias and rolls)
rollback stop the canary (production's engines were never touched); the candidate alias is removed
Each cycle is one MLflow run (experiment `<registered model>-loop`) linking the drift verdicts, the capture split,
the re-tune study, every canary decision and the outcome. The state is saved after every change (`state.json`), so
a restarted loop carries on where it stopped; the endpoint always serves production meanwhile.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError, UserError
from pipeline.loop.canary import CanaryDecision, canary_decision
from pipeline.loop.client import EndpointClient, EndpointError, RouteMissing
from pipeline.loop.drift import METRICS, DetectorState, level_for_bucket, record_value, update, verdict
from pipeline.loop.reference import ReferenceProfile, load_reference
from pipeline.loop.shift import ShiftReport, shift_report
from pipeline.loop.settings import LoopSettings
from pipeline.loop.state import STATE_FILE, LoopState, save_state, scan_commands, set_aside
from pipeline.records.cycles import CycleRecorder
from pipeline.records.registry import (load_serving_config, PRODUCTION, alias_version, set_production, CANDIDATE,
                                       remove_alias, tag_version)
from serve.closed_loop.control import CandidateRef, CanaryStart, DriftLine, DriftReport
from serve.closed_loop.live import CANDIDATE_ARM, PRODUCTION_ARM, LiveRecord, bucket_of

__all__ = ["LoopSettings", "Loop", "detector_key"]  # LoopSettings re-exported: pipeline.loop.settings

LENGTH_FIELDS = ("prompt_tokens", "completion_tokens")
KEEP_LENGTHS = 2000  # latest production requests kept for the shift signal


def detector_key(metric: str, bucket: int) -> str:
    return f"{metric}@{bucket}"


class Loop:
    """One loop over one endpoint. `retune` runs a re-tune for a cycle (`pipeline.loop.retune.retune` by default):
    called with the cycle's output folder and whether to resume, it returns a `pipeline.loop.retune.RetuneResult`."""

    def __init__(self, settings: LoopSettings, client: EndpointClient, tracker: Any,
                 retune: Callable[[Path, bool], Any], clock: Callable[[], float] = time.time) -> None:
        self.settings, self.client, self.tracker, self.retune, self.clock = settings, client, tracker, retune, clock
        self.folder = Path(settings.state_dir)
        self._references: dict[str, ReferenceProfile] = {}
        self._no_reference: set[str] = set()
        self._drift_route: bool | None = None  # whether the endpoint takes POST /v1/drift (None: not asked yet)
        self._unmovable: set[Path] = set()  # unreadable command files that could not be moved aside (said once)
        self.recorder = CycleRecorder(tracker, settings.experiment or f"{settings.registered_model}-loop")
        self.log: Callable[[str], None] = lambda text: print(text, flush=True)

    def check_resumable(self, state: LoopState) -> None:
        """A saved state against these settings (a canary step the settings do not have): PipelineError naming the
        fix, before the loop acts on it."""
        shares = self.settings.canary.shares
        if state.phase == "canary" and state.step >= len(shares):
            raise PipelineError(f"{self.folder / STATE_FILE}: canary step {state.step + 1} of a canary whose settings "
                                f"have {len(shares)} steps (shares {list(shares)}); give the settings it ran with, "
                                "or move the file away to start afresh")

    # --- small parts ---------------------------------------------------------------------------------------------

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    def _save(self, state: LoopState, **changes: Any) -> LoopState:
        state = state.model_copy(update=changes)
        save_state(self.folder, state)
        return state

    def reference(self, version: str) -> ReferenceProfile:
        if version not in self._references:
            self._references[version] = load_reference(self.tracker, self.settings.registered_model, version)
        return self._references[version]

    def _cycle_dir(self, state: LoopState) -> Path:
        return self.folder / "cycles" / f"{state.cycle:04d}"

    def _records(self, state: LoopState) -> tuple[list[LiveRecord], int]:
        feed = self.client.live(state.live_after)
        if feed.dropped:
            self.log(f"live feed: {feed.dropped} records were gone before they were read (poll more often)")
        return list(feed.records), feed.next

    # --- the machine ---------------------------------------------------------------------------------------------

    def tick(self, state: LoopState) -> LoopState:
        """One step of the machine (module docstring). An unreachable endpoint leaves the state as it was; one
        without a route the loop needs raises `RouteMissing`."""
        try:
            handler = {"idle": self._idle, "retune": self._retune, "canary": self._canary,
                       "promote": self._promote, "rollback": self._rollback}[state.phase]
            return handler(state)
        except RouteMissing:
            raise
        except EndpointError as exc:
            self.log(f"endpoint: {exc}; trying again at the next poll")
            return state

    def _commands(self, state: LoopState) -> tuple[LoopState, str | None]:
        """Apply pause/resume; return the first abort/promote still to act on (consumed)."""
        action = None
        commands, unreadable = scan_commands(self.folder)
        set_aside(unreadable, self.log, self._unmovable)
        for path, command in commands:
            if command.command in ("pause", "resume"):
                state = self._save(state, paused=command.command == "pause")
                self.log(f"operator: {command.command}")
            elif state.phase == "canary" and action is None:
                action = command.command
            else:
                self.log(f"operator: {command.command} ignored (no canary running)")
            path.unlink(missing_ok=True)
        return state, action

    def _idle(self, state: LoopState) -> LoopState:
        state, _ = self._commands(state)
        if state.watching_since_ms is None:
            state = self._save(state, watching_since_ms=self.now_ms())
        production = self.client.served_version()
        if production is None:
            raise UserError("the endpoint serves no registered version (a config file?): the loop needs the registry")
        if production != state.production_version:  # first start, or a promotion made by hand
            state = self._save(state, production_version=production, reference_version=production, detectors={},
                               live_lengths={})
        records, cursor = self._records(state)
        try:
            reference: ReferenceProfile | None = self.reference(state.reference_version or production)
        except UserError as exc:  # e.g. a version promoted by hand from a study that kept no requests
            if (state.reference_version or production) not in self._no_reference:
                self.log(f"drift test off: {exc}")
                self._no_reference.add(state.reference_version or production)
            reference = None
        mine = [r for r in records if r.arm == PRODUCTION_ARM and r.version == production]
        detectors = self._feed(dict(state.detectors), reference, mine) if reference is not None else state.detectors
        lengths = {field: (tuple(state.live_lengths.get(field, ())) + tuple(getattr(r, field) for r in mine if r.ok)
                           )[-KEEP_LENGTHS:] for field in LENGTH_FIELDS}
        state = self._save(state, detectors=detectors, live_after=cursor, live_lengths=lengths)
        if reference is not None:
            self._post_drift(state, reference)
        trigger = self._trigger(state, reference)
        if trigger and not state.paused:
            return self.start_cycle(state, trigger)
        return state

    def _feed(self, detectors: dict[str, DetectorState], reference: ReferenceProfile,
              records: list[LiveRecord]) -> dict[str, DetectorState]:
        """Production's new records into the detector of each figure and bucket the study measured."""
        for bucket in sorted({bucket_of(r.concurrency) for r in records}):
            level = level_for_bucket(reference.level_numbers, bucket)
            found = reference.level(level) if level is not None else None
            for metric in METRICS:
                ref = found.figures.get(metric) if found is not None else None
                if ref is None or ref.prompts < self.settings.drift.min_prompts:
                    continue
                key = detector_key(metric, bucket)
                values = [v for r in records if bucket_of(r.concurrency) == bucket
                          and (v := record_value(metric, r)) is not None]
                detectors[key] = update(detectors.get(key) or DetectorState(metric=metric, bucket=bucket), ref,
                                        self.settings.drift, values)
        return detectors

    def _post_drift(self, state: LoopState, reference: ReferenceProfile) -> None:
        """Show the verdicts on the endpoint (`/v1/config`, `/metrics`); an endpoint without the route is told
        nothing (said once)."""
        if self._drift_route is False:
            return
        lines = tuple(DriftLine(**v.model_dump(include=set(DriftLine.model_fields))) for v in
                      self.drift_verdicts(state, reference))
        shift = self.shift(state)
        try:
            self.client.post_drift(DriftReport(at_ms=self.now_ms(), reference_version=reference.version, lines=lines,
                                               shift=shift.summary if shift is not None else None))
            self._drift_route = True
        except RouteMissing as exc:
            self._drift_route = False
            self.log(f"drift verdicts stay in the loop's state: {exc}")

    def drift_verdicts(self, state: LoopState, reference: ReferenceProfile) -> list[Any]:
        out = []
        for detector in state.detectors.values():
            level = level_for_bucket(reference.level_numbers, detector.bucket)
            found = reference.level(level) if level is not None else None
            ref = found.figures.get(detector.metric) if found is not None else None
            if ref is not None:
                out.append(verdict(detector, ref, self.settings.drift))
        return out

    def shift(self, state: LoopState) -> ShiftReport | None:
        """The length signal of live production requests against the reference study's (texts: see the re-tune)."""
        try:
            reference = self.reference(state.reference_version or state.production_version or "")
        except UserError:
            return None
        study: dict[str, Sequence[float]] = {"prompt_tokens": reference.prompt_tokens,
                                             "completion_tokens": reference.completion_tokens}
        return shift_report(study, dict(state.live_lengths), [], [], self.settings.shift)

    def _trigger(self, state: LoopState, reference: ReferenceProfile | None) -> str | None:
        now = self.now_ms()
        last = state.last_cycle_end_ms
        since_last = (now - last) / 1000 if last is not None else None
        alarms = [v.text for v in self.drift_verdicts(state, reference) if v.alarm] if reference is not None else []
        if alarms and self.settings.on_drift and (since_last is None or since_last >= self.settings.min_gap_s):
            return "; ".join(alarms)
        every, start = self.settings.every_s, last if last is not None else state.watching_since_ms
        if every and start is not None and (now - start) / 1000 >= every:
            return f"scheduled (every {every:g} s)"
        return None

    # --- a cycle -------------------------------------------------------------------------------------------------

    def start_cycle(self, state: LoopState, trigger: str) -> LoopState:
        cycle = state.cycle + 1
        if state.production_version is None:  # a cycle started before the first watch (--once)
            production = self.client.served_version()
            state = self._save(state, production_version=production, reference_version=production)
        try:
            reference = self.reference(state.reference_version or state.production_version or "")
            verdicts = [v.model_dump() for v in self.drift_verdicts(state, reference)]
        except UserError as exc:  # no measured requests: the cycle still runs, its record says why
            verdicts = [{"note": str(exc)}]
        drift = json.dumps(verdicts, indent=2)
        run_id = self.recorder.start(cycle, trigger, state.production_version, drift)
        shift = self.shift(state)
        if shift is not None:
            self.recorder.text(run_id, shift.model_dump_json(indent=2), "shift.json")
            self.recorder.tags(run_id, {"workload_shift": shift.summary})
        self.log(f"cycle {cycle}: {trigger}")
        return self._save(state, phase="retune", cycle=cycle, cycle_run_id=run_id, trigger=trigger,
                          cycle_started_ms=self.now_ms(), candidate_version=None, step=0, step_started_ms=None,
                          outcome=None, reason=None)

    def _retune(self, state: LoopState) -> LoopState:
        out = self._cycle_dir(state) / "retune"
        resume = (out / "study.yaml").exists()
        try:
            result = self.retune(out, resume)
        except Exception as exc:  # noqa: BLE001 - one failed re-tune ends its cycle, not the loop
            return self._end(state, "retune_failed", f"{type(exc).__name__}: {exc}"[:4000])
        run_id = state.cycle_run_id or ""
        self.recorder.text(run_id, result.model_dump_json(indent=2), "retune.json")
        self.recorder.tags(run_id, {"retune_study": result.study, "retune_output": result.output,
                                    "candidate_version": result.candidate_version or "", "capture": result.split.text})
        self.recorder.linked(run_id, self.settings.registered_model, result.study, result.candidate_version)
        if result.candidate_version is None or result.same_as_production:
            why = ("the re-tune registered nothing" if result.candidate_version is None else
                   f"the re-tune's best is production's own config (version {result.candidate_version} holds its "
                   "figures on the new traffic and is now the drift reference)")
            state = self._save(state, reference_version=result.candidate_version or state.reference_version)
            if result.candidate_version is not None:
                self._drop_candidate_alias()
            return self._end(state, "confirmed", why)
        self.log(f"cycle {state.cycle}: candidate version {result.candidate_version}")
        return self._save(state, phase="canary", candidate_version=result.candidate_version, step=0,
                          step_started_ms=None, retune_output=result.output)

    def _candidate_spec(self, version: str) -> Any:
        return load_serving_config(self.tracker.tracking_uri,
                                   f"models:/{self.settings.registered_model}/{version}").replica.spec

    def _step_file(self, state: LoopState) -> Path:
        return self._cycle_dir(state) / f"canary-step-{state.step}.jsonl"

    def _step_records(self, state: LoopState) -> list[LiveRecord]:
        path = self._step_file(state)
        seen: dict[int, LiveRecord] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    record = LiveRecord.model_validate_json(line)
                except ValueError:
                    continue  # a line cut by a crash
                seen[record.seq] = record
        return [seen[k] for k in sorted(seen)]

    def _canary(self, state: LoopState) -> LoopState:
        settings, candidate = self.settings.canary, state.candidate_version or ""
        state, action = self._commands(state)
        if action == "abort":
            return self._save(state, phase="rollback", reason="aborted by operator")
        if action == "promote":
            return self._save(state, phase="promote", reason="forced by operator")
        status = self.client.canary()
        ours = status.candidate is not None and status.candidate.version == candidate
        if status.state == "failed" and ours:
            return self._save(state, phase="rollback", reason=f"the candidate failed: {status.reason}")
        if status.state == "stopping":
            return state  # a stop in progress (ours, or an operator's): start again once it is off
        if status.state in ("running", "starting") and not ours:
            self.client.canary_stop("another candidate was on the endpoint; the loop starts its own")
            return state
        if status.state in ("off", "failed"):  # not started yet, or lost (an endpoint restart, its lease expired)
            share = settings.shares[state.step]
            self.client.canary_start(CanaryStart(candidate=CandidateRef(
                registered_model=self.settings.registered_model, version=candidate), share=share,
                lease_s=settings.lease_s))
            self.log(f"cycle {state.cycle}: canary of version {candidate} at share {share:g}")
            return self._save(state, step_started_ms=state.step_started_ms or self.now_ms())
        if status.state == "starting":
            waited = (self.now_ms() - (state.step_started_ms or self.now_ms())) / 1000
            if waited > self.settings.start_timeout_s:
                return self._save(state, phase="rollback", reason=f"the candidate did not start within "
                                                                  f"{self.settings.start_timeout_s:g} s")
            return state
        records, cursor = self._records(state)
        started = state.step_started_ms or self.now_ms()
        if state.step == 0 and status.started_ms:  # the first step counts from when the candidate took requests
            started = max(started, status.started_ms)
        fresh = [r for r in records if r.t_ms >= started and
                 ((r.arm == PRODUCTION_ARM and r.version == state.production_version) or
                  (r.arm == CANDIDATE_ARM and r.version == candidate))]
        path = self._step_file(state)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as handle:
            handle.writelines(r.model_dump_json() + "\n" for r in fresh)
        state = self._save(state, live_after=cursor, step_started_ms=started)
        if state.paused:
            return state
        rows = self._step_records(state)
        decision = canary_decision(settings, self.settings.promotion, self.settings.constraints, state.step,
                                   [r for r in rows if r.arm == PRODUCTION_ARM],
                                   [r for r in rows if r.arm == CANDIDATE_ARM], self._candidate_spec(candidate),
                                   (self.now_ms() - started) / 1000)
        if decision.action == "continue" and decision.next_share == decision.share:
            return state
        self._log_decision(state, decision)
        if decision.action == "promote":
            return self._save(state, phase="promote", reason=decision.reason)
        if decision.action == "rollback":
            return self._save(state, phase="rollback", reason=decision.reason)
        self.client.canary_share(decision.next_share or decision.share)
        self.log(f"cycle {state.cycle}: {decision.reason}")
        return self._save(state, step=state.step + 1, step_started_ms=self.now_ms())

    def _log_decision(self, state: LoopState, decision: CanaryDecision) -> None:
        run_id = state.cycle_run_id or ""
        self.recorder.text(run_id, decision.model_dump_json(indent=2), f"canary/step-{state.step}.json")
        self.recorder.metrics(run_id, {"canary_share": decision.share,
                                       "canary_production_tput": decision.production.median,
                                       "canary_candidate_tput": decision.candidate.median}, state.step)

    def _promote(self, state: LoopState) -> LoopState:
        candidate = state.candidate_version or ""
        name = self.settings.registered_model
        if alias_version(self.tracker, name, PRODUCTION) != candidate:
            # The canary ends before the alias moves: its candidate engine belongs to the ingress replica that the
            # roll replaces, and a stop sent after the roll reached a new replica that knows no canary (the engine
            # kept running, unreachable). Production serves every request meanwhile.
            status = self.client.canary()
            if status.state in ("starting", "running"):
                self.client.canary_stop("promoted: the canary ends before production rolls to the candidate")
                return state
            if status.state == "stopping":
                return state  # the next poll moves the alias once the candidate's engine is gone
            set_production(self.tracker, name, candidate)
            self.log(f"cycle {state.cycle}: alias {PRODUCTION} -> version {candidate}; waiting for the endpoint")
        if self.client.served_version() != candidate:
            return state  # the endpoint rolls to the alias
        self._drop_candidate_alias()
        state = self._save(state, production_version=candidate, reference_version=candidate, detectors={})
        return self._end(state, "promoted", state.reason or "promoted")

    def _rollback(self, state: LoopState) -> LoopState:
        self.client.canary_stop(state.reason or "rolled back")
        self._drop_candidate_alias()
        return self._end(state, "rolled_back", state.reason or "rolled back")

    def _drop_candidate_alias(self) -> None:
        remove_alias(self.tracker, self.settings.registered_model, CANDIDATE)

    def _end(self, state: LoopState, outcome: str, reason: str) -> LoopState:
        run_id = state.cycle_run_id
        if state.candidate_version:
            tag_version(self.tracker, self.settings.registered_model, state.candidate_version,
                        {"loop_outcome": outcome, "loop_reason": reason[:4000], "loop_cycle_run": run_id or ""})
        if run_id:
            self.recorder.end(run_id, outcome, reason, failed=outcome == "retune_failed")
        self.log(f"cycle {state.cycle}: {outcome}: {reason}")
        return self._save(state, phase="idle", outcome=outcome, reason=reason, last_cycle_end_ms=self.now_ms(),
                          candidate_version=None, step=0, step_started_ms=None, detectors={}, live_lengths={})
