"""Baseline vs a speculative config on the CPU engine at several client concurrency levels: where does the speed-up
vanish? Not a test: numbers depend on the machine and on what else runs on it (the load average is printed).

    python benchmarks/levels.py                        # the default study's last winner at 1, 2, 4, 8; 3 runs each
    python benchmarks/levels.py --from runs/default/promoted.yaml --runs 5
    python benchmarks/levels.py --spec '{algorithm: ngram, match_type: BFS, num_draft_tokens: 8}' --levels 1,4

Two real engine servers (`python -m serve.engines.cpu`, started under the engines' watchdog as a replica starts
them): the baseline and the speculative config. Per run and level each server is flushed (`/flush_cache`: the n-gram
trie starts empty, as on a trial's fresh replica), warmed up with --warmup-requests of the default workload's warm-up
split at that level, then measured closed loop at that level on the measurement split (`pipeline.measure.load.run_phase`,
the study's load generator; `pipeline.measure.summary.summarize`, the study's figures). Runs alternate baseline, spec,
baseline, spec, ... so drift of a shared machine hits both alike. The tables give medians over --runs; speed-up =
median spec tok/s / median baseline tok/s, and the range of the per-run (paired) ratios.

Workload: the default study's (`templated`, seed 0, 24 new tokens, warm-up split of 8) except the measured prompts:
--measure-prompts (default 16, twice the highest level) so that every level really has that many requests in flight.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import yaml  # noqa: E402

from pipeline.config import StudyConfig, TrialConfig, validate_trial  # noqa: E402
from pipeline.measure.load import LoadRequest, requests_of, run_phase  # noqa: E402
from pipeline.measure.summary import Summary, summarize  # noqa: E402
from pipeline.workloads import load_workload  # noqa: E402
from serve.engines.base import ReplicaConfig, child_env  # noqa: E402
from serve.engines.cpu.adapter import CpuEngine  # noqa: E402
from serve.ports import free_port  # noqa: E402
from serve.replica.deployment import stop_group  # noqa: E402
from serve.spec import SpecConfig  # noqa: E402

# A big-tree NGRAM config (12 draft tokens), where the cost of verifying shows first; docs/benchmarks.md "Levels".
DEFAULT_SPEC = "{algorithm: ngram, match_type: PROB, num_draft_tokens: 12, max_bfs_breadth: 4}"
SIDES = ("baseline", "spec")


def parse_spec(text: str) -> SpecConfig:
    """A `spec:` mapping as a trial config or search-space winner writes it (YAML/JSON), validated."""
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"--spec must be a mapping such as {DEFAULT_SPEC!r}, got {text!r}")
    return TrialConfig.model_validate({"spec": data}).spec


def spec_from_file(path: Path) -> SpecConfig:
    """The first `spec` mapping with an `algorithm` in a promoted.yaml, serving_config.json or trial_config.json."""
    def find(node: Any) -> dict[str, Any] | None:
        if isinstance(node, dict):
            if isinstance(node.get("spec"), dict) and "algorithm" in node["spec"]:
                return node["spec"]
            for value in node.values():
                if (found := find(value)) is not None:
                    return found
        return None

    spec = find(yaml.safe_load(path.read_text()))
    if spec is None:
        raise ValueError(f"--from {path}: no `spec:` mapping with an `algorithm` in it (expected a promoted.yaml, "
                         "deploy/serving_config.json or a trial's trial_config.json)")
    return TrialConfig.model_validate({"spec": spec}).spec


@contextlib.contextmanager
def engine(spec: SpecConfig, args: argparse.Namespace, log_path: Path) -> Iterator[str]:
    """A CPU engine server for `spec`, with the command line a trial's replica would give it; stopped after."""
    port = free_port()
    config = ReplicaConfig(engine="cpu", model=args.model, dtype=args.dtype, spec=spec, threads=args.threads)
    argv = [sys.executable, "-m", "serve.engines.watchdog", "--", *CpuEngine().argv(config, "127.0.0.1", port)]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, env=child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + args.start_timeout
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"engine exited with {proc.returncode} before /health; log: {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"engine not healthy after {args.start_timeout:.0f} s; log: {log_path}")
            time.sleep(0.5)  # polling a condition with a deadline
        yield url
    finally:
        stop_group(proc, 20.0)


def flush(url: str) -> None:
    """Empty the n-gram trie and the counters (refused while busy: wait for idle, as a trial does)."""
    for _ in range(24):
        if httpx.post(f"{url}/flush_cache", params={"timeout": 5.0}, timeout=40).status_code == 200:
            return
    raise SystemExit(f"{url}/flush_cache refused for 2 minutes")


def measure(url: str, level: int, warm: list[LoadRequest], items: list[LoadRequest], timeout_s: float) -> dict:
    flush(url)
    kwargs = dict(concurrency=level, temperature=0.0, timeout_s=timeout_s)
    if warm:
        run_phase(url, warm, phase="warmup", **kwargs)
    records = run_phase(url, items, phase="measure", **kwargs)
    failed = [r for r in records if r.error]
    if failed:
        raise SystemExit(f"{len(failed)} of {len(records)} requests failed at concurrency {level}: {failed[0].error}")
    summary: Summary = summarize(records, seed=0)
    return {**summary.model_dump(), "outputs": [r.output_sha1 for r in records]}


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(results: dict[int, dict[str, list[dict]]]) -> tuple[list[str], int | None]:
    """Markdown rows per level, and the first level where the median speed-up is <= 1 (None: it never vanished)."""
    rows = ["| concurrency | baseline tok/s | spec tok/s | speed-up | per-run speed-ups | accept length | "
            "TTFT p50 ms (base / spec) | ITL p50 ms (base / spec) | identical outputs |",
            "|---|---|---|---|---|---|---|---|---|"]
    vanished = None
    for level, sides in results.items():
        base, spec = sides["baseline"], sides["spec"]
        b, s = median([r["tput_tok_s"] for r in base]), median([r["tput_tok_s"] for r in spec])
        ratio = s / b if b and s is not None else None
        paired = sorted(x["tput_tok_s"] / y["tput_tok_s"] for x, y in zip(spec, base) if y["tput_tok_s"])
        same = sum(a == c for x, y in zip(spec, base) for a, c in zip(x["outputs"], y["outputs"]))
        total = sum(len(x["outputs"]) for x in spec)
        if vanished is None and ratio is not None and ratio <= 1.0:
            vanished = level
        rows.append(
            f"| {level} | {fmt(b, 1)} | {fmt(s, 1)} | {fmt(ratio)}x | "
            f"{fmt(paired[0]) if paired else '-'}-{fmt(paired[-1]) if paired else '-'} | "
            f"{fmt(median([r['accept_len'] for r in spec]))} | "
            f"{fmt(median([r['ttft_p50_ms'] for r in base]), 0)} / {fmt(median([r['ttft_p50_ms'] for r in spec]), 0)} | "
            f"{fmt(median([r['itl_p50_ms'] for r in base]), 0)} / {fmt(median([r['itl_p50_ms'] for r in spec]), 0)} | "
            f"{same}/{total} |")
    return rows, vanished


def main(argv: list[str] | None = None) -> int:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog=doc.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", default=DEFAULT_SPEC, help="the speculative config, a `spec:` mapping (YAML/JSON; "
                   f"default: the default study's last winner {DEFAULT_SPEC})")
    p.add_argument("--from", dest="from_file", type=Path, default=None,
                   help="take the spec from a promoted.yaml, deploy/serving_config.json or trial_config.json instead")
    p.add_argument("--levels", default="1,2,4,8", help="client concurrency levels, comma-separated (default 1,2,4,8)")
    p.add_argument("--runs", type=int, default=3, help="runs per side and level; medians reported (default 3)")
    p.add_argument("--measure-prompts", type=int, default=16, help="measured requests per run (>= highest level)")
    p.add_argument("--warmup-requests", type=int, default=8, help="warm-up requests per run, both sides (the "
                   "default space's NGRAM default; the trie is flushed before each warm-up)")
    p.add_argument("--max-new-tokens", type=int, default=StudyConfig().workload.max_new_tokens)
    p.add_argument("--workload", default=StudyConfig().workload.source, help="bundled workload or file")
    p.add_argument("--model", default=StudyConfig().model.target)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--threads", type=int, default=None, help="engine torch threads (default: all cores)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for an engine to answer /health")
    p.add_argument("--json", type=Path, default=None, help="also write every run's figures here")
    args = p.parse_args(argv)
    try:
        levels = [int(x) for x in args.levels.split(",")]
        spec = spec_from_file(args.from_file) if args.from_file else parse_spec(args.spec)
    except (ValueError, OSError, yaml.YAMLError) as exc:
        p.error(f"{type(exc).__name__}: {exc}")
    if any(level < 1 for level in levels) or len(set(levels)) != len(levels):
        p.error(f"--levels must be distinct integers >= 1, got {args.levels!r}")
    if spec.algorithm == "none":
        p.error("--spec: give a speculative config (the baseline is measured anyway)")
    violations = validate_trial(TrialConfig(spec=spec), "cpu")
    if violations:
        p.error("the spec cannot run on the CPU engine: " + "; ".join(str(v) for v in violations))
    if args.runs < 1 or args.measure_prompts < max(levels):
        p.error(f"--runs must be >= 1 and --measure-prompts >= the highest level ({max(levels)}) so that every "
                f"level has that many requests in flight; got --runs {args.runs}, --measure-prompts "
                f"{args.measure_prompts}")

    study = StudyConfig()
    workload = load_workload(args.workload, seed=study.seed, n_warmup=study.workload.warmup_prompts,
                             n_measure=args.measure_prompts, max_new_tokens=args.max_new_tokens)
    warm_split, items = list(requests_of(workload.warmup, args.model)), list(requests_of(workload.measure, args.model))
    warm = [warm_split[i % len(warm_split)] for i in range(args.warmup_requests)] if warm_split else []
    timeout_s = study.engine.request_timeout_s
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"levels-bench-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    print("# Concurrency levels: baseline vs speculation on the CPU engine\n\n"
          f"- command: `python benchmarks/levels.py{(' ' + command) if command else ''}`")
    print(f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}; engine "
          f"threads {args.threads or 'all'}")
    print(f"- spec: {json.dumps(spec.model_dump(mode='json'), sort_keys=True)}")
    print(f"- workload: {args.workload}, {len(items)} measured x {args.max_new_tokens} tokens, {len(warm)} warm-up "
          f"requests per run (flushed trie first), greedy; levels {levels}; {args.runs} run(s) per side and level, "
          f"alternating baseline/spec; engine logs in {logs}" + "".join(f"\n- note: {n}" for n in workload.notes)
          + "\n", flush=True)

    results: dict[int, dict[str, list[dict]]] = {level: {side: [] for side in SIDES} for level in levels}
    specs = {"baseline": TrialConfig().spec, "spec": spec}
    with engine(specs["baseline"], args, logs / "baseline.log") as base_url, \
            engine(specs["spec"], args, logs / "spec.log") as spec_url:
        urls = {"baseline": base_url, "spec": spec_url}
        for run in range(args.runs):
            for level in levels:
                for side in SIDES:
                    got = measure(urls[side], level, warm, items, timeout_s)
                    results[level][side].append(got)
                    print(f"  run {run + 1}/{args.runs} concurrency {level} {side}: {got['tput_tok_s']:.2f} tok/s"
                          + (f", accept {got['accept_len']:.2f}" if got["accept_len"] else ""),
                          file=sys.stderr, flush=True)
    rows, vanished = table(results)
    print("\n".join(rows))
    print("\nspeed-up " + (f"vanishes at concurrency {vanished} (first level with a median speed-up <= 1.00)"
                           if vanished is not None else f"holds at every measured level (up to {max(levels)})"))
    load = os.getloadavg()
    print(f"\nload average at the end (1/5/15 min): {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json), "from_file": str(
            args.from_file)}, "results": results}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
