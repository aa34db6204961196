"""What simulate-first's draft replay costs for a study's workload, against the target's measure phase.

On this machine, with the default study's workload (templated, seed 0, 4 measured prompts x 24 tokens) and the
engine's settings (dtype float32, weights auto, every core unless --threads):
- the target's measure phase: the measured split decoded plain and greedy by the CPU engine in process (its
  scheduler, closed loop at concurrency 1, after one unmeasured pass over the same prompts). This is the engine's
  own time without HTTP, the load generator or Serve, so a launch's measured `time_measure_s` is at least this:
  the ratio below is conservative;
- the draft replay exactly as simulate-first runs it (`pipeline.search.draft_replay.run_draft_replay`: a child
  process that loads the draft, replays it over the baseline's measured answers for every topk and the deepest
  num_steps of the space, and reads its step curve from the probe cache): its replay seconds (model load excluded),
  and the child process's total.
Each --runs times, alternating; prints medians and ranges. The draft replay's answers are the in-process baseline's.

    python benchmarks/draft_replay_cost.py [--draft smollm2-135m] [--target ID] [--space standalone] [--runs 3]
        [--threads N]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.config import load_study  # noqa: E402
from pipeline.search.draft_replay import draft_plan, run_draft_replay  # noqa: E402
from pipeline.search.space import load_space  # noqa: E402
from pipeline.simulate.replay import Answer  # noqa: E402
from pipeline.study.driver import workload_requests  # noqa: E402


def measure_phase(study, prompts: list[list[int]], max_new_tokens: list[int]) -> tuple[float, list[list[int]]]:
    """Seconds the CPU engine's scheduler takes for the prompts one after the other (closed loop, concurrency 1),
    and the outputs."""
    import torch

    from serve.engines.cpu.convert import load_tokenizer
    from serve.engines.cpu.decode import Decoder, Request, StopRules
    from serve.engines.cpu.engine import eos_ids_of
    from serve.model_store import resolve_model
    from serve.engines.cpu.runner import ModelRunner
    from serve.engines.cpu.scheduler import Scheduler
    from serve.engines.cpu.verify import Sampling

    if study.engine.threads:
        torch.set_num_threads(study.engine.threads)
    model_dir = resolve_model(study.model.target)
    runner = ModelRunner.from_dir(model_dir, study.model.dtype, study.engine.weights)
    tokenizer = load_tokenizer(model_dir)
    eos = eos_ids_of(runner.model, tokenizer)
    outputs: list[list[int]] = []
    done = threading.Event()
    scheduler = Scheduler(Decoder(runner, tokenizer, None), max_running_requests=48)
    scheduler.start()

    def send(i: int) -> None:
        request = Request(rid=str(i), prompt_ids=list(prompts[i]), sampling=Sampling(temperature=0.0),
                          rules=StopRules(max_new_tokens=max_new_tokens[i], eos_ids=eos), seed=0)
        scheduler.submit(request, functools.partial(finished, i))

    def finished(i: int, req, error) -> None:
        if error is not None or req.finished:
            outputs.append(list(req.output_ids))
            if i + 1 < len(prompts):
                send(i + 1)
            else:
                done.set()

    try:
        for attempt in range(2):  # the first pass warms the allocator and the kernel
            outputs.clear()
            done.clear()
            started = time.perf_counter()
            send(0)
            if not done.wait(600):
                raise RuntimeError("the measure phase did not finish in 600 s")
            seconds = time.perf_counter() - started
    finally:
        scheduler.stop()
    return seconds, outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draft", default="smollm2-135m", help="model.drafts.standalone")
    parser.add_argument("--target", default=None, help="model.target (default: the default study's)")
    parser.add_argument("--space", default="standalone", help="search space (its STANDALONE topks and steps)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="engine.threads (default: every core)")
    args = parser.parse_args()
    overrides = {"search_space": args.space, "model.drafts": {"standalone": args.draft}}
    if args.threads:
        overrides["engine.threads"] = args.threads
    if args.target:
        overrides["model.target"] = args.target
    study = load_study(None, overrides)
    space = load_space(study.search_space_path())
    (model, (steps, topks)), = draft_plan(space, study).items()
    _, measure = workload_requests(study, prompt_ids=True)
    prompts = [list(m.prompt_ids or m.input_ids or ()) for m in measure]
    phases, replays, totals = [], [], []
    answers: list[Answer] = []
    for run in range(args.runs):
        seconds, outputs = measure_phase(study, prompts, [m.max_new_tokens for m in measure])
        phases.append(seconds)
        answers = [Answer(tuple(p), tuple(o)) for p, o in zip(prompts, outputs)]
        result = run_draft_replay(study, model, answers, steps, topks)
        replays.append(result.tables.seconds)
        totals.append(result.total_s)
        print(f"run {run}: measure phase {seconds:.2f} s, draft replay {result.tables.seconds:.2f} s "
              f"({result.total_s:.2f} s with the model load) {result.summary['forwards']}", flush=True)

    def line(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"

    tokens = sum(len(a.output_ids) for a in answers)
    print(f"draft {model}, target {study.model.target}, topks {list(topks)}, up to {steps} steps; "
          f"{len(prompts)} measured prompts ({sum(map(len, prompts))} prompt tokens, {tokens} output tokens); "
          f"threads {study.engine.threads or 'all'}; {args.runs} runs")
    print(f"target measure phase (engine in process, plain): {line(phases)}")
    print(f"draft replay: {line(replays)}; with the model load: {line(totals)}")
    print(f"replay / measure phase: {statistics.median(replays) / statistics.median(phases):.0%} "
          f"(with the load {statistics.median(totals) / statistics.median(phases):.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
