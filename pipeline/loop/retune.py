"""`python -m pipeline.retune --endpoint URL --tracking-uri URI`: re-tune on production's own traffic.

1. Ask the endpoint what it serves (`/v1/config`: registered model, version, serving config).
2. Take the traffic capture since that version was promoted (`promoted_at_ms` in the registry): a local capture
   directory or file (`--capture`), else the endpoint's `/v1/capture` routes (`serve.closed_loop.control`).
3. Split it (`pipeline.loop.split`): measurement and warm-up prompts written as a workload file, the rest as an
   external corpus, no measured answer in the corpus.
4. Run a study on it (`pipeline.study.driver.run_study`, the `--study` file's settings, model and engine as
   production runs them) with production's config enqueued beside the baseline (`pipeline.loop.seed`); a corpus
   choice `capture` in the search space becomes the capture's corpus.
5. Register the study's result as alias `candidate` (`tracking.alias: candidate`): production is not touched; the
   canary (`python -m pipeline.loop`) or a person (`python -m pipeline.promote --set-version N`) promotes it.
Files (user data: 0700 folder, 0600 files): `<output>/capture/{parts/, workload.parquet, corpus.jsonl,
split.json}`, the study's own files beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field

from pipeline.cli_common import add_version, env_tracking_uri, program
from pipeline.errors import PipelineError, UserError
from pipeline.loop.client import EndpointClient
from pipeline.loop.shift import ShiftSettings, TextShift, text_shift
from pipeline.loop.split import (SplitReport, guard_corpus, prompt_text, read_capture, split_capture, workload_rows,
                                 write_workload)
from pipeline.trial.corpus import corpus_documents
from pipeline.workloads import read_prompts, WorkloadError
from serve.engines.base import corpus_jsonl
from serve.serving import ServingConfig
from serve.spec import FrozenModel

__all__ = ["RetuneOptions", "RetuneResult", "retune", "same_config", "main"]


class RetuneOptions(FrozenModel):
    tracking_uri: str = Field(description="MLflow tracking URI of production's registry")
    endpoint: str | None = Field(None, description="production endpoint base URL")
    api_key: str | None = None
    registered_model: str | None = Field(None, description="None = the endpoint's")
    study: str | None = Field(None, description="study file for the re-tune's settings (search space, budget, "
                                                "levels, policy, engine); model and engine kind follow production")
    capture: str | None = Field(None, description="capture directory or merged file; None = from the endpoint")
    since_ms: int | None = Field(None, description="None = when production's version was promoted")
    all_capture: bool = Field(False, description="use every captured row, not only those since the promotion")
    output: str | None = None
    name: str | None = None
    trials: int | None = Field(None, ge=1)
    measure_prompts: int | None = Field(None, ge=1, description="None = max(the study's, 16)")
    warmup_prompts: int | None = Field(None, ge=0)
    seed: int | None = None
    resume: bool = False
    overrides: dict[str, Any] = Field(default_factory=dict, description="further dotted study keys")


class RetuneResult(FrozenModel):
    registered_model: str
    production_version: str
    candidate_version: str | None
    same_as_production: bool
    study: str
    output: str
    split: SplitReport
    seeded: dict[str, Any]
    mismatches: tuple[str, ...]
    text_shift: TextShift | None = Field(None, description="the capture's text against the workload production was "
                                                           "tuned on (None: that workload is not readable here)")


def same_config(a: Any, b: Any) -> bool:
    """Whether two serving configs run the same engines (provenance and shipped documents' bytes aside: a corpus's
    file name is content-addressed, so a different corpus is a different config)."""
    def key(s: Any) -> Any:
        policy = s.policy
        return (s.replica.model_dump(exclude={"corpus_documents"}),
                None if policy is None or policy.high is None else
                (policy.switch_above, policy.high.model_dump(exclude={"corpus_documents"})))
    return bool(key(a) == key(b))


def _production(opts: RetuneOptions, tracker: Any) -> tuple[str, str, Any]:
    """(registered model, version, ServingConfig) production serves."""
    # lazy: keeps `python -m pipeline.retune --help` light (FastAPI, pyarrow)
    from pipeline.records.registry import PRODUCTION, alias_version, load_serving_config

    name, version = opts.registered_model, None
    if opts.endpoint:
        config = EndpointClient(opts.endpoint, opts.api_key).config()
        name = name or (config.get("origin") or {}).get("registered_model")
        version = None if config.get("version") is None else str(config["version"])
    if not name:
        raise PipelineError("which registered model? the endpoint serves none from the registry; give "
                            "--registered-model")
    registered = alias_version(tracker, name, PRODUCTION)
    if version is None:
        version = registered
    if version is None:
        raise PipelineError(f"registered model '{name}' has no alias '{PRODUCTION}': nothing to re-tune from")
    if registered is not None and registered != version:
        print(f"note: the endpoint serves version {version}, alias {PRODUCTION} points at {registered} (a roll in "
              f"progress?); re-tuning from the served version {version}", flush=True)
    serving = load_serving_config(tracker.tracking_uri, f"models:/{name}/{version}")
    return name, version, ServingConfig.model_validate(serving.model_dump())


def _capture_rows(opts: RetuneOptions, folder: Path) -> list[dict[str, Any]]:
    # lazy: keeps `python -m pipeline.retune --help` light (FastAPI)
    from serve.closed_loop.capture import make_private_dir, write_private

    if opts.capture:
        return read_capture(opts.capture)
    if not opts.endpoint:
        raise PipelineError("no capture: give --capture DIR (the endpoint's capture directory) or --endpoint URL")

    client = EndpointClient(opts.endpoint, opts.api_key)
    parts = folder / "parts"
    make_private_dir(parts)
    for part in client.capture_listing().parts:
        data = client.capture_part(part.name)
        write_private(lambda handle, data=data: handle.write(data), parts / part.name)
    return read_capture(parts)


def _write_corpus(rows: Sequence[dict[str, Any]], answers: Sequence[str], folder: Path, target: str) -> str | None:
    """The corpus rows as the engine's corpus file (chat rendered with the target's template), guarded again after
    rendering; None when nothing is left."""
    # lazy: keeps `python -m pipeline.retune --help` light (FastAPI, pyarrow)
    from pipeline.measure.load import target_tokenizer
    from serve.closed_loop.capture import write_private

    if not rows:
        return None
    source = write_workload(rows, folder / "corpus_rows.parquet", with_output=True)
    prompts, _ = read_prompts(source)
    tokenizer = target_tokenizer(target) if any(p.messages for p in prompts) else None
    docs = corpus_documents(prompts, tokenizer)
    kept, _ = guard_corpus(docs, answers)
    source.unlink()
    if not kept:
        return None
    path = folder / "corpus.jsonl"
    write_private(lambda handle: handle.write(corpus_jsonl([docs[i] for i in kept])), path)
    return str(path.resolve())


def _text_shift(workload: str, rows: Sequence[dict[str, Any]]) -> TextShift | None:
    try:
        prompts, _ = read_prompts(workload)
    except (WorkloadError, OSError):
        return None
    return text_shift([p.text for p in prompts], [prompt_text(r) for r in rows], ShiftSettings())


def retune(opts: RetuneOptions) -> RetuneResult:
    """Steps 1-5 of the module docstring; returns what was registered."""
    # lazy: keeps `python -m pipeline.retune --help` light (FastAPI, Jinja2, pyarrow)
    from pipeline.config import load_study
    from pipeline.loop.seed import SEEDED_ATTR, production_point, seed_study, with_capture_corpus
    from pipeline.records.registry import production_since_ms, tag_version
    from pipeline.records.tracking import Tracker
    from pipeline.search.space import load_space
    from pipeline.study.driver import run_study
    from serve.closed_loop.capture import make_private_dir, write_private

    registry = Tracker(opts.tracking_uri, "retune")
    name, version, serving = _production(opts, registry)
    base = load_study(opts.study, {})
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    study_name = opts.name or f"retune-v{version}-{stamp}"
    out = Path(opts.output or Path.cwd() / "runs" / study_name).resolve()
    capture_dir = out / "capture"
    if opts.resume and (out / "retune.json").exists():  # it finished; its caller died before reading the result
        return RetuneResult.model_validate_json((out / "retune.json").read_text())
    make_private_dir(out)
    make_private_dir(capture_dir)
    since = None if opts.all_capture else (opts.since_ms if opts.since_ms is not None
                                           else production_since_ms(registry, name))
    seed = base.seed if opts.seed is None else opts.seed
    n_measure = opts.measure_prompts or max(base.workload.measure_prompts, 16)
    n_warmup = base.workload.warmup_prompts if opts.warmup_prompts is None else opts.warmup_prompts
    workload, corpus_file = capture_dir / "workload.parquet", capture_dir / "corpus.jsonl"
    shifted: TextShift | None = None
    if opts.resume and (capture_dir / "split.json").exists() and workload.exists():
        # the study measures what it measured before: the capture has grown since, a new split would be a new study
        report = SplitReport.model_validate_json((capture_dir / "split.json").read_text())
        corpus = str(corpus_file.resolve()) if corpus_file.exists() else None
        if (out / "study.yaml").exists():
            study_name = opts.name or str(yaml.safe_load((out / "study.yaml").read_text()).get("name") or study_name)
    else:
        try:
            split = split_capture(_capture_rows(opts, capture_dir), n_measure=n_measure, n_warmup=n_warmup,
                                  seed=seed, since_ms=since)
        except ValueError as exc:
            raise PipelineError(str(exc)) from None
        report = split.report
        shifted = _text_shift(serving.provenance.workload, [*split.measure, *split.warmup, *split.corpus])
        write_workload(workload_rows(split, seed), workload)
        corpus = _write_corpus(split.corpus, split.measured_answers, capture_dir, serving.replica.model)
        write_private(lambda h: h.write(report.model_dump_json(indent=2).encode()), capture_dir / "split.json")
    print(report.text, flush=True)
    if shifted is not None:
        print(f"capture vs the workload production was tuned on ({serving.provenance.workload}): {shifted.text}",
              flush=True)
    overrides = {"name": study_name, "output_dir": str(out), "seed": seed, "workload.source": str(workload),
                 "workload.measure_prompts": report.measure, "workload.warmup_prompts": report.warmup,
                 "model.target": serving.replica.model, "engine.kind": serving.replica.engine,
                 "tracking.uri": opts.tracking_uri, "tracking.registered_model": name, "tracking.alias": "candidate",
                 **({"budget.max_trials": opts.trials} if opts.trials else {}), **opts.overrides}
    study = load_study(opts.study, overrides)
    space = with_capture_corpus(load_space(study.search_space_path()), corpus)
    point, mismatches = production_point(space, serving, study, corpus)
    for line in mismatches:
        print(f"note: seeding production's config: {line}", flush=True)
    storage = study.storage.url or f"sqlite:///{out / 'optuna.db'}"
    seed_study(study, space, storage, point, f"production version {version}")
    code = run_study(study, space, resume=opts.resume,
                     resume_command=f"python -m pipeline.retune ... --output {out} --resume")
    if code != 0:
        raise PipelineError(f"the re-tune study ended with exit code {code}; see its output in {out}")
    promoted = yaml.safe_load((out / "promoted.yaml").read_text())
    candidate = promoted.get("version")

    chosen = ServingConfig.model_validate({k: v for k, v in promoted.items() if k in ServingConfig.model_fields})
    same = same_config(chosen, serving)
    if candidate:
        tag_version(registry, name, str(candidate), {
            "retune_of": version, "capture_rows": str(report.measure + report.warmup + report.corpus),
            "capture_since_ms": str(since), "same_as_production": str(same).lower(), SEEDED_ATTR: str(bool(point))})
    result = RetuneResult(registered_model=name, production_version=version,
                          candidate_version=None if candidate is None else str(candidate), same_as_production=same,
                          study=study.name, output=str(out), split=report, seeded=point,
                          mismatches=tuple(mismatches), text_shift=shifted)
    write_private(lambda h: h.write(result.model_dump_json(indent=2).encode()), out / "retune.json")
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=program("specdec-retune", "pipeline.retune"),
        description="Re-tune on production's captured traffic since the last promotion, production's config "
                    "enqueued beside the baseline; the result is registered as alias 'candidate' (production is "
                    "not touched). See docs/loop.md.")
    parser.add_argument("--endpoint", help="production endpoint base URL (what it serves; its capture, unless "
                                           "--capture)")
    add_version(parser)
    uri = env_tracking_uri()
    parser.add_argument("--tracking-uri", required=uri is None, default=uri,
                        help="MLflow tracking URI of production's registry (default: $MLFLOW_TRACKING_URI)")
    parser.add_argument("--registered-model", help="registry name (default: the endpoint's)")
    parser.add_argument("--api-key", help="admin key for the endpoint (default: $SPECDEC_ADMIN_KEY)")
    parser.add_argument("--study", metavar="FILE", help="study file with the re-tune's settings")
    parser.add_argument("--capture", metavar="PATH", help="capture directory (serve.closed_loop.capture) or merged file")
    since = parser.add_mutually_exclusive_group()
    since.add_argument("--since-ms", type=int, help="use rows answered from this unix ms (default: the promotion)")
    since.add_argument("--all-capture", action="store_true", help="use every captured row")
    parser.add_argument("--output", help="output folder (default ./runs/<name>)")
    parser.add_argument("--name", help="study name (default retune-v<version>-<UTC time>)")
    parser.add_argument("--trials", type=int, help="trials including the baseline and production's config")
    parser.add_argument("--measure-prompts", type=int, help="measured prompts (default max(the study's, 16))")
    parser.add_argument("--warmup-prompts", type=int, help="warm-up prompts (default the study's)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--resume", action="store_true", help="continue the study in --output")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                        help="override a study key (value parsed as YAML), e.g. --set budget.max_trials=6")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    overrides: dict[str, Any] = {}
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            print(f"error: --set {item!r}: expected KEY=VALUE", file=sys.stderr)
            return 2
        overrides[key.strip()] = yaml.safe_load(raw)
    try:
        opts = RetuneOptions(tracking_uri=args.tracking_uri, endpoint=args.endpoint,
                             api_key=args.api_key or os.environ.get("SPECDEC_ADMIN_KEY"),
                             registered_model=args.registered_model, study=args.study, capture=args.capture,
                             since_ms=args.since_ms, all_capture=args.all_capture, output=args.output,
                             name=args.name, trials=args.trials, measure_prompts=args.measure_prompts,
                             warmup_prompts=args.warmup_prompts, seed=args.seed, resume=args.resume,
                             overrides=overrides)
        result = retune(opts)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if result.candidate_version is None:
        print(f"nothing registered (see {result.output})")
    else:
        what = "the same config as production (its figures on the new traffic)" if result.same_as_production else \
            "a new config"
        print(f"{result.registered_model} version {result.candidate_version} is alias 'candidate': {what}; "
              f"production stays at version {result.production_version}")
    print(json.dumps({"candidate": result.candidate_version, "same_as_production": result.same_as_production}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
