"""vLLM's own verdict on a server command line, before a launch: its argument parser and its config classes
(`AsyncEngineArgs.create_engine_config`, what its server runs first), in vLLM's interpreter.

Two halves in one file of standard library only, since vLLM's venv has none of the project's packages:
- `verdict(python, argv, env)` (the replica's side): runs this file with vLLM's interpreter on the argv's flags and
  reads back one JSON line; answers for the same argv and environment are kept for the life of the process (a
  replica serves many trials; vLLM's import alone takes seconds);
- `main()` (vLLM's side, `python check.py -- FLAGS...`): parses, resolves, and prints what vLLM resolved (the running-
  request cap, the dtype, the speculative config, the context length) or vLLM's refusal.

Refusals are vLLM's words: a refused config is INVALID for the trial (ConfigRejected), not a failed launch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

MARKER = "SPECDEC_VLLM_CHECK "
TIMEOUT_S = 300.0  # vLLM's import and config resolution: ~10-30 s on 2 busy cores
_VERDICTS: dict[tuple[str, ...], dict[str, Any]] = {}
# The variables vLLM's config resolution reads that the adapter sets; the verdict is kept per their values.
# vLLM's suffix-decoding keys of its SpeculativeConfig, reported as vLLM resolved them
SUFFIX_FIELDS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                 "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
_KEYED_ENV = ("VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
              "VLLM_CPU_NUM_OF_RESERVED_CPU")


def flags_of(argv: list[str]) -> list[str]:
    """The flags of a server argv (`python -m vllm.entrypoints.openai.api_server FLAGS...`)."""
    if len(argv) < 3 or argv[1] != "-m":
        raise ValueError(f"not a `python -m <module> ...` command line: {argv[:3]}")
    return argv[3:]


def verdict(python: Path | str, argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    """What vLLM resolved for `argv` ({"error": reason} when it refuses it). Raises RuntimeError when the check
    itself could not run (a broken venv): that is the node's problem, not the config's."""
    key = (str(python), *argv, *(f"{k}={env.get(k, '')}" for k in _KEYED_ENV))
    if key in _VERDICTS:
        return {**_VERDICTS[key], "cached": True}
    clean = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    try:
        done = subprocess.run([str(python), str(Path(__file__).resolve()), "--", *flags_of(argv)], env=clean,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"vLLM's config check did not answer within {TIMEOUT_S:.0f} s ({python})") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARKER)]
    if not lines:
        tail = "\n".join((done.stderr or done.stdout).splitlines()[-15:])
        raise RuntimeError(f"vLLM's config check exited with code {done.returncode} and no answer ({python}); its "
                           f"output ends:\n{tail}")
    answer = json.loads(lines[-1][len(MARKER):])
    _VERDICTS[key] = answer
    return answer


def _resolve(flags: list[str]) -> dict[str, Any]:
    """In vLLM's interpreter: vLLM's parser, its own serve-args validation and engine config on `flags`."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    try:  # 0.32.0: the server's own parser moved under launchers/ (openai/api_server.py only forwards to it)
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    except ImportError:  # older vLLM
        from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    try:
        args = parser.parse_args(flags)
        validate_parsed_serve_args(args)
        config = AsyncEngineArgs.from_cli_args(args).create_engine_config(
            usage_context=UsageContext.OPENAI_API_SERVER)
    except SystemExit as exc:  # argparse's refusal: its message went to stderr
        return {"error": f"vLLM's argument parser refused the command line (exit {exc.code}); see the engine log"}
    except Exception as exc:  # noqa: BLE001 - vLLM's config classes raise ValueError, TypeError, pydantic errors
        return {"error": f"{type(exc).__name__}: {exc}"}
    spec = config.speculative_config
    suffix = {} if spec is None or spec.method != "suffix" else {
        name: getattr(spec, name) for name in SUFFIX_FIELDS}
    return {
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "max_model_len": config.model_config.max_model_len,
        "enable_prefix_caching": config.cache_config.enable_prefix_caching,
        "block_size": config.cache_config.block_size,
        "speculative_config": None if spec is None else {
            "method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
            "prompt_lookup_min": spec.prompt_lookup_min, "prompt_lookup_max": spec.prompt_lookup_max,
            "num_speculative_tokens_per_batch_size": _table(getattr(spec, "num_speculative_tokens_per_batch_size",
                                                                    None)), **suffix},
    }


def _table(value: Any) -> list[list[int]] | None:
    """vLLM's dynamic-K table as JSON lists (it keeps tuples), None without one."""
    return None if value is None else [[int(x) for x in entry] for entry in value]


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: python check.py -- VLLM-SERVER-FLAGS...", file=sys.stderr)
        return 2
    answer = _resolve(argv[argv.index("--") + 1:])
    print(MARKER + json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
