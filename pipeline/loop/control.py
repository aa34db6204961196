"""`python -m pipeline.promote --canary status|pause|resume|abort|promote`: watch and steer the loop's canary.

- `status`: the loop's state (phase, cycle, candidate, step and share, paused, the last outcome) and, with
  `--endpoint`, what the endpoint's canary route reports.
- `pause` / `resume`: the loop holds the canary at its share and decides nothing (and starts no new cycle) until
  resumed.
- `abort`: the loop rolls the candidate back (reason "aborted by operator"); with `--endpoint` the endpoint is told
  at once as well, so an abort works while the loop is down.
- `promote`: the loop promotes the candidate now (reason "forced by operator"), skipping the remaining steps.
Commands are queued in the loop's state folder (`pipeline.loop.state`); the loop applies them at its next poll.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from pipeline.errors import UserError

__all__ = ["COMMANDS", "add_canary_arguments", "canary_main", "status_text"]

COMMANDS = ("status", "pause", "resume", "abort", "promote")
DEFAULT_STATE_DIR = "runs/loop"


def add_canary_arguments(parser: argparse.ArgumentParser, group: Any) -> None:
    """`--canary` into the command line's action group, and the options it needs."""
    group.add_argument("--canary", choices=COMMANDS, help="the closed loop's canary: status, pause, resume, abort "
                       "or promote (docs/loop.md)")
    parser.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help="--canary: the loop's state folder "
                        f"(default {DEFAULT_STATE_DIR})")
    parser.add_argument("--endpoint", help="--canary: the production endpoint (status asks it; abort tells it "
                        "directly)")


def status_text(folder: Path) -> str:
    # lazy: keeps `python -m pipeline.loop --help` light (numpy)
    from pipeline.loop.state import load_state, scan_commands

    state = load_state(folder)
    lines = [f"loop state in {folder}: phase {state.phase}, cycle {state.cycle}" + (" (PAUSED)" if state.paused
                                                                                     else "")]
    if state.phase != "idle":
        lines.append(f"  trigger: {state.trigger}; production version {state.production_version}, candidate "
                     f"{state.candidate_version or '-'}")
    if state.phase == "canary":
        lines.append(f"  canary step {state.step + 1}, started at {state.step_started_ms} ms")
    for key, detector in sorted(state.detectors.items()):
        mean = detector.live_sum / detector.requests if detector.requests else float("nan")
        alarm = f" -- ALARM after {detector.alarm_at}" if detector.alarm_at else ""
        lines.append(f"  drift {key}: live mean {mean:.3g} over {detector.requests} requests, CUSUM "
                     f"{detector.statistic:.2f}{alarm}")
    if state.outcome:
        lines.append(f"  last cycle: {state.outcome}: {state.reason}")
    commands, unreadable = scan_commands(folder)
    queued = [command.command for _, command in commands]
    if queued:
        lines.append(f"  queued commands: {queued}")
    for path, why in unreadable:
        lines.append(f"  not a command (the loop moves it aside, unapplied): {path.name}: {why}")
    return "\n".join(lines)


def canary_main(args: argparse.Namespace) -> int:
    """Run one `--canary` command; returns the exit code."""
    # lazy: keeps `python -m pipeline.loop --help` light (httpx, numpy)
    from pipeline.loop.client import EndpointClient
    from pipeline.loop.state import send_command

    folder = Path(args.state_dir)
    key = getattr(args, "api_key", None) or os.environ.get("SPECDEC_ADMIN_KEY")
    try:
        if args.canary == "status":
            print(status_text(folder))
            if args.endpoint:
                print(f"endpoint {args.endpoint}: {EndpointClient(args.endpoint, key).canary().model_dump_json()}")
            return 0
        if not (folder / "state.json").exists():
            raise UserError(f"no loop state in {folder}: is `python -m pipeline.loop` running with --state-dir "
                            f"{folder}?")
        reason = {"abort": "aborted by operator", "promote": "forced by operator"}.get(args.canary, "")
        path = send_command(folder, args.canary, reason)
        print(f"{args.canary}: queued ({path.name}); the loop applies it at its next poll")
        if args.canary == "abort" and args.endpoint:
            status = EndpointClient(args.endpoint, key).canary_stop(reason)
            print(f"endpoint {args.endpoint}: canary {status.state}; production serves every request")
        return 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
