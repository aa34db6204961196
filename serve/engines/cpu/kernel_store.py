"""Building a torch C++ extension once per content, not once per venv.

torch's `cpp_extension.load` builds into a folder whose build file names this venv's include paths, so that folder is
per venv (`build_dir`): two venvs sharing one would rebuild it whenever the other one ran. The library it produces
depends only on the source, the flags and the Python and torch builds, so the first build of each such key is kept
under `cache_root()/kernels/` by that key (`kept_library`), and any venv with the same Python and torch imports it
from there without building. A fresh venv (every clean CI clone, a user's new environment) otherwise rebuilt the
GGUF kernel at its first engine start or `gguf_linear build`: both ISAs side by side took 36.5 s on 2 AMD EPYC cores.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from serve.model_store import cache_root

__all__ = ["build_dir", "kept_library", "import_library", "keep", "load_or_build"]


def python_tag() -> str:
    return f"py{sys.version_info.major}{sys.version_info.minor}"


def build_dir(folder: str) -> Path:
    """torch's build folder `folder`: per Python, torch build and environment (sys.prefix), since torch's build file
    names the venv's include paths."""
    env = hashlib.sha256(sys.prefix.encode()).hexdigest()[:10]
    return cache_root() / "kernels" / f"{python_tag()}-torch{torch.__version__.replace('+', '_')}-{env}" / folder


def kept_library(name: str, source: Path, flags: Sequence[str]) -> Path:
    """Where the built library of `name` from `source` with `flags` is kept: keyed by the source's bytes, the flags,
    Python's version, torch's version and its C++ ABI, so any change to one of them is a new build."""
    digest = hashlib.sha256(source.read_bytes())
    for part in (*flags, python_tag(), torch.__version__, str(torch.compiled_with_cxx11_abi())):
        digest.update(b"\0" + part.encode())
    return cache_root() / "kernels" / f"{name}-{digest.hexdigest()[:16]}" / f"{name}.so"


def import_library(name: str, path: Path) -> ModuleType:
    """Import the extension module `name` from the library at `path` (torch imported first: it links against it)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not an importable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def keep(built: Path, path: Path) -> None:
    """Copy a finished build to its kept place; atomic, so a concurrent reader finds the whole file or none. A cache
    that cannot be written costs the next venv a build, nothing else."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        shutil.copyfile(built, partial)
        os.replace(partial, path)
    except OSError:
        pass


def load_or_build(name: str, source: Path, cflags: Sequence[str], ldflags: Sequence[str], folder: str,
                  verbose: bool = False) -> Any:
    """The extension `name`: imported from its kept build when there is one, else built by torch in
    `build_dir(folder)` and kept. Raises what torch's build raises (compiler or ninja missing, a build error)."""
    kept = kept_library(name, source, [*cflags, "|", *ldflags])
    if kept.exists():
        try:
            return import_library(name, kept)
        except ImportError:  # a library this torch cannot load (a half-copied file cannot exist): build it afresh
            pass
    from torch.utils.cpp_extension import load

    directory = build_dir(folder)
    directory.mkdir(parents=True, exist_ok=True)
    with environment_ninja():
        module = load(name=name, sources=[str(source)], build_directory=str(directory), extra_cflags=list(cflags),
                      extra_ldflags=list(ldflags), verbose=verbose)
    keep(Path(module.__file__), kept)
    return module


@contextlib.contextmanager
def environment_ninja() -> Iterator[None]:
    """torch's build runs the first `ninja` on PATH: make it the one installed beside this interpreter (the `cpu`
    extra's) whether or not the venv is activated. Two ninja versions on one build dir each discard the other's log
    (1.11 writes v5, 1.13 v7: "log version too old; starting over") and rebuild the kernel, ~25 s of an engine start,
    whenever a shell with the venv activated and one without take turns."""
    here = Path(sys.executable).parent
    path = os.environ.get("PATH", "")
    if not (here / "ninja").is_file() or path.split(os.pathsep)[0] == str(here):
        yield
        return
    os.environ["PATH"] = f"{here}{os.pathsep}{path}"
    try:
        yield
    finally:
        os.environ["PATH"] = path
