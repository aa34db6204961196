"""SGLang's answers kept on disk, so that the same question does not import SGLang again.

A preflight (`sglang_check.run_preflight`) and the list of `ServerArgs` fields each run a subprocess that imports
SGLang's argument code: 8-15 s on a 2-core CPU machine, paid at every engine start of a trial, of the production
endpoint and of the study's deploy files. Their answer is a function of what the key below holds, and of nothing
else: the question (an argv, its ports left out, with the GPU architecture it resolves as), the installed SGLang
(its dist-info RECORD: every installed file with its hash, so another version or a reinstall is another SGLang) and
every other installed distribution's version, our own preflight code (`OWN_SOURCES`), the files the argv names (a
model folder's JSON files, an adaptive config), the `SGLANG_*` environment (but where SGLang keeps its caches), and
the machine's CPU count and memory. Only SGLang's
verdicts are kept (accepted, or refused at parse, resolve or check), never a run that could not answer (import error,
crash, timeout); a record says when its verdict came from here (`Preflight.cached`). `SPECDEC_SGLANG_VERDICTS=0`
asks SGLang every time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from serve.engines.base import PROJECT_ROOT
from serve.model_store import cache_root

ENV_SWITCH = "SPECDEC_SGLANG_VERDICTS"
FOLDER = "sglang-verdicts"
# The argv's ports are drawn per start and change nothing SGLang resolves (neither is among the resolved keys).
PORT_FLAGS = ("--port", "--nccl-port")
# Our code the preflight subprocess runs (`python -m serve.engines.sglang.preflight` and what it imports from this
# project; tests/unit/test_sglang_verdicts.py checks the list against the subprocess's own imports).
OWN_SOURCES = ("serve/__init__.py", "serve/spec.py", "serve/engines/__init__.py", "serve/engines/base.py",
               "serve/engines/sglang/__init__.py", "serve/engines/sglang/backend.py",
               "serve/engines/sglang/preflight.py", "serve/engines/spec_flags.py")
# A named file above this size is known by its size and time, not its bytes (a corpus: SGLang's resolution reads
# no corpus, and hashing gigabytes would cost more than the import it saves).
HASHED_FILE_BYTES = 1 << 20
KEPT_FILES = 4000  # past it, the older half is removed


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def folder() -> Path:
    return cache_root() / FOLDER


def package_roots(sglang_path: str | None, python: str | None) -> list[Path]:
    """Where the preflight's packages are found, in import order: `sglang_path` (a `pip install --target` folder, put
    before the path), then the import path of `python` (None: this interpreter)."""
    if python is None or Path(python).absolute().parent.parent == Path(sys.prefix).absolute():
        roots = [Path(p) for p in sys.path if p and Path(p).is_dir()]
    else:
        roots = sorted((Path(python).parent.parent / "lib").glob("python3*/site-packages"))
    return ([Path(sglang_path)] if sglang_path else []) + roots


def sglang_record(roots: list[Path]) -> Path | None:
    """The dist-info RECORD of the SGLang that `import sglang` finds first in `roots`."""
    for root in roots:
        found = sorted(root.glob("sglang-*.dist-info/RECORD"))
        if found:
            return found[-1]
    return None


def distributions(roots: list[Path]) -> list[str]:
    """Every installed distribution with its version (dist-info folder names): SGLang's verdict can depend on what
    else is installed (a refusal that names a missing or too old module must not outlive the fix)."""
    return sorted(d.name for root in roots for d in root.glob("*.dist-info"))


@functools.lru_cache(maxsize=32)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    if size > HASHED_FILE_BYTES:
        return f"{size}:{mtime_ns}"
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def file_digest(path: Path) -> str:
    stat = path.stat()
    return _file_digest(str(path), stat.st_size, stat.st_mtime_ns)


def named_files(argv: list[str]) -> dict[str, str]:
    """{path: digest} for every argv value that names a file (its bytes) or a folder (its top-level JSON files:
    a model's config, tokenizer config, generation config)."""
    out: dict[str, str] = {}
    for value in argv:
        if value.startswith("-") or os.sep not in value:
            continue
        path = Path(value)
        if path.is_file():
            out[value] = file_digest(path)
        elif path.is_dir():
            for child in sorted(path.glob("*.json")):
                out[str(child)] = file_digest(child)
    return out


def without_ports(argv: list[str]) -> list[str]:
    out, skip = [], False
    for token in argv:
        if skip:
            out.append("<port>")
            skip = False
            continue
        skip = token in PORT_FLAGS
        out.append(token)
    return out


def machine() -> dict[str, Any]:
    memory = ""
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        memory = next((line for line in meminfo.read_text().splitlines() if line.startswith("MemTotal")), "")
    return {"cpus": os.cpu_count(), "memory": memory}


def context(roots: list[Path], extra_env: dict[str, str]) -> dict[str, Any] | None:
    """What every answer depends on besides its question (module docstring), computed once for a batch of questions;
    None where no SGLang is found in `roots` (nothing to key an answer on: it is never kept)."""
    record = sglang_record(roots)
    if record is None:
        return None
    env = {**os.environ, **extra_env}
    return {
        "sglang": file_digest(record),
        "packages": distributions(roots),
        "ours": {name: file_digest(PROJECT_ROOT / name) for name in OWN_SOURCES},
        "env": sorted((k, v) for k, v in env.items() if k == "CUDA_VISIBLE_DEVICES"
                      or (k.startswith(("SGLANG", "SGL_")) and not k.endswith("CACHE_DIR"))),
        "machine": machine(),
    }


def digest_of(question: dict[str, Any], shared: dict[str, Any]) -> str:
    """The key of `question` in the `context` it is asked in."""
    return hashlib.sha256(json.dumps({"question": question, **shared}, sort_keys=True).encode()).hexdigest()


def key(question: dict[str, Any], roots: list[Path], extra_env: dict[str, str]) -> str | None:
    """The digest of everything an answer depends on (module docstring); None where no SGLang is found in `roots`."""
    shared = context(roots, extra_env)
    return None if shared is None else digest_of(question, shared)


def preflight_question(argv: list[str], parse_only: bool, gpu_arch: str | None) -> dict[str, Any]:
    return {"argv": without_ports(argv), "files": named_files(argv), "parse_only": parse_only, "gpu_arch": gpu_arch}


def read(digest: str) -> Any | None:
    if not enabled():
        return None
    try:
        return json.loads((folder() / f"{digest}.json").read_text())["answer"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write(digest: str, answer: Any) -> None:
    """Keep `answer` (`write_many` of one)."""
    write_many({digest: answer})


def write_many(answers: dict[str, Any]) -> None:
    """Keep each {digest: answer} (atomically: another process may read or write the same key), then the folder's
    size is checked once; a failure to keep one is not an error, the next question just asks SGLang again."""
    if not enabled() or not answers:
        return
    where = folder()
    try:
        where.mkdir(parents=True, exist_ok=True)
        for digest, answer in answers.items():
            tmp = where / f".{digest}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps({"answer": answer}))
            os.replace(tmp, where / f"{digest}.json")
        # one listing per batch: a glob per answer cost 14 ms each with 4000 kept (6 s for one 430-argv preflight)
        kept = [entry for entry in os.scandir(where) if entry.name.endswith(".json")]
        if len(kept) > KEPT_FILES:
            for old in sorted(kept, key=lambda e: e.stat().st_mtime)[:len(kept) // 2]:
                Path(old.path).unlink(missing_ok=True)
    except OSError:
        return
