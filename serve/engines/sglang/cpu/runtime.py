"""What SGLang 0.5.23's own server needs to run on a CPU machine, installed into one Python process (`install`).

Three pieces, each the smallest that works (reference: shared facts on SGLang 0.5.23 on CPU):
- `sgl_kernel`: a stand-in package whose CPU ops are the torch functions of `kernels.py`; any other name imports
  fine and raises when called, naming itself. Nothing is registered under `torch.ops.sgl_kernel`, so SGLang's
  `cpu_has_amx_support()` is False on every CPU, AMX or not (it needs `torch.ops.sgl_kernel.convert_weight_packed`):
  layers take their plain torch paths and the `intel_amx` attention backend falls back to `torch_native`.
- `torchvision`: SGLang imports `torchvision.transforms` at module level in code it loads on any model; PyPI's
  torchvision is a CUDA build that fails against CPU torch. A stub module serves `import` statements written in
  SGLang's own modules and raises when anything in it is called; other importers get ImportError, and
  `importlib.util.find_spec` answers None (transformers probes torchvision that way and would otherwise believe it
  installed and use it).
- the torch-native backend's TARGET_VERIFY branch (`verify.patch`), applied when SGLang imports that module.

Loaded by `site/sitecustomize.py` in every process of an SGLang started for `device: cpu` (its scheduler and
detokenizer are spawned interpreters), only when `SPECDEC_SGLANG_CPU=1` is set; never for SGLang on a GPU.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from importlib import metadata
from typing import Any, Callable, Sequence

__all__ = ["SUPPORTED_VERSION", "install", "installed", "version_problem"]

SUPPORTED_VERSION = "0.5.23"
_VERIFY_MODULE = "sglang.srt.layers.attention.torch_native_backend"


def version_problem(found: str | None, where: str | None = None) -> str | None:
    """Why these pieces must not be used with SGLang `found` in the environment `where` (default: this one's; None:
    they may). They depend on 0.5.23's internals."""
    if found == SUPPORTED_VERSION:
        return None
    have = "no SGLang" if found is None else f"SGLang {found}"
    return (f"SGLang on CPU: {have} is installed in {where or sys.prefix}, and specdec-tuner's CPU runtime pieces (the "
            f"sgl_kernel stand-in ops, the torch-native verify branch) are written for SGLang {SUPPORTED_VERSION} "
            f"only. Fix: bash infra/install-sglang-cpu.sh (installs sglang=={SUPPORTED_VERSION} into its own venv)")


class _Absent:
    """A name from a package that is not installed: attribute access works (module-level references), calls fail."""

    def __init__(self, name: str, why: str) -> None:
        self._name, self._why = name, why

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{self._name}.{attr}", self._why)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{self._name} was called, but {self._why}")

    def __repr__(self) -> str:
        return f"<absent {self._name}>"


class _StubModule(types.ModuleType):
    def __init__(self, name: str, why: str, provided: dict[str, Callable[..., Any]] | None = None) -> None:
        super().__init__(name)
        self.__path__: list[str] = []
        self.__dict__.update(provided or {})
        self._why = why

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{self.__name__}.{attr}", self._why)


def _sgl_kernel_module(name: str) -> types.ModuleType:
    from serve.engines.sglang.cpu import kernels

    why = ("specdec-tuner's CPU stand-in for sgl_kernel provides only the ops SGLang's CPU path uses for dense "
           f"models with NGRAM: {', '.join(sorted([*kernels.OPS, *kernels.SPECULATIVE_OPS]))}")
    provided = {"sgl_kernel": kernels.OPS, "sgl_kernel.speculative": kernels.SPECULATIVE_OPS}.get(name, {})
    return _StubModule(name, why, dict(provided))


def _torchvision_module(name: str) -> types.ModuleType:
    return _StubModule(name, "torchvision is not installed (PyPI's torchvision is a CUDA build; SGLang on CPU "
                             "imports it only for multimodal models, which specdec-tuner does not run on CPU)")


def _first_caller() -> Any:
    """The frame of the code that asked for an import: the first outside the import machinery."""
    frame: Any = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename == __file__
                                 or frame.f_code.co_filename.startswith("<frozen importlib")):
        frame = frame.f_back
    return frame


def _asked_by_sglang_import_statement() -> bool:
    frame = _first_caller()
    if frame is None or frame.f_code.co_filename.endswith(os.path.join("importlib", "util.py")):
        return False  # importlib.util.find_spec: an availability probe, which must see no torchvision
    return str(frame.f_globals.get("__name__", "")).startswith("sglang")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the stand-in packages and runs the verify patch after SGLang's torch-native backend is imported."""

    def find_spec(self, name: str, path: Sequence[str] | None = None, target: Any = None) -> Any:
        root = name.split(".")[0]
        if root == "sgl_kernel":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        if root == "torchvision" and _asked_by_sglang_import_statement():
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        if name == _VERIFY_MODULE:
            return self._patched_spec(name, path, target)
        return None

    def _patched_spec(self, name: str, path: Sequence[str] | None, target: Any) -> Any:
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        if spec.name.split(".")[0] == "sgl_kernel":
            return _sgl_kernel_module(spec.name)
        return _torchvision_module(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        from serve.engines.sglang.cpu import verify

        verify.patch(module)


def installed() -> bool:
    return any(isinstance(f, _Finder) for f in sys.meta_path)


def install() -> None:
    """Install the three pieces into this process (idempotent). Refuses another SGLang version (RuntimeError)."""
    if installed():
        return
    try:
        found: str | None = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        found = None
    problem = version_problem(found)
    if problem:
        raise RuntimeError(problem)
    sys.meta_path.insert(0, _Finder())
    _hide_from_find_spec("torchvision")


def _hide_from_find_spec(root: str) -> None:
    """`importlib.util.find_spec` answers None for `root` (and its submodules) even once SGLang's import put the stub
    in sys.modules, where find_spec would otherwise find it and report the package installed."""
    original = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        if name.split(".")[0] == root:
            return None
        return original(name, package)

    importlib.util.find_spec = find_spec
