"""Run SGLang's own argument parser and resolution on an argv, in this (sub)process; print one JSON line.

`python -m serve.engines.sglang.preflight` reads {"argvs": [[...], ...], "parse_only": bool, "gpu_arch": "sm90"|null
or one per argv} on stdin and prints {"results": [{"ok": bool, "stage": "import|parse|resolve|check|crash", "error":
str|None, "resolved": {...}}, ...]}: parse/resolve/check when SGLang itself refused (its own error, raised by its own
code: `sglang_refused`), crash when the preflight failed to answer (a Hub id looked up without a network, a stubbed
GPU package), with the traceback's last line;
or reads {"fields": true} and prints {"fields": [ServerArgs field names], "version": ...}: the flags this SGLang has;
or reads {"adaptive_config": path} and prints {"adaptive": {"ok", "error", "buckets", "candidate_steps"}}: SGLang's own
loader (`_load_adaptive_config`) on an adaptive config file.
parse_only checks flag names, types and choices with SGLang's argparse parser (fast: one parser for all argvs);
otherwise each argv also goes through `resolve_once()` and `check_server_args()` (seconds each). It needs only
`sglang` (installed `--no-deps`) and what `sglang.srt.server_args` imports (reference/sglang-0.5.23.md §8); GPU-only
packages are replaced by SGLang's own mock modules, so it runs on a CPU machine. A model path (or draft path) is
read as SGLang reads it: a local directory's `config.json`, or a Hub id looked up by transformers; where that lookup
fails here (no network, no cache), the preflight crashed and gives no verdict.

`gpu_arch` resolves as a GPU of that architecture would (SGLang's own `runtime_context.override_platform`, with the
facts of `serve.engines.sglang.backend.platform_facts`): the attention backend SGLang picks and the checks that
depend on the architecture (trtllm_mha needs sm90+, ...) are the GPU node's, not this CPU's. `resolved` also says
what SGLang made of the model (`use_mla_backend`, `architecture`) and, for an adaptive config SGLang turned off,
why (`adaptive_unsupported_reason`, SGLang's own function).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import io
import json
import sys
import traceback
from pathlib import Path
from typing import Any

from serve.engines.sglang.backend import platform_facts
from serve.engines.spec_flags import SETTINGS

# GPU-only or optional packages that sglang imports at module level (reference §8, checked on 0.5.23).
GPU_ONLY = {"torchvision", "sgl_kernel", "flashinfer", "deep_gemm", "vllm", "aiter", "torch_npu", "petit_kernel",
            "amdsmi", "pymtml", "tvm_ffi", "modelscope", "torchcodec", "pynvml"}
# What a trial records of SGLang's resolution: every setting of the one table, plus what else changes a trial.
# SGLang's mock modules (what stands in for GPU packages here): what they raise, or what names them, is a stubbed
# package failing, not SGLang's verdict on the config.
STUB_FILES = ("_platform_stubs.py",)
STUB_NAMES = ("_MockModule", "MockModule")
RESOLVED_KEYS = tuple(s.server_arg for s in SETTINGS) + (
    "disable_overlap_schedule", "enable_mixed_chunk", "tp_size", "device", "attention_backend", "dtype", "page_size",
    "speculative_adaptive_config", "enable_deterministic_inference")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, mock_cls: type) -> None:
        self.mock_cls = mock_cls

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.split(".")[0] in GPU_ONLY:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> Any:
        module = self.mock_cls(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: Any) -> None:
        return None


def _install_stubs() -> None:
    from sglang._platform_stubs import _MockModule

    sys.meta_path.insert(0, _StubFinder(_MockModule))


def _argparse_error(text: str) -> str:
    """argparse prints the whole usage (532 options) before its one-line error: keep the error."""
    errors = [line for line in text.splitlines() if "error:" in line]
    return errors[-1].strip() if errors else text.strip()[-500:]


def _for_this_machine(argv: list[str]) -> list[str]:
    """Resolve as a GPU node would: SGLang refuses to resolve without an accelerator unless told the device.
    The tokenizer is not needed for argument resolution (only a local config.json is)."""
    extra = [] if "--device" in argv else ["--device", "cuda"]
    extra += [] if "--skip-tokenizer-init" in argv else ["--skip-tokenizer-init"]
    return argv + extra


def parse_many(argvs: list[list[str]]) -> list[dict[str, Any]]:
    """Flag names, types and choices only, with one parser (argparse abbreviations are SGLang's, not ours)."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    results = []
    for argv in argvs:
        captured = io.StringIO()
        try:
            with contextlib.redirect_stderr(captured):
                parser.parse_args(argv)
            results.append({"ok": True, "stage": "parse", "error": None, "resolved": {}})
        except (SystemExit, argparse.ArgumentError) as exc:
            message = _argparse_error(captured.getvalue()) or str(exc)
            results.append({"ok": False, "stage": "parse", "error": message, "resolved": {}})
    return results


def run(argv: list[str]) -> dict[str, Any]:
    """Parse, resolve and check one argv exactly as `sglang serve` would before launching anything."""
    stage = "parse"
    try:
        from sglang.srt.server_args import prepare_server_args

        captured = io.StringIO()
        try:
            with contextlib.redirect_stderr(captured):
                args = prepare_server_args(_for_this_machine(argv))
        except SystemExit:  # argparse: unknown or ambiguous flag, bad choice
            return {"ok": False, "stage": stage, "error": _argparse_error(captured.getvalue()), "resolved": {}}
        stage = "resolve"
        args.resolve_once()
        stage = "check"
        args.check_server_args()
        resolved = args.resolved_dict()
        out = {k: resolved.get(k) for k in RESOLVED_KEYS}
        out.update(_model_facts(args))
        if "--speculative-adaptive" in argv and not resolved.get("speculative_adaptive"):
            from sglang.srt.speculative.adaptive_spec_params import adaptive_unsupported_reason

            out["adaptive_unsupported_reason"] = adaptive_unsupported_reason(args) or "turned off by SGLang"
        return {"ok": True, "stage": stage, "error": None, "resolved": out}
    except Exception as exc:  # noqa: BLE001 - SGLang's refusals are reported verbatim; anything else is our crash
        if not sglang_refused(exc):
            return {"ok": False, "stage": "crash", "error": crash_line(exc, stage), "resolved": {}}
        detail = str(exc) or traceback.format_exc(limit=3)
        return {"ok": False, "stage": stage, "error": f"{type(exc).__name__}: {detail}", "resolved": {}}


def raised_in(exc: BaseException) -> str:
    """The file of the innermost frame of `exc`'s traceback: where it was raised."""
    tb, where = exc.__traceback__, ""
    while tb is not None:
        where, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    return where


def sglang_refused(exc: BaseException) -> bool:
    """Whether `exc` is SGLang refusing the config: raised by SGLang's own code (its checks assert or raise, its
    resolution raises on settings it cannot combine; `sglang serve` would stop the same way), not by a stub standing
    in for a GPU package nor about one. Anything raised elsewhere (transformers looking a Hub id up without a network
    or a local folder, a stubbed package, our own code) says nothing about the config: the preflight could not
    answer, and the launch decides."""
    import sglang

    where = Path(raised_in(exc)).resolve()
    package = Path(sglang.__file__).resolve().parent
    return (where.is_relative_to(package) and where.name not in STUB_FILES
            and not any(name in f"{exc!r}" for name in STUB_NAMES))


def crash_line(exc: BaseException, stage: str) -> str:
    """The traceback's last line (the exception and the first line of its message) and where it was raised."""
    message = (str(exc).strip().splitlines() or [""])[0]
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    at = f" (raised at {Path(tb.tb_frame.f_code.co_filename).name}:{tb.tb_lineno})" if tb is not None else ""
    return f"the preflight crashed during {stage}: {type(exc).__name__}: {message}{at}"


def _model_facts(args: Any) -> dict[str, Any]:
    """What SGLang made of the target model: MLA or not (its `use_mla_backend`), its architecture."""
    try:
        from sglang.srt.arg_groups.model_override_base import model_config_of, use_mla_backend

        architectures = model_config_of(args).hf_config.architectures or [""]
        return {"use_mla_backend": bool(use_mla_backend(args)), "architecture": architectures[0]}
    except (ImportError, AttributeError):  # an older SGLang without these helpers: nothing to add
        return {}


@contextlib.contextmanager
def as_gpu(gpu_arch: str | None) -> Any:
    """Resolve as a GPU of `gpu_arch` would (module docstring); as this machine where None."""
    if not gpu_arch:
        yield
        return
    from sglang.srt.runtime_context import override_platform

    with override_platform(**platform_facts(gpu_arch)):  # type: ignore[arg-type]
        yield


def server_arg_fields() -> dict[str, Any]:
    import dataclasses

    import sglang
    from sglang.srt.server_args import ServerArgs

    # 0.5.23's ServerArgs is a msgspec Struct; older ones are dataclasses.
    names = getattr(ServerArgs, "__struct_fields__", None) or [f.name for f in dataclasses.fields(ServerArgs)]
    return {"fields": sorted(names),
            "version": getattr(sglang, "__version__", None)}


def adaptive_config(path: str) -> dict[str, Any]:
    """SGLang's own loader on an adaptive config file (`_load_adaptive_config`): its buckets and the union of their
    candidate steps (what SGLang sizes its buffers for), or its error."""
    try:
        from sglang.srt.speculative.adaptive_spec_params import (_load_adaptive_config,
                                                                 resolve_candidate_steps_from_config)

        _, entries = _load_adaptive_config(path)
        return {"ok": True, "error": None, "buckets": {str(k): v["candidate_steps"] for k, v in entries.items()},
                "candidate_steps": resolve_candidate_steps_from_config(path)}
    except Exception as exc:  # noqa: BLE001 - SGLang's verdict, verbatim
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "buckets": {}, "candidate_steps": []}


def main() -> None:
    request = json.loads(sys.stdin.read())
    if request.get("adaptive_config"):
        _install_stubs()
        sys.stdout.write("\n" + json.dumps({"adaptive": adaptive_config(request["adaptive_config"])}) + "\n")
        return
    if request.get("fields"):
        _install_stubs()
        sys.stdout.write("\n" + json.dumps(server_arg_fields()) + "\n")
        return
    argvs = [list(a) for a in request["argvs"]]
    try:
        _install_stubs()
        if request.get("parse_only"):
            results = parse_many(argvs)
        else:
            archs = request.get("gpu_arch")
            archs = archs if isinstance(archs, list) else [archs] * len(argvs)
            results = []
            for argv, arch in zip(argvs, archs):
                with as_gpu(arch):
                    results.append(run(argv))
    except Exception as exc:  # noqa: BLE001 - an import failure answers every argv the same way
        results = [{"ok": False, "stage": "import", "error": f"{type(exc).__name__}: {exc}", "resolved": {}}] * len(argvs)
    sys.stdout.write("\n" + json.dumps({"results": results}, default=str) + "\n")


if __name__ == "__main__":
    main()
