"""`python -m pipeline.tune`: the composition root. Resolves the study, prints it, and runs (or dry-runs) it.

Everything is resolved here from the study file and the command line (CLI > file > defaults); one seed is threaded
through. The stages themselves live in their own modules (space, trial, load, measure, record, promote).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from typing import Any, Sequence

import yaml

from pipeline.config import StudyConfig, load_study, study_to_yaml
from pipeline.errors import PipelineError, UserError
from pipeline.preflight import check_study
from serve.engines import describe_device
from serve.engines.base import ReplicaConfig
from pipeline.search.space import (
    Resolution, SearchSpace, define_by_run, enqueue_baseline, load_space, resolve, startup_trials, tpe_sampler,
)

# Command-line flags that override one study key each: (flag, dotted key, type, help).
_OVERRIDES: list[tuple[str, str, Any, str]] = [
    ("--name", "name", str, "study name (default: 'default'); outputs go to ./runs/<name>"),
    ("--search-space", "search_space", str, "search-space file: a name in search_spaces/ or a path"),
    ("--output", "output_dir", str, "output folder (default: ./runs/<name>)"),
    ("--model", "model.target", str, "target model: cpu engine id (smollm2-135m, gemma3-270m, ...) or a path"),
    ("--engine", "engine.kind", str, "engine: cpu (embedded, default), sglang (a GPU node; on a CPU its own server "
                                     "from bash infra/install-sglang-cpu.sh) or llama_cpp"),
    ("--workload", "workload.source", str, "bundled workload (code-edit, free-text, templated) or a JSONL/Parquet file"),
    ("--trials", "budget.max_trials", int, "number of trials including the baseline"),
    ("--time-budget", "budget.time_budget_s", float, "seconds after which no new trial starts"),
    ("--seed", "seed", int, "one seed for sampling, workload order and bootstrap"),
    ("--tracking-uri", "tracking.uri", str, "MLflow tracking URI (default: sqlite under the output folder)"),
    ("--storage", "storage.url", str, "Optuna storage URL (default: sqlite under the output folder)"),
    ("--ray-address", "ray.address", str, "Ray cluster address (default: start a local Ray)"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.tune",
        description="Search speculative-decoding configs (Ray Tune + Optuna), deploy each through Ray Serve, "
                    "measure it, log it to MLflow, and promote the winner. With no arguments: the default study "
                    "(CPU engine, smallest model, baseline + NGRAM).",
        epilog="Precedence: command line > --study file > defaults. Example: "
               "python -m pipeline.tune --dry-run --search-space ngram.yaml",
    )
    parser.add_argument("--study", metavar="FILE", help="study YAML file (see docs/configuration.md)")
    for flag, dotted, kind, text in _OVERRIDES:
        parser.add_argument(flag, dest=dotted, type=kind, default=None, help=f"{text} [{dotted}]")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                        help="override any study key, e.g. --set promotion.margin=0.05 (value parsed as YAML); "
                             "repeatable")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved study and the first sampled trial configs with their validation "
                             "verdicts; starts nothing (no Ray, no engine, no MLflow)")
    parser.add_argument("--samples", type=int, default=None, metavar="N",
                        help="with --dry-run: how many trial configs to sample "
                             "(default: the study's budget.max_trials)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the study in the output folder instead of refusing to overwrite it; refused "
                             "if its search space, workload, model or engine changed; a new --trials is honoured")
    return parser


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The dotted-key overrides the command line asks for; --set values are parsed as YAML scalars/lists."""
    found = {dotted: getattr(args, dotted) for _, dotted, _, _ in _OVERRIDES if getattr(args, dotted) is not None}
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise PipelineError(f"--set {item!r}: expected KEY=VALUE, e.g. --set budget.max_trials=4")
        found[key.strip()] = yaml.safe_load(raw)
    return found


def sample_configs(space: SearchSpace, study: StudyConfig, count: int) -> list[Resolution]:
    """The first `count` points the tuner would try (baseline first), without telling Optuna any result. Uses the
    study's own sampler (`tpe_sampler` with the study's seed and budget), so the start-up rule is the study's."""
    import optuna

    ot_study = optuna.create_study(direction="maximize", sampler=tpe_sampler(study.seed, study.budget.max_trials))
    enqueue_baseline(ot_study, space)
    sample = define_by_run(space)
    out = []
    for _ in range(count):
        trial = ot_study.ask()
        constants = sample(trial)
        out.append(resolve(space, {**trial.params, **constants}, study))
    return out


def describe(resolution: Resolution) -> str:
    params = ", ".join(f"{k}={v}" for k, v in resolution.params.items() if k != "algorithm")
    head = f"{resolution.params.get('algorithm')}" + (f" ({params})" if params else "")
    if resolution.valid:
        return f"VALID    {head}"
    reasons = "; ".join(str(v) for v in resolution.violations)
    return f"INVALID  {head}\n           -> {reasons}"


def dry_run(study: StudyConfig, space: SearchSpace, samples: int | None) -> None:
    samples = samples or study.budget.max_trials
    print("# resolved study (passwords in URLs masked)")
    print(study_to_yaml(study))
    where = describe_device(ReplicaConfig(engine=study.engine.kind, model=study.model.target,
                                          device=study.engine.device))
    if where:
        print(f"# engine: {where}")
    print(f"# search space: {study.search_space_path()} ({space.description or space.name})")
    from pipeline.search.strategy import resolve_strategy

    strategy = resolve_strategy(study, space)
    print(f"# search: {strategy.name} -- {strategy.reason}")
    if strategy.simulated:
        print("# (simulate-first: the TPE sample below is what a fallback to tpe would start with)")
    startup = startup_trials(study.budget.max_trials)
    print(f"# sampler: the study's own TPE (seed {study.seed}, {startup} random start-up trials of "
          f"{study.budget.max_trials}); after the start-up the real study's picks depend on its results")
    print(f"# first {samples} trial configs (trial 0 is the baseline); nothing was started")
    sampled = sample_configs(space, study, samples)
    for number, resolution in enumerate(sampled):
        print(f"  #{number:<3} {describe(resolution)}")
    from pipeline.trial.launches import format_plan, plan_launches  # the trial stack's imports: a dry run only

    print(format_plan(study, plan_launches(study, sampled)))
    from pipeline.study.backend import argv_report, decide_backend

    decided = decide_backend(study, space)  # what the real run decides at its start (one backend for every engine)
    if decided.line:
        print(decided.line)
        print("\n".join(argv_report(decided, sampled, study.output_path())))


def resume_command(argv: Sequence[str]) -> str:
    """The command that continues this study: the same arguments plus --resume (shell-quoted)."""
    return shlex.join(["python", "-m", "pipeline.tune", *(a for a in argv if a != "--resume"), "--resume"])


def quiet_libraries(study: StudyConfig | None = None) -> None:
    """Process-wide settings for a command-line run; a library call (run_study) leaves them to its caller. Each
    turns off a library's own output at its source (no stdout filtering); a setting the user's environment already
    has is kept."""
    import optuna

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a progress bar per downloaded config
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # one line per trial, doubling ours
    # Ray Tune's output engine prints an experiment table, a results path and a TensorBoard hint even at verbose=0;
    # its classic engine at verbose=0 prints nothing (our progress callback prints the trials).
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    # No automatic Tune loggers: the driver names the CSV and JSON ones, and the TensorBoard one is not wanted.
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    if study is not None and study.ray.address is None:
        # A new local Ray: token authentication, which Ray 2.60 turns on by default for one with a warning to set
        # the mode; set, it is the same mode without the warning. (Joining a cluster keeps the user's mode.)
        if "RAY_AUTH_MODE" not in os.environ:
            os.environ["RAY_AUTH_MODE"] = "token"
            ray_settings_reread()
    # "Creating initial MLflow database tables..." on a new study's store
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)


def ray_settings_reread() -> None:
    """Make a Ray imported before the environment was set read it again. Ray reads RAY_AUTH_MODE into its settings
    once, when `ray._raylet` loads; the GCS a local `ray.init` starts reads the environment itself. A driver that had
    imported Ray earlier (any module on the way may) would start a GCS that demands a token and then never send one
    ("Failed to start GCS"). This is what Ray does itself when it turns token mode on (`_enable_token_auth`)."""
    raylet = sys.modules.get("ray._raylet")
    if raylet is not None:
        raylet.Config.initialize("")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        study = load_study(args.study, overrides_from_args(args))
        space = load_space(study.search_space_path())
        check_study(study, space)  # what can be checked before Ray starts or a file is written (a dry run too)
        quiet_libraries(study)
        if args.dry_run:
            dry_run(study, space, args.samples)
            return 0
        from pipeline.study.driver import run_study  # heavy imports (Ray, MLflow) only for a real run
        from pipeline.trial.replicas import serve_api

        serve_api()  # Serve's client quieted before the driver's first deploy
        return run_study(study, space, resume=args.resume, resume_command=resume_command(argv))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
