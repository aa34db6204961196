"""SGLang's own server on a CPU machine: where its venv is, how it is launched, and the runtime pieces it needs.

SGLang 0.5.23's PyPI wheel declares a CUDA torch and CUDA kernels, so its CPU runtime lives in a venv of its own
(`bash infra/install-sglang-cpu.sh`: torch 2.13.0+cpu, `sglang==0.5.23 --no-deps` and its pure-Python dependencies,
pinned in infra/requirements-sglang-cpu.txt), beside the project's venv whose ray/mlflow stack SGLang's pins
(transformers, openai, fastapi, ...) would move. Its interpreter is `venv_python()`: `$SPECDEC_SGLANG_CPU_VENV/bin/python`,
else `<cache root>/sglang-cpu/0.5.23/venv/bin/python` (cache root: `$SPECDEC_CACHE`, else ~/.cache/specdec-tuner),
resolved on the node that runs the engine. The SGLang adapter starts it as
`<venv python> -m serve.engines.sglang.cpu serve ...` with `launch_env()`; preflight uses the same interpreter.

The pieces (all of them ours, none of SGLang's files edited): `kernels` (torch stand-ins for the sgl_kernel CPU ops),
`verify` (the torch-native attention backend's TARGET_VERIFY branch), `runtime` (the import stubs and the install
step, refusing any SGLang but 0.5.23), `site/sitecustomize.py` (installs them in every SGLang process). They are
loaded only when `SPECDEC_SGLANG_CPU=1`, which only `launch_env()` sets: never for SGLang on a GPU.
"""

from __future__ import annotations

import os
from pathlib import Path

from serve.model_store import cache_root

__all__ = ["SITE_DIR", "SUPPORTED_VERSION", "launch_env", "venv_dir", "venv_python"]

SUPPORTED_VERSION = "0.5.23"  # runtime.SUPPORTED_VERSION; repeated so that this module stays import-light
SITE_DIR = Path(__file__).resolve().parent / "site"
VENV_ENV = "SPECDEC_SGLANG_CPU_VENV"
ENV_FLAG = "SPECDEC_SGLANG_CPU"  # set to "1": every interpreter of this SGLang installs the CPU runtime pieces


def venv_dir() -> Path:
    """The SGLang CPU venv: `$SPECDEC_SGLANG_CPU_VENV`, else under the cache root (what the install script uses)."""
    override = os.environ.get(VENV_ENV)
    if override:
        return Path(override).expanduser()
    return cache_root() / "sglang-cpu" / SUPPORTED_VERSION / "venv"


def venv_python() -> Path | None:
    """The venv's interpreter, None when it is not installed here."""
    python = venv_dir() / "bin" / "python"
    return python if python.exists() else None


def launch_env(threads: int | None = None) -> dict[str, str]:
    """Environment additions for SGLang on CPU: its CPU platform (`SGLANG_USE_CPU_ENGINE=1`: without it SGLang picks
    no CPU platform), our runtime pieces in every process (sitecustomize on PYTHONPATH + `SPECDEC_SGLANG_CPU=1`),
    and, when `threads` is given, the OpenMP/torch thread count. PYTHONPATH gets the site folder first; the caller's
    `child_env` adds the project root after it."""
    env = {"SGLANG_USE_CPU_ENGINE": "1", ENV_FLAG: "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(SITE_DIR), os.environ.get("PYTHONPATH", "")) if p)}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env
