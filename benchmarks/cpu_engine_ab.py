"""Old vs new CPU engine in one run: plain-decode speed (with a token-for-token comparison of the greedy outputs),
the verify-cost curve, and engine start with the real server until /health answers 200. Not a test.

    git worktree add /tmp/wt-e HEAD                   # the old code (any checkout of this repository)
    python benchmarks/cpu_engine_ab.py --old /tmp/wt-e --repeats 5
    git worktree remove --force /tmp/wt-e

Each measurement runs in a fresh subprocess whose PYTHONPATH and working directory are one checkout, and the two
checkouts alternate pass by pass (old, new, old, new, ...), so that drift of a shared machine hits both alike; the
tables give medians over --repeats and the new/old ratio. The worker uses only API that both checkouts have
(`resolve_model`, `load_model`, `ModelRunner`, `Decoder`, `measure_verify_cost`).

- decode: SmolLM2 chat-formatted prompts, greedy, --new-tokens each with EOS ignored; tok/s = (tokens - 1) / time
  after the prefill, summed over the prompts; CPU ms per token = process CPU time (all threads) over the same steps,
  less sensitive than wall time to other processes waiting for the cores; the output ids of both sides must be
  identical (checked every pass).
- verify: one forward of N chain tokens after 128 tokens, N = 1..16, relative to N = 1 (probe.measure_verify_cost).
- start: `python -m serve.engines.cpu --model-path MODEL --port P` from spawn to the first 200 on /health, with the
  default probe budget; also the CPU seconds the server process used by then (less sensitive to a shared machine).
  The new engine reads the verify-cost curve from its on-disk cache; "new, re-measured" passes
  `--verify-probe-refresh` (the first start on a machine, or after a code change).

`--old-weights` / `--new-weights` (fp32, gguf, auto) make that side's workers load the model as the engine does,
`ModelRunner.from_dir(dir, "float32", weights)` (the GGUF decode kernel, serve/engines/cpu/gguf_linear.py), and its
engine starts pass `--weights`; `--old .` with `--old-weights fp32 --new-weights gguf` compares the two weight modes
of one checkout. Without them a side loads HF's module (`load_model`), which any checkout has.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [  # free text and copy-heavy, as benchmarks/cpu_engine.py
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Here is a list of cities: Paris, London, Berlin, Madrid, Rome, Vienna, Prague, Lisbon.\n"
    "Repeat the list exactly, one city per line:\n",
    "What are three good habits for staying healthy? Explain each briefly.",
    "Copy the following text exactly.\nText: The quick brown fox jumps over the lazy dog while the cat sleeps on "
    "the warm windowsill and the bird sings.\nCopy:",
    "Rewrite this Python function, renaming the variable res to result.\n\ndef total_price(items, tax_rate):\n"
    "    res = 0\n    for item in items:\n        res += item.price * item.quantity\n    return round(res, 2)\n",
]


# ---------------------------------------------------------------------------------------------------- worker side

def _worker(args: argparse.Namespace) -> int:
    """Runs inside the checkout under test (its `serve` package comes first on PYTHONPATH)."""
    import torch

    from serve.engines.cpu.convert import load_model
    from serve.engines.cpu.decode import Decoder, Request, StopRules
    from serve.engines.cpu.models import resolve_model
    from serve.engines.cpu.probe import measure_verify_cost
    from serve.engines.cpu.runner import ModelRunner
    from serve.engines.cpu.verify import Sampling

    torch.set_num_threads(args.threads[0])
    model_dir = resolve_model(args.model)
    if args.weights:
        from serve.engines.cpu.convert import load_tokenizer

        runner, tokenizer = ModelRunner.from_dir(model_dir, "float32", args.weights), load_tokenizer(model_dir)
    else:
        model, tokenizer = load_model(model_dir, "float32")
        runner = ModelRunner(model)
    result: dict = {"root": os.environ.get("PYTHONPATH", ""), "backend": getattr(runner, "backend", "hf"),
                    "weights": getattr(getattr(runner, "weights", None), "mode", "fp32")}
    if args.worker == "decode":
        decoder = Decoder(runner, tokenizer, None)
        tokens = 0
        seconds = cpu = 0.0
        outputs = []
        for prompt in PROMPTS[:args.prompts]:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            req = Request(rid="ab", prompt_ids=ids, sampling=Sampling(temperature=0.0), seed=0,
                          rules=StopRules(max_new_tokens=args.new_tokens, ignore_eos=True))
            decoder.step(req)  # the prefill, not timed
            started, cpu_started = time.perf_counter(), time.process_time()
            while not req.finished:
                decoder.step(req)
            seconds += time.perf_counter() - started
            cpu += time.process_time() - cpu_started
            tokens += len(req.output_ids) - 1
            decoder.release(req)
            outputs.append(req.output_ids)
        result.update(tok_s=tokens / seconds, cpu_ms_per_token=1000.0 * cpu / tokens, outputs=outputs)
    else:
        result["curve"] = measure_verify_cost(runner, budget_s=args.verify_seconds, min_rounds=3)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------------- driver side

def _env(root: Path, threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(root), OMP_WAIT_POLICY=env.get("OMP_WAIT_POLICY", "PASSIVE"),
               OMP_NUM_THREADS=str(threads))
    return env


def _run_worker(root: Path, mode: str, args: argparse.Namespace, threads: int, weights: str | None = None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--model", args.model,
           "--threads", str(threads), "--new-tokens", str(args.new_tokens), "--prompts", str(args.prompts),
           "--verify-seconds", str(args.verify_seconds)] + (["--weights", weights] if weights else [])
    proc = subprocess.run(cmd, cwd=root, env=_env(root, threads), capture_output=True, text=True, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"worker {mode} in {root} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_once(root: Path, args: argparse.Namespace, extra: list[str]) -> dict:
    port = _free_port()
    cmd = [sys.executable, "-m", "serve.engines.cpu", "--model-path", args.model, "--port", str(port), *extra]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=root, env=_env(root, 2), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server in {root} exited {proc.returncode}: {proc.communicate()[1][-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() - started > 300:
                raise RuntimeError(f"server in {root} not healthy after 300 s")
            time.sleep(0.02)
        ready = time.monotonic() - started
        cpu = _cpu_seconds(proc.pid)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=10) as resp:
            info = json.loads(resp.read())
        return {"ready_s": ready, "cpu_s": cpu, "startup_time": info.get("startup_time", {}),
                "probe": (info.get("verify_cost") or {}).get("source", "measured")}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process has used: on a loaded machine, closer to its idle wall time than its
    wall time is (the engine starts on one thread: imports, file reads, copies)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", type=Path, help="checkout with the old code (e.g. a `git worktree` of HEAD)")
    p.add_argument("--new", type=Path, default=REPO, help="checkout with the new code (default: this one)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--repeats", type=int, default=5, help="passes per side and measurement (>= 3; medians)")
    p.add_argument("--threads", type=int, nargs="+", default=[2, 1], help="torch threads for decode (default 2 1)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=3, choices=range(1, len(PROMPTS) + 1))
    p.add_argument("--verify-seconds", type=float, default=6.0, help="budget of one verify-cost curve")
    p.add_argument("--only", nargs="+", choices=("identity", "decode", "verify", "start"),
                   default=["decode", "verify", "start"],
                   help="identity: one decode pass per side and thread count, outputs compared token for token")
    p.add_argument("--old-weights", choices=("fp32", "gguf", "auto"), default=None,
                   help="the old side loads as the engine does with this --weights (default: HF's module)")
    p.add_argument("--new-weights", choices=("fp32", "gguf", "auto"), default=None,
                   help="the new side loads as the engine does with this --weights (default: HF's module)")
    p.add_argument("--worker", choices=("decode", "verify"), help=argparse.SUPPRESS)
    p.add_argument("--weights", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args)
    if args.old is None:
        p.error("--old is required (a checkout of the old code)")
    if args.repeats < 3:
        p.error("--repeats must be >= 3 (medians)")
    sides = {"old": args.old.resolve(), "new": args.new.resolve()}
    weights = {"old": args.old_weights, "new": args.new_weights}
    print("# CPU engine, old vs new (alternating passes)\n")
    print(f"- command: `python benchmarks/cpu_engine_ab.py {' '.join(sys.argv[1:] if argv is None else argv)}`")
    print(f"- old: {sides['old']} (weights {args.old_weights or 'HF module'}), new: {sides['new']} "
          f"(weights {args.new_weights or 'HF module'})")
    print(f"- machine: {_cpu_model()}, {os.cpu_count()} CPUs, python {platform.python_version()}, "
          f"load average at the start {os.getloadavg()[0]:.2f}\n", flush=True)

    if "identity" in args.only:
        print(f"## Greedy outputs, old vs new ({args.prompts} prompt(s) x {args.new_tokens} tokens, EOS ignored)\n")
        print("| threads | identical prompts | first divergence (prompt, token index) |")
        print("|---|---|---|")
        for threads in args.threads:
            old, new = (_run_worker(root, "decode", args, threads, weights[side])["outputs"]
                        for side, root in sides.items())
            same = sum(a == b for a, b in zip(old, new))
            diverge = [(i, next(j for j, (x, y) in enumerate(zip(a, b)) if x != y))
                       for i, (a, b) in enumerate(zip(old, new)) if a != b]
            print(f"| {threads} | {same} of {len(old)} | {diverge[0] if diverge else '-'} |", flush=True)
        print()

    if "decode" in args.only:
        print(f"## Plain decode ({args.prompts} prompt(s) x {args.new_tokens} tokens, greedy, EOS ignored)\n")
        print("| threads | old tok/s (median) | new tok/s (median) | new / old | old passes | new passes | "
              "old / new CPU ms per token (median) | identical tokens |")
        print("|---|---|---|---|---|---|---|---|")
        for threads in args.threads:
            rates: dict[str, list[float]] = {"old": [], "new": []}
            cpu: dict[str, list[float]] = {"old": [], "new": []}
            identical = True
            for _ in range(args.repeats):
                outs = {}
                for side, root in sides.items():
                    res = _run_worker(root, "decode", args, threads, weights[side])
                    rates[side].append(res["tok_s"])
                    cpu[side].append(res["cpu_ms_per_token"])
                    outs[side] = res["outputs"]
                identical = identical and outs["old"] == outs["new"]
            old, new = _median(rates["old"]), _median(rates["new"])
            print(f"| {threads} | {old:.1f} | {new:.1f} | {new / old:.2f}x | "
                  f"{', '.join(f'{r:.1f}' for r in rates['old'])} | {', '.join(f'{r:.1f}' for r in rates['new'])} | "
                  f"{_median(cpu['old']):.0f} / {_median(cpu['new']):.0f} | {'yes' if identical else 'NO'} |",
                  flush=True)
        print()

    if "verify" in args.only:
        print("## Verify cost (one forward of N chain tokens after 128 tokens, 2 threads; median of the passes' "
              "medians)\n")
        curves: dict[str, list[dict]] = {"old": [], "new": []}
        for _ in range(args.repeats):
            for side, root in sides.items():
                curves[side].append(_run_worker(root, "verify", args, 2, weights[side])["curve"])
        sizes = curves["new"][0]["sizes"]
        print("| side | " + " | ".join(f"N={n}" for n in sizes) + " |")
        print("|---" * (len(sizes) + 1) + "|")
        for side in sides:
            ms = [_median([c["ms"][i] for c in curves[side]]) for i in range(len(sizes))]
            print(f"| {side} ms | " + " | ".join(f"{m:.1f}" for m in ms) + " |")
            print(f"| {side} x N=1 | " + " | ".join(f"{m / ms[0]:.2f}" for m in ms) + " |")
        print(flush=True)

    if "start" in args.only:
        print(f"## Engine start (`python -m serve.engines.cpu --model-path {args.model}`, spawn to /health 200)\n")
        flags = {side: ["--weights", w] if w else [] for side, w in weights.items()}
        variants = [("old", sides["old"], flags["old"]), ("new", sides["new"], flags["new"]),
                    ("new, probe re-measured", sides["new"], flags["new"] + ["--verify-probe-refresh"])]
        _start_once(sides["new"], args, flags["new"])  # fills the new engine's probe cache if it is empty
        starts: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
        for _ in range(args.repeats):
            for name, root, extra in variants:
                starts[name].append(_start_once(root, args, extra))
        print("| engine | ready s, wall (median) | CPU s (median) | wall passes | engine's own split (median s) |")
        print("|---|---|---|---|---|")
        for name, _, _ in variants:
            runs = starts[name]
            keys = sorted({k for r in runs for k in r["startup_time"]})
            split = ", ".join(f"{k} {_median([r['startup_time'].get(k, 0.0) for r in runs]):.2f}" for k in keys)
            ready = [r["ready_s"] for r in runs]
            cpu_s = _median([r["cpu_s"] for r in runs])
            print(f"| {name} | {_median(ready):.2f} | {cpu_s:.2f} | {', '.join(f'{x:.2f}' for x in ready)} | {split} |")
        print()
    print(f"load average at the end (1/5/15 min): {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
