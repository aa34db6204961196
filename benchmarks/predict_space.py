"""How long simulate-first's one-off prediction of a space takes, for every bundled space the simulator can predict
without a model, on every bundled workload: what `SimulateFirstPlan._build` runs after the baseline (the simulator
built on the baseline's answers, the cost model fitted to it, `simulated.explore` over the space), timed, with the
count of configs predicted against the space's valid points (a space past `search.simulate.points` is predicted
whole, by replay class: pipeline/search/whole_space.py) and whether the time cap (`search.simulate.seconds`) stopped
it.

The baseline is synthetic (`synthetic_baseline`): each prompt's words hashed to token ids, and an answer that copies a
stretch of its prompt with every seventh token changed (copy-heavy, as an edit is): no model or engine is needed, and
the replay does the work a recorded baseline gives it. Timing only: the figures predicted are not a claim about any
engine. Spaces whose configs need a draft model's replay (STANDALONE) or an EAGLE head are listed as skipped.

    python benchmarks/predict_space.py                                    # every space x workload, a table
    python benchmarks/predict_space.py --runs 3                           # each 3 times in fresh processes
    python benchmarks/predict_space.py --spaces ngram --workloads code-edit --measure-prompts 15
    python benchmarks/predict_space.py --spaces ngram --workloads code-edit --profile 30   # cProfile, top 30
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pipeline.config import StudyConfig, load_study  # noqa: E402
from pipeline.measure.load import LoadRequest  # noqa: E402
from pipeline.measure.summary import RequestRecord  # noqa: E402
from pipeline.search.simulated import Explored, explore  # noqa: E402
from pipeline.search.space import SearchSpace, baseline_point, grid_points, load_space, resolve  # noqa: E402
from pipeline.search.strategy import resolve_strategy  # noqa: E402
from pipeline.search.whole_space import explore_whole  # noqa: E402
from pipeline.simulate.simulator import Simulator, base_cost  # noqa: E402
from pipeline.simulate.workload import answers_of  # noqa: E402
from pipeline.workloads import BUNDLED_WORKLOADS, load_workload  # noqa: E402

__all__ = ["SPACE_ENGINES", "Row", "predict_space", "space_size", "synthetic_baseline"]

# the engine each bundled space runs on in a study (llama.cpp's n-gram types are its own algorithms)
SPACE_ENGINES = {"llama-cpp-ngram-simple": "llama_cpp", "llama-cpp-ngram": "llama_cpp", "llama-cpp-draft": "llama_cpp"}


def tokenize(text: str) -> tuple[int, ...]:
    """Words and punctuation hashed to ids: a stand-in for a tokenizer (repeats in the text repeat in the ids)."""
    out: list[int] = []
    word = ""
    for ch in text:
        if ch.isalnum() or ch == "_":
            word += ch
            continue
        if word:
            out.append(zlib.crc32(word.encode()) % 49_000 + 1000)
            word = ""
        if not ch.isspace():
            out.append(ord(ch) % 1000)
    if word:
        out.append(zlib.crc32(word.encode()) % 49_000 + 1000)
    return tuple(out) or (1,)


def synthetic_answer(prompt_ids: Sequence[int], tokens: int) -> tuple[int, ...]:
    """A copy of the prompt from a quarter in, every seventh token changed (the edit), `tokens` long."""
    start = len(prompt_ids) // 4
    copied = list(prompt_ids[start:]) or [1]
    return tuple(50_000 + i if i % 7 == 6 else copied[i % len(copied)] for i in range(tokens))


def synthetic_baseline(study: StudyConfig) -> tuple[tuple[LoadRequest, ...], tuple[LoadRequest, ...],
                                                    list[RequestRecord]]:
    """The study's warm-up and measurement requests (with prompt ids) and a baseline's records answering both splits
    (the warm-up split as its `reference` phase, as a simulate-first baseline records it), one request after another
    at 20 ms a token."""
    settings = study.workload
    workload = load_workload(settings.source, seed=study.seed, n_warmup=settings.warmup_prompts,
                             n_measure=settings.measure_prompts, max_new_tokens=settings.max_new_tokens)

    def requests(prompts: Sequence[Any]) -> tuple[LoadRequest, ...]:
        return tuple(LoadRequest(p.index, p.text, p.max_new_tokens, prompt_ids=tokenize(p.text)) for p in prompts)

    warmup, measure = requests(workload.warmup), requests(workload.measure)
    records: list[RequestRecord] = []
    phases: tuple[tuple[Literal["reference", "measure"], tuple[LoadRequest, ...]], ...] = (
        ("reference", warmup), ("measure", measure))
    for phase, items in phases:
        now = 0.0
        for i, item in enumerate({r.index: r for r in items}.values()):
            assert item.prompt_ids is not None
            output = synthetic_answer(item.prompt_ids, item.max_new_tokens)
            ttft = 0.05 + 0.0002 * len(item.prompt_ids)
            e2e = ttft + 0.02 * (len(output) - 1)
            records.append(RequestRecord(
                request_id=f"{phase}-{i}", phase=phase, prompt_index=item.index, concurrency=1, start_s=now,
                ttft_s=ttft, e2e_s=e2e, prompt_tokens=len(item.prompt_ids), completion_tokens=len(output),
                finish_reason="length", output_ids=output, prompt_ids=item.prompt_ids))
            now += e2e
    return warmup, measure, records


def space_size(space: SearchSpace, study: StudyConfig) -> tuple[int, str]:
    """(configs the prediction should cover, how): the space's valid speculative points when it has at most
    `search.simulate.points`, else that many TPE points."""
    limit = study.search.simulate.points
    try:
        points = grid_points(space, limit=limit)
    except Exception:  # noqa: BLE001 - too many to enumerate, or a continuous parameter: TPE
        return limit, "TPE points"
    valid = sum(1 for p in points if p.get("algorithm") != "none" and resolve(space, p, study).valid)
    return valid, "grid"


@dataclass(frozen=True)
class Row:
    space: str
    workload: str
    expected: int
    how: str
    predicted: int
    seconds: float
    cpu_s: float  # CPU time of this process and its workers: less moved by other work on a shared machine
    complete: bool
    distinct: int
    note: str = ""


def predict_space(space_name: str, workload: str, overrides: dict[str, Any] | None = None,
                  seconds: float | None = None) -> Row:
    """One space's prediction on one workload, as a simulate-first study runs it after its baseline, timed."""
    over: dict[str, Any] = {"search_space": f"{space_name}.yaml", "workload.source": workload,
                            "search.strategy": "simulate-first", "budget.max_trials": 8, **(overrides or {})}
    if space_name in SPACE_ENGINES:
        over["engine.kind"] = SPACE_ENGINES[space_name]
    if seconds is not None:
        over["search.simulate.seconds"] = seconds
    study = load_study(None, over)
    space = load_space(study.search_space_path())
    strategy = resolve_strategy(study, space)
    if not strategy.simulated:
        return Row(space_name, workload, 0, "-", 0, 0.0, 0.0, False, 0, strategy.reason.split(": ", 1)[-1])
    if "standalone" in space.algorithms:
        return Row(space_name, workload, 0, "-", 0, 0.0, 0.0, False, 0,
                   "its STANDALONE configs need their draft model's replay (a model run), not timed here")
    expected, how = space_size(space, study)
    warmup, measure, records = synthetic_baseline(study)
    started, cpu = time.perf_counter(), cpu_seconds()
    simulator = Simulator(answers_of(records), warmup, measure, arrival=study.workload.arrival, seed=study.seed,
                          lag=study.search.simulate.lag_rounds, corpora=corpora_of(warmup))
    base = base_cost(records, None, study.search_concurrency, flushed_after_warmup=simulator.flushed_after_warmup)
    baseline = resolve(space, {"algorithm": "none", **baseline_point(space)}, study).config
    cost = simulator.fitted(base, [(baseline, records)])
    settings = study.search.simulate
    predict = lambda config: simulator.predict(config, cost)  # noqa: E731
    explored: Explored = explore(space, study, predict, points=settings.points, seconds=settings.seconds,
                                 prepare=lambda configs, deadline: simulator.prepare(configs, deadline=deadline),
                                 whole=lambda start, cap: explore_whole(space, study, simulator, cost, predict, start,
                                                                        cap))
    elapsed, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    if explored.whole is not None:  # a space past `points`, predicted whole: every valid point it counted
        expected, how = explored.whole.points, "grid, by replay class"
        distinct = len(set(explored.whole.signatures().values()))  # bulk replays' own (not replayed again)
    else:
        distinct = len({simulator.signature(p.config) for p in explored.predicted})
    return Row(space_name, workload, expected, how, explored.evaluated, elapsed, cpu,
               explored.evaluated >= expected and explored.complete if how.startswith("grid")
               else elapsed < settings.seconds, distinct)


def cpu_seconds() -> float:
    """CPU time of this process and of its ended children (the simulator's replay workers)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def corpora_of(warmup: Sequence[LoadRequest]) -> Any:
    """A config's external corpus (`ngram-corpus`: the warm-up split's prompts) as a suffix automaton."""
    from serve.ngram.sam import SuffixAutomaton

    built: list[SuffixAutomaton] = []

    def corpora(trial: Any) -> tuple[SuffixAutomaton, ...]:
        if not built:
            sam = SuffixAutomaton()
            for item in {r.index: r for r in warmup}.values():
                sam.append(list(item.prompt_ids or ()))
            sam.finalize()
            built.append(sam)
        return (built[0],)

    return corpora


def fresh_runs(space: str, workload: str, runs: int, argv: Sequence[str]) -> list[Row]:
    """`runs` predictions of one space on one workload, each in a fresh process (nothing cached: the compiled trie's
    library loaded, the sequences copied, the Python caches filled as a study's process first does)."""
    out = []
    for _ in range(runs):
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--spaces", space, "--workloads",
                               workload, "--json", *argv], capture_output=True, text=True, check=True)
        out.append(Row(**json.loads(done.stdout.strip().splitlines()[-1])))
    return out


def spread(values: Sequence[float]) -> str:
    """median (min-max) of the runs; one run: its value."""
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    spaces = sorted(p.stem for p in (REPO / "search_spaces").glob("*.yaml"))
    parser.add_argument("--spaces", default=",".join(spaces), help="comma-separated bundled space names")
    parser.add_argument("--workloads", default=",".join(BUNDLED_WORKLOADS), help="comma-separated bundled workloads")
    parser.add_argument("--measure-prompts", type=int, help="workload.measure_prompts (default: the study's)")
    parser.add_argument("--max-new-tokens", type=int, help="workload.max_new_tokens (default: the study's)")
    parser.add_argument("--seconds", type=float, help="search.simulate.seconds (default: the study's cap)")
    parser.add_argument("--runs", type=int, default=1, help="fresh processes per space and workload (median, range)")
    parser.add_argument("--json", action="store_true", help="one run in this process, its Row as JSON (for --runs)")
    parser.add_argument("--profile", type=int, metavar="N", help="cProfile the run and print its top N functions")
    args = parser.parse_args()
    over: dict[str, Any] = {}
    passed: list[str] = []
    for flag, key in (("measure_prompts", "workload.measure_prompts"), ("max_new_tokens", "workload.max_new_tokens")):
        if getattr(args, flag):
            over[key] = getattr(args, flag)
            passed += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if args.seconds:
        passed += ["--seconds", str(args.seconds)]
    if args.json:
        print(json.dumps(dataclasses.asdict(predict_space(args.spaces, args.workloads, over, args.seconds))))
        return
    profiler = cProfile.Profile() if args.profile else None
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(f"- machine: {cpu}, {os.cpu_count()} CPUs (this process may use {len(os.sched_getaffinity(0))}); "
          f"synthetic copy-heavy baseline; overrides {over or 'none'}; {args.runs} run(s) each, "
          f"{'each in a fresh process, median (min-max)' if args.runs > 1 else 'in this process'}\n")
    print("| space | workload | configs (valid points) | predicted | distinct replays | wall s | CPU s | in full |\n"
          "|---|---|---|---|---|---|---|---|", flush=True)
    for space in args.spaces.split(","):
        for workload in args.workloads.split(","):
            if args.runs > 1:
                rows = fresh_runs(space, workload, args.runs, passed)
            else:
                if profiler is not None:
                    profiler.enable()
                rows = [predict_space(space, workload, over, args.seconds)]
                if profiler is not None:
                    profiler.disable()
            row = rows[0]
            if row.how == "-":
                print(f"| {space} | {workload} | not simulable: {row.note} | | | | | |", flush=True)
                continue
            full = sum(r.complete for r in rows)
            print(f"| {space} | {workload} | {row.expected:,} ({row.how}) | {row.predicted:,} | {row.distinct:,} | "
                  f"{spread([r.seconds for r in rows])} | {spread([r.cpu_s for r in rows])} | "
                  f"{'yes' if full == len(rows) else f'NO ({len(rows) - full} of {len(rows)})'} |", flush=True)
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.profile)


if __name__ == "__main__":
    main()
