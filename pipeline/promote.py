"""`python -m pipeline.promote`: show what production would serve (`--show`: the serving config and the engine command
line), roll production back to `previous`, or point it at a registered version, and optionally wait until the
production endpoint serves it.

The promotion decision itself is pure and lives in `pipeline/decide/decision.py`; the MLflow registry action in
`pipeline/records/registry.py`. This module is only the command line and the HTTP polling of the endpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from pipeline.cli_common import add_version, program
from pipeline.errors import PipelineError, UserError
from pipeline.loop.control import add_canary_arguments, canary_main
from pipeline.redact import mask_in_text


def _parser() -> Any:
    parser = argparse.ArgumentParser(
        prog=program("specdec-promote", "pipeline.promote"),
        description="Show the promoted config of a study, roll production back to 'previous', or point it at a "
                    "registered version. The decision itself is made at the end of `specdec-tune`.")
    add_version(parser)
    parser.add_argument("--study", metavar="FILE", help="the study file the study was run with")
    parser.add_argument("--name", help="study name (default: from the study file, else 'default')")
    parser.add_argument("--output", help="output folder of the study (default: ./runs/<name>)")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default: the study file's tracking.uri, else "
                                               "$MLFLOW_TRACKING_URI, else sqlite under the output folder)")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--show", action="store_true", help="print what production would serve: the registered "
                        "serving config, its version and the engine command line (also printed after the others)")
    action.add_argument("--rollback", action="store_true", help="swap aliases production and previous")
    action.add_argument("--set-version", metavar="N", help="point production at registered version N")

    add_canary_arguments(parser, action)  # --canary status|pause|resume|abort|promote (the closed loop's canary)
    parser.add_argument("--deploy", metavar="URL", help="after moving the alias, wait until the production endpoint "
                        "at URL (started with `python -m serve.production`, which follows the alias and rolls with "
                        "a new replica before the old one stops) serves the new version")
    parser.add_argument("--api-key", help="API key for --deploy's /v1/config check (default: $SPECDEC_API_KEYS)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds --deploy waits (default: what the production roll itself may take for the "
                             "promoted config: its slowest engine's start_timeout_s with the engine's cold-start "
                             "allowance, the old engine's drain and a margin, plus one --follow-alias-s poll)")
    return parser


def wait_for_endpoint(url: str, version: str, api_key: str | None, timeout_s: float) -> None:
    """Poll `<url>/v1/config` until it reports `version`; raises TimeoutError."""
    import httpx  # lazy: httpx only for --deploy's wait, not for --help or --show

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline, seen = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            seen = httpx.get(f"{url.rstrip('/')}/v1/config", headers=headers, timeout=10).json().get("version")
            if str(seen) == str(version):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} still serves version {seen} after {timeout_s:.0f} s (wanted {version}); is "
                       f"`python -m serve.production` running with --follow-alias-s > 0?")


def deploy_wait_s(serving: Any) -> float:
    """--deploy's default wait for `serving` (a ServingConfig): the roll's own deadline
    (`serve.production.roll.deploy_timeout_s`, from `serve.engines.waits`) and one poll of the alias by
    `python -m serve.production` at its default `follow_alias_s`."""
    # lazy: production's settings and the engines' deadlines (FastAPI, every engine's model) only for --deploy
    from serve.production.roll import deploy_timeout_s
    from serve.production.settings import ProductionSettings

    return deploy_timeout_s(serving) + float(ProductionSettings.model_fields["follow_alias_s"].default)


def show(tracker: Any, name: str) -> str:
    """What production would serve: `models:/<name>@production`, validated as production validates it, and the
    engine command line it runs (the same text as the study's deploy/engine_command.sh)."""
    # lazy: the registry (MLflow's client, production's app types) and the engines only for --show
    from pipeline.records.registry import PRODUCTION, load_serving_config, production_version
    from serve.serving import engine_command

    serving = load_serving_config(tracker.tracking_uri, f"models:/{name}@{PRODUCTION}")
    return (f"{name} version {production_version(tracker, name)} (alias {PRODUCTION}):\n"
            f"{serving.model_dump_json(indent=2)}\n\nengine command line:\n  {engine_command(serving)}")


def existing_tracking(uri: str) -> None:
    """Refuse (PipelineError) a tracking URI that holds no study: a SQLite file that does not exist, or a file
    store. Promotion reads and moves what a study registered; it creates nothing."""
    from pipeline.preflight import check_tracking_uri  # lazy: the engines' checks only past --help

    check_tracking_uri(uri, "--tracking-uri")
    if uri.startswith("sqlite:///"):
        path = Path(unquote(uri[len("sqlite:///"):].split("?", 1)[0]))
        if not path.is_file():
            raise PipelineError(f"no study's MLflow database at {str(path)!r}: give the study's --output (or --name) "
                                "or its --tracking-uri; nothing was created")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.canary:
        return canary_main(args)
    # lazy: the study's config, MLflow's records and the registry (pyarrow, FastAPI) only past --help and --canary
    from pipeline.config import load_study
    from pipeline.records.registry import (PRODUCTION, load_serving_config, production_version, rollback,
                                           set_production)
    from pipeline.records.tracking import Tracker, default_tracking_uri

    uri: str | None = None
    overrides = {k: v for k, v in {"name": args.name, "output_dir": args.output,
                                   "tracking.uri": args.tracking_uri}.items() if v}
    try:
        study = load_study(args.study, overrides)
        uri = study.tracking.uri or default_tracking_uri(study.output_path())
        existing_tracking(uri)  # before Tracker: it would create an empty database where no study is
        tracker = Tracker(uri, study.tracking.experiment or study.name)
        name = study.tracking.registered_model or f"specdec-{study.name}"
        if args.rollback:
            now, before = rollback(tracker, name)
            print(f"{name}: production -> version {now} (previous -> {before})")
        elif args.set_version:
            set_production(tracker, name, args.set_version)
            print(f"{name}: production -> version {args.set_version}")
        print(show(tracker, name))
        if args.deploy:
            version = production_version(tracker, name)
            if version is None:
                raise PipelineError(f"registered model '{name}' has no alias '{PRODUCTION}': nothing to deploy")
            key = args.api_key or (os.environ.get("SPECDEC_API_KEYS", "").split(",")[0] or None)
            wait_s = args.timeout
            if wait_s is None:  # as long as the endpoint's roll to this version may take
                wait_s = deploy_wait_s(load_serving_config(tracker.tracking_uri, f"models:/{name}@{PRODUCTION}"))
            wait_for_endpoint(args.deploy, str(version), key, wait_s)
            print(f"{args.deploy} now serves {name} version {version}")
        return 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - MLflow errors (no such model/alias) are user-facing here
        # MLflow may quote the tracking URI, password included.
        print(f"error: {type(exc).__name__}: {mask_in_text(str(exc), [args.tracking_uri, uri])}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
