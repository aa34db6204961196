"""`python -m pipeline.loop --endpoint URL --tracking-uri URI --every 6h`: the closed loop, unattended
(`pipeline.loop.cycle`; docs/loop.md). One loop per `--state-dir` (a lock); stop it with Ctrl-C or SIGTERM at any
time and start it again: it carries on from its state file, and the endpoint serves production throughout.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from pipeline.cli_common import add_version, env_tracking_uri, program
from pipeline.errors import UserError

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_s(text: str) -> float | None:
    """'6h', '30m', '90s', '1.5d', '600' (seconds); '0' or 'off' = None. Raises ValueError naming the fix."""
    value = text.strip().lower()
    if value in ("0", "off", "none", "never"):
        return None
    found = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([smhd]?)", value)
    if not found:
        raise ValueError(f"{text!r} is not a duration; give e.g. 6h, 30m, 90s or off")
    return float(found.group(1)) * _UNITS[found.group(2) or "s"]


def _count(low: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r}: give a whole number >= {low}")
        return value
    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=program("specdec-loop", "pipeline.loop"),
        description="The closed loop: watch production's live figures for drift, re-tune on its captured traffic "
                    "(every --every, or on drift), canary the result on live traffic, then promote or roll back. "
                    "Each cycle is an MLflow run. See docs/loop.md.")
    parser.add_argument("--endpoint", required=True, help="production endpoint base URL")
    add_version(parser)
    uri = env_tracking_uri()
    parser.add_argument("--tracking-uri", required=uri is None, default=uri,
                        help="MLflow tracking URI of production's registry (default: $MLFLOW_TRACKING_URI)")
    parser.add_argument("--registered-model", help="registry name (default: the endpoint's)")
    parser.add_argument("--api-key", help="the endpoint's admin key (default: $SPECDEC_ADMIN_KEY)")
    parser.add_argument("--every", default="6h", help="re-tune this long after the last cycle (default 6h; off = on "
                                                      "drift only)")
    parser.add_argument("--no-drift", action="store_true", help="do not start cycles on drift alarms")
    parser.add_argument("--min-gap", default="1h", help="no drift-started cycle sooner than this after the last "
                                                        "(default 1h)")
    parser.add_argument("--poll", default="30s", help="how often the live feed and the canary are read (default 30s)")
    parser.add_argument("--state-dir", default="runs/loop", help="state, lock and cycle folders (default runs/loop)")
    parser.add_argument("--settings", metavar="FILE", help="YAML with canary:, drift:, promotion:, constraints: "
                        "(pipeline.loop.settings.LoopSettings; default: the study file's promotion and constraints)")
    parser.add_argument("--study", metavar="FILE", help="the re-tune's study file (search space, budget, levels, "
                                                        "promotion policy, SLA limits)")
    parser.add_argument("--capture", metavar="PATH", help="the endpoint's capture directory, if this machine sees it "
                                                          "(default: fetched from the endpoint)")
    parser.add_argument("--trials", type=_count(1), help="re-tune trials including the baseline and production's config")
    parser.add_argument("--measure-prompts", type=_count(1), help="captured prompts the re-tune measures (default: the "
                                                            "study's, at least 16)")
    parser.add_argument("--warmup-prompts", type=_count(0), help="captured prompts the re-tune warms up with (default: "
                                                           "the study's)")
    parser.add_argument("--once", action="store_true", help="run one cycle now, to its outcome, then exit")
    return parser


def _settings(args: argparse.Namespace, name: str) -> Any:
    # lazy: keeps `python -m pipeline.loop --help` light (numpy, pyarrow)
    from pipeline.config import load_study
    from pipeline.loop.settings import LoopSettings

    study = load_study(args.study, {})
    data: dict[str, Any] = {"promotion": study.promotion.model_dump(),
                            "constraints": [c.model_dump() for c in study.objective.constraints]}
    if args.settings:
        loaded = yaml.safe_load(Path(args.settings).read_text()) or {}
        if not isinstance(loaded, dict):
            raise UserError(f"--settings {args.settings}: the top level must be a mapping")
        data.update(loaded)
    data.update({"registered_model": name, "state_dir": args.state_dir, "every_s": duration_s(args.every),
                 "on_drift": not args.no_drift, "min_gap_s": duration_s(args.min_gap) or 0.0})
    try:
        return LoopSettings.model_validate(data)
    except ValueError as exc:
        raise UserError(f"loop settings: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # lazy: the loop's stack (FastAPI, httpx, numpy, pyarrow) only past --help
    from pipeline.loop.client import EndpointClient
    from pipeline.loop.cycle import Loop
    from pipeline.loop.retune import RetuneOptions, retune
    from pipeline.loop.state import LoopLock, load_state
    from pipeline.records.tracking import Tracker

    key = args.api_key or os.environ.get("SPECDEC_ADMIN_KEY")
    try:
        poll = duration_s(args.poll) or 30.0
        client = EndpointClient(args.endpoint, key)
        name = args.registered_model or (client.config().get("origin") or {}).get("registered_model")
        if not name:
            raise UserError("the endpoint serves no registered model; give --registered-model")
        settings = _settings(args, name)
        tracker = Tracker(args.tracking_uri, f"{name}-loop")

        def run_retune(out: Path, resume: bool) -> Any:
            return retune(RetuneOptions(tracking_uri=args.tracking_uri, endpoint=args.endpoint, api_key=key,
                                        registered_model=name, study=args.study, capture=args.capture,
                                        output=str(out), trials=args.trials, measure_prompts=args.measure_prompts,
                                        warmup_prompts=args.warmup_prompts, resume=resume))

        with LoopLock(Path(args.state_dir)):
            loop = Loop(settings, client, tracker, run_retune)
            state = load_state(Path(args.state_dir))
            loop.check_resumable(state)
            stop = []
            signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
            if args.once and state.phase == "idle":
                state = loop.start_cycle(state, "manual (--once)")
            print(f"loop on {args.endpoint} ({name}): phase {state.phase}, state in {args.state_dir}", flush=True)
            while not stop:
                state = loop.tick(state)
                if args.once and state.phase == "idle" and state.cycle_run_id and state.outcome:
                    break
                deadline = time.monotonic() + poll
                while not stop and time.monotonic() < deadline:
                    time.sleep(min(1.0, poll))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stopped; start again to carry on (the endpoint keeps serving production)", flush=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
