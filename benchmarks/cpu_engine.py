"""Benchmark of the embedded CPU engine's decode loop (in-process, no HTTP): tok/s and accept length per speculative
config on a copy-heavy and a free-text prompt set, cold vs warm n-gram trie, the verify-cost curve, and the plain loop
vs HF `generate()` on the same model. Not a test: numbers depend on the machine and on what else runs on it.

    python benchmarks/cpu_engine.py --quick          # a few minutes on 2 cores
    python benchmarks/cpu_engine.py                  # full grid (num_draft_tokens 2..16, BFS and PROB)
    python benchmarks/cpu_engine.py --corpus --quick # NGRAM cold vs warm-up requests vs external corpus

Every run decodes exactly --new-tokens tokens per prompt (EOS ignored) so that rates compare. A "pass" decodes the
whole prompt set once; tok/s = tokens of the pass / its wall time. cold = a fresh trie per pass; warm = the same
workload ran once before on that trie (the trie then holds those outputs: what a warm-up buys on a workload that
repeats). Medians over --runs passes.

--corpus: "does n-gram need data first?" on a workload whose prompts do not repeat (the bundled `reasoning` one,
split as a study splits it: the measured prompts are never among the warm-up ones), at equal num_draft_tokens:
cold (fresh trie), warm-up requests (the warm-up split decoded first on the same trie), corpus (the warm-up split
written as an external corpus, as the search space's `warmup` choice does, drafting within --sam-budget), and
corpus + answers (the warm-up prompts with their answers, what a traffic capture gives).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the engine does; see serve/engines/cpu/__main__.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pipeline.workloads import read_prompts, split_prompts  # noqa: E402
from serve.engines.cpu.convert import load_model  # noqa: E402
from serve.ngram.corpus import ExternalCorpora  # noqa: E402
from serve.engines.cpu.decode import Decoder, Request, StopRules  # noqa: E402
from serve.model_store import resolve_model  # noqa: E402
from serve.ngram.trie import NgramCache  # noqa: E402
from serve.engines.cpu.probe import measure_verify_cost  # noqa: E402
from serve.engines.cpu.runner import ModelRunner  # noqa: E402
from serve.engines.cpu.speculators import NgramSpeculator, StandaloneSpeculator  # noqa: E402
from serve.engines.cpu.verify import Sampling  # noqa: E402

CODE = '''def total_price(items, tax_rate):
    res = 0
    for item in items:
        res += item.price * item.quantity
    res = res * (1 + tax_rate)
    return round(res, 2)
'''
COPY_PROMPTS = [
    "Rewrite this Python function, renaming the variable res to result. Keep everything else identical.\n\n"
    f"{CODE}\nRewritten function:\n",
    "Here is a list of cities: Paris, London, Berlin, Madrid, Rome, Vienna, Prague, Lisbon.\n"
    "Repeat the list exactly, one city per line:\n",
    "Copy the following text exactly.\nText: The quick brown fox jumps over the lazy dog while the cat sleeps on "
    "the warm windowsill and the bird sings.\nCopy:",
]
FREE_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "What are three good habits for staying healthy? Explain each briefly.",
]


def _chat(tokenizer, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(prompt))


def _pass(decoder: Decoder, prompts: list[list[int]], new_tokens: int) -> dict:
    tokens = verify = 0
    started = time.perf_counter()
    for ids in prompts:
        req = Request(rid="b", prompt_ids=ids, sampling=Sampling(temperature=0.0), seed=0,
                      rules=StopRules(max_new_tokens=new_tokens, ignore_eos=True))
        while not req.finished:
            decoder.step(req)
        decoder.release(req)
        tokens += len(req.output_ids)
        verify += req.spec_verify_ct
    elapsed = time.perf_counter() - started
    return {"tok_s": tokens / elapsed, "accept": tokens / verify if verify else None}


def _ngram(runner, tokenizer, cfg: dict, depth: int = 18, corpus: list[str] | None = None,
           sam_budget: int = 0) -> Decoder:
    cache = NgramCache(max_trie_depth=depth, capacity=1_000_000, min_bfs_breadth=1, **cfg)
    corpora = None
    if corpus:
        corpora = ExternalCorpora(10_000_000)
        corpora.add_documents("bench", corpus, lambda text: tokenizer.encode(text, add_special_tokens=False))
    return Decoder(runner, tokenizer, NgramSpeculator(cache, cfg["num_draft_tokens"], depth, corpora=corpora,
                                                      external_sam_budget=sam_budget if corpora else 0))


def _outputs(decoder: Decoder, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    outs = []
    for ids in prompts:
        req = Request(rid="o", prompt_ids=ids, sampling=Sampling(temperature=0.0), seed=0,
                      rules=StopRules(max_new_tokens=new_tokens, ignore_eos=True))
        while not req.finished:
            decoder.step(req)
        decoder.release(req)
        outs.append(list(req.output_ids))
    return outs


def corpus_comparison(runner, tokenizer, args, new_tokens: int) -> None:
    """The --corpus table (module docstring)."""
    prompts, _ = read_prompts("reasoning")
    n = 2 if args.quick else 6
    warm_split, measure_split, _ = split_prompts(prompts, seed=0, n_warmup=n, n_measure=n)
    warm_ids = [list(tokenizer.encode(p.text)) for p in warm_split]
    measure_ids = [list(tokenizer.encode(p.text)) for p in measure_split]
    cfg = {"match_type": "BFS", "num_draft_tokens": args.draft_tokens, "max_bfs_breadth": 4}
    answers = [tokenizer.decode(o) for o in _outputs(Decoder(runner, tokenizer, None), warm_ids, new_tokens)]
    corpus = [p.text for p in warm_split]
    with_answers = [p.text + a for p, a in zip(warm_split, answers)]
    cells: dict[str, list[dict]] = {k: [] for k in ("cold", "warm-up requests", "corpus (warm-up split)",
                                                    "corpus (warm-up split + answers)")}
    for _ in range(args.runs):  # interleaved: drift of a shared machine hits every cell alike
        cells["cold"].append(_pass(_ngram(runner, tokenizer, cfg), measure_ids, new_tokens))
        warmed = _ngram(runner, tokenizer, cfg)
        _pass(warmed, warm_ids, new_tokens)
        cells["warm-up requests"].append(_pass(warmed, measure_ids, new_tokens))
        cells["corpus (warm-up split)"].append(_pass(
            _ngram(runner, tokenizer, cfg, corpus=corpus, sam_budget=args.sam_budget), measure_ids, new_tokens))
        cells["corpus (warm-up split + answers)"].append(_pass(
            _ngram(runner, tokenizer, cfg, corpus=with_answers, sam_budget=args.sam_budget), measure_ids,
            new_tokens))
        print("  done: one pass of every cell", file=sys.stderr, flush=True)
    print(f"## NGRAM cold vs warm-up vs external corpus (workload `reasoning`, {n} warm-up + {n} different "
          f"measured prompts x {new_tokens} tokens; BFS, num_draft_tokens={args.draft_tokens}, breadth 4, "
          f"SAM budget {args.sam_budget}; median of {args.runs} passes)\n")
    print("| NGRAM | tok/s | accept length |")
    print("|---|---|---|")
    for label, res in cells.items():
        print(f"| {label} | {_fmt(_median(r['tok_s'] for r in res), 1)} | {_fmt(_median(r['accept'] for r in res))} |")


def _hf_pass(model, prompts: list[list[int]], new_tokens: int) -> dict:
    tokens = 0
    started = time.perf_counter()
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            tokens += out.shape[1] - len(ids)
    return {"tok_s": tokens / (time.perf_counter() - started), "accept": None}


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer prompts/configs/tokens: a few minutes on 2 cores")
    p.add_argument("--model", default="smollm2-135m", help="model id, .gguf or HF dir (default smollm2-135m)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--runs", type=int, default=3, help="passes per cell; the median is reported (>= 3)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per prompt (quick 32, full 64)")
    p.add_argument("--standalone-draft", default=None, help="also run STANDALONE with this draft model (full mode "
                   "defaults to the model itself, which measures the mechanics, not a useful speed-up)")
    p.add_argument("--corpus", action="store_true", help="only the NGRAM cold / warm-up / corpus comparison")
    p.add_argument("--draft-tokens", type=int, default=8, help="--corpus: num_draft_tokens of every cell")
    p.add_argument("--sam-budget", type=int, default=3, help="--corpus: draft nodes the corpus may use")
    args = p.parse_args(argv)
    if args.runs < 3:
        p.error("--runs must be >= 3 (medians)")
    if args.threads:
        torch.set_num_threads(args.threads)
    new_tokens = args.new_tokens or (32 if args.quick else 64)
    n_prompts = 1 if args.quick else len(COPY_PROMPTS)
    grid = ([("BFS", d) for d in (2, 4, 8, 16)] + [("PROB", 8)] if args.quick
            else [(m, d) for m in ("BFS", "PROB") for d in (2, 3, 4, 6, 8, 12, 16)])

    t0 = time.monotonic()
    model_dir = resolve_model(args.model)
    resolve_s = time.monotonic() - t0
    t0 = time.monotonic()
    model, tokenizer = load_model(model_dir, args.dtype)
    load_s = time.monotonic() - t0
    runner = ModelRunner(model)
    sets = {"copy": [_chat(tokenizer, x) for x in COPY_PROMPTS[:n_prompts]],
            "free": [_chat(tokenizer, x) for x in FREE_PROMPTS[:n_prompts]]}

    print(f"# CPU engine benchmark ({'quick' if args.quick else 'full'})\n")
    print(f"- command: `python benchmarks/cpu_engine.py {' '.join(sys.argv[1:] if argv is None else argv)}`")
    print(f"- machine: {platform.processor() or platform.machine()}, {_cpu_model()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY')}, python {platform.python_version()}")
    print(f"- model: {args.model} ({args.dtype}), resolve {resolve_s:.1f} s, load from safetensors {load_s:.1f} s, "
          f"engine forward: {runner.backend}")
    what = "the reasoning workload's split" if args.corpus else f"{n_prompts} prompt(s) per set"
    print(f"- {what} x {new_tokens} new tokens, greedy, EOS ignored; median of {args.runs} "
          "passes; other processes may share the CPU (see load average below)\n")
    sys.stdout.flush()
    if args.corpus:
        corpus_comparison(runner, tokenizer, args, new_tokens)
        load = os.getloadavg()
        print(f"\nload average at the end (1/5/15 min): {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}")
        return 0

    curve = measure_verify_cost(runner, budget_s=4.0 if args.quick else 15.0, min_rounds=args.runs)
    print(f"## Verify cost (one forward of N chain tokens after {curve['context_tokens']} tokens; "
          f"{curve['rounds']} rounds)\n")
    print("| N | " + " | ".join(str(n) for n in curve["sizes"]) + " |")
    print("|---" * (len(curve["sizes"]) + 1) + "|")
    print("| ms | " + " | ".join(f"{m:.0f}" for m in curve["ms"]) + " |")
    print("| x N=1 | " + " | ".join(f"{r:.2f}" for r in curve["relative"]) + " |\n")
    sys.stdout.flush()

    rows: list[tuple[str, str, str, dict]] = []
    plain = Decoder(runner, tokenizer, None)
    for name, prompts in sets.items():
        base, hf = [], []
        for _ in range(args.runs):  # interleaved, so drift of a shared machine hits both alike
            base.append(_pass(plain, prompts, new_tokens))
            hf.append(_hf_pass(model, prompts, new_tokens))
        rows.append((name, "none (engine loop)", "-", {"tok_s": _median(r["tok_s"] for r in base), "accept": None}))
        rows.append((name, "none (HF generate)", "-", {"tok_s": _median(r["tok_s"] for r in hf), "accept": None}))
        for match, draft in grid:
            cfg = {"match_type": match, "num_draft_tokens": draft, "max_bfs_breadth": 10 if match == "BFS" else 4}
            cold, warm = [], []
            for _ in range(args.runs):
                cold.append(_pass(_ngram(runner, tokenizer, cfg), prompts, new_tokens))
                decoder = _ngram(runner, tokenizer, cfg)
                _pass(decoder, prompts, new_tokens)  # the warm-up: the same workload once
                warm.append(_pass(decoder, prompts, new_tokens))
            label = f"ngram {match} draft={draft} breadth={cfg['max_bfs_breadth']}"
            for trie, res in (("cold", cold), ("warm", warm)):
                rows.append((name, label, trie, {"tok_s": _median(r["tok_s"] for r in res),
                                                 "accept": _median(r["accept"] for r in res)}))
            print(f"  done: {name} {label}", file=sys.stderr, flush=True)
        draft_model = args.standalone_draft or (None if args.quick else args.model)
        if draft_model:
            draft_runner = runner if draft_model == args.model else ModelRunner(load_model(resolve_model(draft_model),
                                                                                           args.dtype)[0])
            for steps, topk, nd in ((3, 1, 4), (2, 2, 4)):
                dec = Decoder(runner, tokenizer, StandaloneSpeculator(draft_runner, steps, topk, nd))
                res = [_pass(dec, prompts, new_tokens) for _ in range(args.runs)]
                rows.append((name, f"standalone {draft_model} steps={steps} topk={topk} draft={nd}", "-",
                             {"tok_s": _median(r["tok_s"] for r in res), "accept": _median(r["accept"] for r in res)}))

    print("## Throughput and accept length\n")
    print("| prompts | config | trie | tok/s | x none | accept length |")
    print("|---|---|---|---|---|---|")
    baseline = {name: r["tok_s"] for name, label, _, r in rows if label == "none (engine loop)"}
    for name, label, trie, r in rows:
        speedup = r["tok_s"] / baseline[name] if baseline.get(name) else None
        print(f"| {name} | {label} | {trie} | {_fmt(r['tok_s'], 1)} | {_fmt(speedup)} | {_fmt(r['accept'])} |")
    load = os.getloadavg()
    print(f"\nload average at the end (1/5/15 min): {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}")
    return 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
