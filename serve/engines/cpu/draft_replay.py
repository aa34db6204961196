"""The draft replay: a STANDALONE draft model run over a baseline's recorded prompt and output ids, giving for every
round position of every request, and every topk, the ranks from which each (num_steps, num_draft_tokens) tree's
accepted length follows (`serve.draft.acceptance`). Never the target: under greedy decoding its tokens are the
baseline's.

Per request: one causal pass over prompt + output (the prompt and first output token in one prefill, as the
speculator's first catch-up does; the rest in chunks), whose top-k at each position expands the on-path nodes of
every round; then, step by step, one batched tree forward of the off-path nodes the trees want (each attends to the
committed tokens, the round's target tokens up to its deepest on-path ancestor, its forwarded ancestors and itself,
at the engine's positions). Forwards hold at most `max_rows` query rows (every request's wants together), by default
the GGUF kernel's limit: on `--weights gguf` a row's products then do not depend on the rows beside it
(`gguf_linear`), as in the engine's own small forwards. The expansions come from the speculator's own functions
(`speculators.log_probs`, `top_of`).

CLI (the pipeline's simulate-first runs it through `CpuEngine.draft_replay_argv`, on the driver, while no trial
runs): `python -m serve.engines.cpu.draft_replay --draft MODEL --input in.json --output out.json [--dtype ...]
[--weights ...] [--threads N]`. in.json: {"answers": [{"prompt_ids": [...], "output_ids": [...]}, ...], "topks":
[...], "max_steps": S}; out.json: {"answers": [{"<topk>": [ranks of round position j = 1..n-1]}], "draft_cost": the
draft's step curve (`probe.cached_draft_cost`), "seconds": {...}, "forwards": {...}, "draft_weights": ...}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from serve.draft.acceptance import RoundTree, Want
from serve.engines.cpu.llama import KERNEL_MAX_ROWS
from serve.engines.cpu.runner import ModelRunner, chain_visibility
from serve.engines.cpu.speculators import log_probs, top_of

__all__ = ["ReplayStats", "main", "replay_answers"]


@dataclass
class ReplayStats:
    chain_rows: int = 0  # rows of the causal passes
    tree_rows: int = 0  # off-path nodes forwarded
    forwards: int = 0  # forward calls
    rounds: int = 0  # (request, position, topk) trees built
    seconds: float = 0.0


@dataclass
class _Request:
    prompt: list[int]
    output: list[int]
    cache: Any = None
    key_positions: list[int] = field(default_factory=list)  # position of each cache column
    columns: dict[tuple[int, int], int] = field(default_factory=dict)  # (tree id, node) -> cache column
    trees: dict[int, list[RoundTree]] = field(default_factory=dict)  # topk -> tree of round position j = 1..n-1
    position: dict[int, int] = field(default_factory=dict)  # tree id -> its round position j


def replay_answers(runner: ModelRunner, answers: Sequence[tuple[Sequence[int], Sequence[int]]],
                   topks: Sequence[int], max_steps: int, max_rows: int = KERNEL_MAX_ROWS,
                   stats: ReplayStats | None = None) -> list[dict[int, list[list[list[int]]]]]:
    """For each (prompt ids, output ids): topk -> for round positions j = 1..len(output)-1 (output[:j] emitted),
    `RoundTree.ranks()` of the (max_steps, topk) tree."""
    if max_rows < 1:
        raise ValueError(f"draft replay: max_rows must be >= 1, got {max_rows}")
    stats = stats if stats is not None else ReplayStats()
    started = time.monotonic()
    requests = [_Request(list(p), list(o)) for p, o in answers]
    with torch.inference_mode():
        for req in requests:
            _chain(runner, req, sorted(set(topks)), max_steps, max_rows, stats)
        while True:
            pending = [(req, tree) for req in requests for trees in req.trees.values() for tree in trees if tree.wants]
            if not pending:
                break
            _forward_wants(runner, pending, max_rows, stats)
    stats.seconds += time.monotonic() - started
    return [{k: [tree.ranks() for tree in trees] for k, trees in req.trees.items()} for req in requests]


def _chain(runner: ModelRunner, req: _Request, topks: list[int], max_steps: int, max_rows: int,
           stats: ReplayStats) -> None:
    """The causal pass and each round's tree up to its first wants."""
    n = len(req.output)
    req.trees = {k: [] for k in topks}
    if n < 2:
        return  # the prefill emits the only token: no round drafts
    req.cache = runner.new_cache()
    hidden = [runner.prefill(req.cache, req.prompt + req.output[:1])]
    rest = req.output[1:n - 1]
    for start in range(0, len(rest), max_rows):
        chunk = rest[start:start + max_rows]
        at = runner.cache_len(req.cache)
        hidden.append(runner.forward(req.cache, chunk, range(at, at + len(chunk)), chain_visibility(at, len(chunk))))
        stats.forwards += 1
    stats.chain_rows += len(req.prompt) + n - 1
    stats.forwards += 1
    req.key_positions = list(range(runner.cache_len(req.cache)))
    chain_hidden = torch.cat(hidden)  # row i - 1: after prompt + output[:i], i = 1..n-1
    expansions: dict[int, list] = {k: [] for k in topks}
    for start in range(0, chain_hidden.shape[0], max_rows):
        logp = log_probs(runner, chain_hidden[start:start + max_rows])
        for k in topks:
            expansions[k].extend(top_of(logp, k))
    for k in topks:
        rows = expansions[k]
        for j in range(1, n):
            depth = min(max_steps, n - j)
            tree = RoundTree(k, max_steps, req.output[j:], rows[j - 1:j - 1 + depth])
            req.trees[k].append(tree)
            req.position[id(tree)] = j
            stats.rounds += 1


def _forward_wants(runner: ModelRunner, pending: list[tuple[_Request, RoundTree]], max_rows: int,
                   stats: ReplayStats) -> None:
    """One step of every pending tree: its wants forwarded (at most max_rows rows a forward), then given."""
    got: dict[int, list] = {id(tree): [None] * len(tree.wants) for _, tree in pending}
    queue = [(req, tree, i, want) for req, tree in pending for i, want in enumerate(tree.wants)]
    for start in range(0, len(queue), max_rows):
        batch = queue[start:start + max_rows]
        by_request: dict[int, list[tuple[RoundTree, int, Want]]] = {}
        owners: dict[int, _Request] = {}
        for req, tree, i, want in batch:
            by_request.setdefault(id(req), []).append((tree, i, want))
            owners[id(req)] = req
        items = []
        for rid, rows in by_request.items():
            items.append((owners[rid], rows, _queries(owners[rid], rows)))
        if runner.batches:
            hiddens = runner.forward_many([(req.cache, q[0], q[1], q[2]) for req, _, q in items])
        else:
            hiddens = [runner.forward(req.cache, q[0], q[1], q[2], q[3]) for req, _, q in items]
        stats.forwards += 1
        stats.tree_rows += len(batch)
        logp = log_probs(runner, torch.cat(hiddens))
        offset = 0
        for (req, rows, _), hidden in zip(items, hiddens):
            for r, (tree, i, _want) in enumerate(rows):
                got[id(tree)][i] = top_of(logp[offset + r:offset + r + 1], tree.build.topk)[0]
            offset += hidden.shape[0]
    for _, tree in pending:
        tree.give(got[id(tree)])


def _queries(req: _Request, rows: list[tuple[RoundTree, int, Want]]
             ) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """Tokens, positions and visibility of one request's wanted nodes, appended after its cache, and the positions
    of the cache's columns (the HF path's sliding windows need them); records the new columns."""
    base = len(req.key_positions)
    keys = torch.tensor(req.key_positions, dtype=torch.long)
    n = len(rows)
    visible = torch.zeros(n, base + n, dtype=torch.bool)
    tokens, positions = [], []
    prompt = len(req.prompt)
    for row, (tree, _, want) in enumerate(rows):
        j = req.position[id(tree)]
        visible[row, :prompt + j + want.prefix] = True  # committed tokens + the on-path ancestors (the chain's)
        for ancestor in want.ancestors:
            visible[row, req.columns[(id(tree), ancestor)]] = True
        visible[row, base + row] = True
        tokens.append(want.token)
        positions.append(prompt + j - 1 + want.depth)  # the root sits at prompt + j - 1
        req.columns[(id(tree), want.node)] = base + row
    req.key_positions.extend(positions)
    return tokens, positions, visible, keys


def main(argv: list[str] | None = None) -> int:
    from serve.model_store import resolve_model
    from serve.engines.cpu.probe import STARTUP_PROBE_SIZES, cached_draft_cost

    parser = argparse.ArgumentParser(prog="python -m serve.engines.cpu.draft_replay", description=__doc__.split("\n")[0])
    parser.add_argument("--draft", required=True, help="the draft model: a known id, a .gguf file or an HF dir")
    parser.add_argument("--input", required=True, type=Path)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--weights", default="auto", choices=["auto", "fp32", "gguf"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: every core, as the engine)")
    parser.add_argument("--max-rows", type=int, default=KERNEL_MAX_ROWS, help="query rows per forward")
    parser.add_argument("--probe-seconds", type=float, default=1.5, help="budget of the draft step curve (0: none)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.monotonic()
    spec = json.loads(args.input.read_text())
    draft_dir = resolve_model(args.draft)
    runner = ModelRunner.from_dir(draft_dir, args.dtype, args.weights)
    loaded = time.monotonic()
    stats = ReplayStats()
    answers = [(a["prompt_ids"], a["output_ids"]) for a in spec["answers"]]
    out = replay_answers(runner, answers, spec["topks"], spec["max_steps"], args.max_rows, stats)
    cost = (cached_draft_cost(runner, draft_dir, args.dtype, args.probe_seconds, STARTUP_PROBE_SIZES)
            if args.probe_seconds > 0 else None)
    result = {
        "answers": [{str(k): v for k, v in per.items()} for per in out],
        "draft_cost": cost,
        "draft_weights": {"mode": runner.weights.mode, "isa": runner.weights.isa, "reason": runner.weights.reason},
        "threads": torch.get_num_threads(),
        "seconds": {"load": round(loaded - started, 3), "replay": round(stats.seconds, 3),
                    "total": round(time.monotonic() - started, 3)},
        "forwards": {"calls": stats.forwards, "chain_rows": stats.chain_rows, "tree_rows": stats.tree_rows,
                     "rounds": stats.rounds},
    }
    args.output.write_text(json.dumps(result))
    print(f"[draft replay] {len(answers)} request(s), {stats.rounds} round tree(s): {stats.chain_rows} chain rows + "
          f"{stats.tree_rows} tree rows in {stats.forwards} forwards, {stats.seconds:.2f} s "
          f"(load {loaded - started:.2f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
