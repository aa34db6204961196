"""Is the STANDALONE draft replay exact for a real draft/target pair? Request by request, at concurrency 1.

The CPU engine's real scheduler decodes the measured prompts plain (the baseline), then once per STANDALONE point
(num_steps, topk, num_draft_tokens) with the draft model speculating; every request's accepted length at every
verify step is read as the engine makes it. The draft replay (`serve.engines.cpu.draft_replay`, the draft model
alone over the baseline's answers, never the target) and the simulator's replay of those rounds must give the same
lengths. `tests/integration/test_draft_replay_exact.py` runs the same check in CI on SmolLM2-135M pairs; this
script runs it on any pair of the model store that shares a tokenizer (default: Qwen2.5-Coder 0.5B drafting for
1.5B), float32 on one thread (the replay's batched draft forwards and the engine's round forwards must round alike).

    python benchmarks/draft_replay_exact.py [--draft qwen2.5-coder-0.5b] [--target qwen2.5-coder-1.5b]
        [--prompts 3] [--tokens 16] [--points 1,1,2 2,2,5 ...] [--threads 1]

Prints one row per point (requests equal, mean accepted length, seconds) and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.search.draft_replay import tables_of  # noqa: E402
from pipeline.simulate.replay import Answer, ClosedLoop, Phase, replay  # noqa: E402
from pipeline.workloads import load_workload  # noqa: E402
from serve.spec import StandaloneSpec  # noqa: E402
from tests.engine_runs import engine_run  # noqa: E402

# steps 1-4 x topk 1-4: chains, narrow and wide trees, cut short and cut at the full tree
DEFAULT_POINTS = ["1,1,2", "2,1,3", "4,1,5", "2,2,3", "3,2,5", "2,4,6", "3,3,7", "4,4,9"]


def point(text: str) -> tuple[int, int, int]:
    try:
        steps, topk, draft_tokens = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--points: {text!r} is not steps,topk,draft_tokens (e.g. 2,2,5)") from None
    return steps, topk, draft_tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="model store id of the draft")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="model store id of the target")
    parser.add_argument("--workload", default="templated")
    parser.add_argument("--prompts", type=int, default=3, help="measured prompts (seed 0)")
    parser.add_argument("--tokens", type=int, default=16, help="max new tokens a request")
    parser.add_argument("--points", type=point, nargs="+", default=[point(p) for p in DEFAULT_POINTS],
                        help="steps,topk,draft_tokens ...")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch

    from serve.engines.cpu.convert import load_tokenizer
    from serve.engines.cpu.draft_replay import ReplayStats, replay_answers
    from serve.model_store import resolve_model
    from serve.engines.cpu.runner import ModelRunner
    from serve.engines.cpu.speculators import StandaloneSpeculator

    torch.set_num_threads(args.threads)
    target_dir, draft_dir = resolve_model(args.target), resolve_model(args.draft)
    tokenizer = load_tokenizer(target_dir)
    draft_tokenizer = load_tokenizer(draft_dir)
    work = load_workload(args.workload, seed=0, n_warmup=0, n_measure=args.prompts, max_new_tokens=args.tokens)
    prompts = [tokenizer.encode(p.text) for p in work.measure]
    if [draft_tokenizer.encode(p.text) for p in work.measure] != prompts:
        print(f"{args.draft} and {args.target} tokenize the prompts differently: not a pair", file=sys.stderr)
        return 2
    target = ModelRunner.from_dir(target_dir, "float32", "fp32")
    draft = ModelRunner.from_dir(draft_dir, "float32", "fp32")

    started = time.monotonic()
    baseline, _ = engine_run(target, tokenizer, None, [prompts], concurrency=1, max_new_tokens=args.tokens,
                             deadline_s=3600)
    baseline_s = time.monotonic() - started
    answers = [Answer(tuple(p), tuple(baseline[(0, i)])) for i, p in enumerate(prompts)]
    max_steps = max(s for s, _, _ in args.points)
    stats = ReplayStats()
    started = time.monotonic()
    ranks = replay_answers(draft, [(a.prompt_ids, a.output_ids) for a in answers],
                           sorted({k for _, k, _ in args.points}), max_steps, stats=stats)
    replay_s = time.monotonic() - started
    tables = tables_of("draft", answers, max_steps, {"answers": [{str(k): v for k, v in per.items()}
                                                                 for per in ranks]})
    print(f"draft {args.draft} -> target {args.target}; {args.workload} seed 0, {len(prompts)} prompts "
          f"({sum(map(len, prompts))} prompt tokens), {sum(len(a.output_ids) for a in answers)} output tokens; "
          f"float32, {args.threads} thread(s)")
    print(f"baseline {baseline_s:.1f} s; draft replay {replay_s:.1f} s ({stats.rounds} round trees, "
          f"{stats.tree_rows} off-path tree rows)")
    print("| steps | topk | draft tokens | outputs = baseline | requests equal | accepted length, engine | replay "
          "| engine s |")
    print("|---|---|---|---|---|---|---|---|")
    failed = False
    for steps, topk, draft_tokens in args.points:
        spec = StandaloneSpec(draft_model="draft", num_steps=steps, topk=topk, num_draft_tokens=draft_tokens)
        started = time.monotonic()
        outputs, seen = engine_run(target, tokenizer, StandaloneSpeculator(draft, steps, topk, draft_tokens),
                                   [prompts], concurrency=1, max_new_tokens=args.tokens, deadline_s=3600)
        seconds = time.monotonic() - started
        simulated = replay(spec, [Phase("measure", tuple(answers), ClosedLoop(1))], drafts=tables)
        equal = sum(r.accepted_lengths == seen[(0, r.position)] for r in simulated.requests)
        measured = [n for r in simulated.requests for n in seen[(0, r.position)]]
        predicted = [n for r in simulated.requests for n in r.accepted_lengths]
        lossless = outputs == baseline
        failed |= not lossless or equal != len(simulated.requests)
        print(f"| {steps} | {topk} | {draft_tokens} | {'yes' if lossless else 'NO'} | "
              f"{equal}/{len(simulated.requests)} | {statistics.mean(measured):.2f} | {statistics.mean(predicted):.2f} "
              f"| {seconds:.1f} |", flush=True)
    print("every request of every point equal" if not failed else "DIFFERENCES (rows above)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
