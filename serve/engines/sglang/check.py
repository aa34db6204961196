"""SGLang's own verdict on our command lines, asked in a subprocess (`serve.engines.sglang.preflight`): which
ServerArgs fields the installed SGLang has, and whether its parser, `resolve_once()` and `check_server_args()` accept
an argv, resolving as a GPU of a given architecture would (`gpu_arch`). Which SGLang answers is named by the
interpreter that has it (`installed_version`): this one, the SGLang CPU venv's, or a `pip install --target` folder.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from serve.engines.sglang import verdicts
from serve.engines.base import ReplicaConfig, child_env
from serve.engines.spec_flags import effective_diff

PREFLIGHT_TIMEOUT_S = 300.0


def installed_version(python: str | None = None) -> str | None:
    """SGLang's version for `python` (None = this interpreter), None when it has none. Interpreters are told apart by
    their environment (the folder above `bin/`), not by what their symlinks resolve to: every venv of one base Python
    resolves to the same binary. Kept until a folder it looks in changes (an install does): rendering a search
    space's argvs asks once per argv."""
    own = python is None or Path(python).absolute().parent.parent == Path(sys.prefix).absolute()
    if own:
        folders = [p for p in sys.path if p]
    else:
        folders = [str(p) for p in Path(str(python)).parent.parent.glob("lib/python3*/site-packages")]
    return _installed_version(None if own else python, tuple(_stamp(f) for f in folders))


def _stamp(folder: str) -> tuple[str, int]:
    try:
        return folder, os.stat(folder).st_mtime_ns
    except OSError:
        return folder, -1


@functools.lru_cache(maxsize=16)
def _installed_version(python: str | None, stamps: tuple[tuple[str, int], ...]) -> str | None:
    if python is None:
        try:
            return metadata.version("sglang")
        except metadata.PackageNotFoundError:
            return None
    site = Path(python).parent.parent / "lib"
    found = sorted(site.glob("python3*/site-packages/sglang-*.dist-info"))
    return found[-1].name[len("sglang-"):-len(".dist-info")] if found else None


def _preflight_extra(python: str | None) -> dict[str, str]:
    """No GPU: CUDA_VISIBLE_DEVICES="" keeps SGLang's resolution from touching the replica's GPUs. With another
    interpreter (the SGLang CPU venv's), SGLang resolves as its CPU platform does at launch
    (SGLANG_USE_CPU_ENGINE=1)."""
    return {"CUDA_VISIBLE_DEVICES": "", **({"SGLANG_USE_CPU_ENGINE": "1"} if python is not None else {})}


def _preflight_process(request: dict[str, Any], timeout_s: float, sglang_path: str | None,
                       python: str | None = None) -> subprocess.CompletedProcess | str:
    """Run serve.engines.sglang.preflight with `python` (default this interpreter) and SGLang importable from
    `sglang_path` (a `pip install --target` dir) or that interpreter's environment (`_preflight_extra`)."""
    env = child_env(_preflight_extra(python))
    if sglang_path:
        env["PYTHONPATH"] = os.pathsep.join([sglang_path, env["PYTHONPATH"]])
    try:
        return subprocess.run([python or sys.executable, "-m", "serve.engines.sglang.preflight"],
                              input=json.dumps(request), capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return f"SGLang preflight took longer than {timeout_s:.0f} s"


def _last_json(done: subprocess.CompletedProcess) -> dict[str, Any] | None:
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else None


@functools.lru_cache(maxsize=8)
def server_arg_fields(sglang_path: str | None = None, python: str | None = None) -> frozenset[str] | None:
    """The `ServerArgs` field names of the SGLang importable here (or from `sglang_path`, or by `python`); None when
    it is absent. Flags are rendered from these, so a setting the installed version lacks is refused before launch."""
    if sglang_path is None and installed_version(python) is None:
        return None
    digest = verdicts.key({"fields": True}, verdicts.package_roots(sglang_path, python), _preflight_extra(python))
    kept = verdicts.read(digest) if digest else None
    if isinstance(kept, list):
        return frozenset(kept)
    done = _preflight_process({"fields": True}, PREFLIGHT_TIMEOUT_S, sglang_path, python)
    data = None if isinstance(done, str) else _last_json(done)
    if not data or "fields" not in data:
        return None
    if digest:
        verdicts.write(digest, data["fields"])
    return frozenset(data["fields"])


@dataclass(frozen=True)
class Preflight:
    """What SGLang itself said about an argv: accepted or not (its error verbatim), and what it resolved.
    `stage` is parse/resolve/check for SGLang's verdicts, import/crash/timeout when the preflight could not run;
    `cached`: SGLang gave this verdict to the same question before (`serve.engines.sglang.verdicts`)."""

    ok: bool
    stage: str
    error: str | None
    resolved: dict[str, Any] = field(default_factory=dict)
    cached: bool = False

    @property
    def rejected(self) -> bool:
        return not self.ok and self.stage in ("parse", "resolve", "check")

    def diffs(self, config: ReplicaConfig) -> dict[str, tuple[object, object]]:
        """{setting: (requested, resolved)} where SGLang changed what was asked (e.g. the topk=1 draft rewrite)."""
        return effective_diff(config.spec, config.max_running_requests, self.resolved) if self.ok else {}

    def as_record(self) -> dict[str, Any]:
        return {"ok": self.ok, "stage": self.stage, "error": self.error, "resolved": self.resolved,
                "cached": self.cached}


def run_preflight(argvs: list[list[str]], *, parse_only: bool = False, timeout_s: float = PREFLIGHT_TIMEOUT_S,
                  sglang_path: str | None = None, python: str | None = None,
                  gpu_arch: str | list[str | None] | None = None) -> list[Preflight] | None:
    """SGLang's own parser (and, unless parse_only, resolution + checks) on each server-flag list, in one subprocess
    of `python` (default this interpreter), resolving as a GPU of `gpu_arch` would (one for all argvs or one per
    argv; None: as SGLang resolves `--device cuda` on this machine). Argvs may include a launcher prefix. None when
    SGLang is absent there. A verdict SGLang gave the same question before is read back instead
    (`serve.engines.sglang.verdicts`); only the others go to the subprocess."""
    if sglang_path is None and installed_version(python) is None:
        return None
    stripped = [_strip_launcher(a) for a in argvs]
    archs = gpu_arch if isinstance(gpu_arch, list) else [gpu_arch] * len(argvs)
    roots, extra = verdicts.package_roots(sglang_path, python), _preflight_extra(python)
    shared = verdicts.context(roots, extra)  # once: the installed packages are the same for every argv
    digests = [None if shared is None else verdicts.digest_of(verdicts.preflight_question(a, parse_only, arch), shared)
               for a, arch in zip(stripped, archs)]
    kept = [verdicts.read(d) if d else None for d in digests]
    results = {i: Preflight(**k, cached=True) for i, k in enumerate(kept) if isinstance(k, dict)}
    asked = [i for i in range(len(argvs)) if i not in results]
    if asked:
        fresh = _ask(stripped, archs, asked, parse_only, timeout_s, sglang_path, python)
        answers = {}
        for i, result in zip(asked, fresh):
            results[i] = result
            digest = digests[i]
            if digest and result.stage in ("parse", "resolve", "check"):  # SGLang's verdict, not a failed run
                answers[digest] = {"ok": result.ok, "stage": result.stage, "error": result.error,
                                   "resolved": result.resolved}
        verdicts.write_many(answers)
    return [results[i] for i in range(len(argvs))]


def _ask(argvs: list[list[str]], archs: list[str | None], asked: list[int], parse_only: bool, timeout_s: float,
         sglang_path: str | None, python: str | None) -> list[Preflight]:
    """The subprocess's verdicts on argvs[i] for i in `asked`."""
    request = {"argvs": [argvs[i] for i in asked], "parse_only": parse_only, "gpu_arch": [archs[i] for i in asked]}
    done = _preflight_process(request, timeout_s, sglang_path, python)
    if isinstance(done, str):
        return [Preflight(False, "timeout", done)] * len(asked)
    data = _last_json(done)
    if not data or "results" not in data:
        return [Preflight(False, "crash", f"preflight exited {done.returncode}: {done.stderr[-2000:]}")] * len(asked)
    return [Preflight(r["ok"], r["stage"], r["error"], r.get("resolved") or {}) for r in data["results"]]


def _strip_launcher(argv: list[str]) -> list[str]:
    return argv[argv.index("--model-path"):] if "--model-path" in argv else argv


def check_adaptive_config(path: str, python: str | None = None) -> dict[str, Any] | None:
    """SGLang's own loader on an adaptive config file ({"ok", "error", "buckets", "candidate_steps"}); None when
    SGLang is not importable by `python`."""
    if installed_version(python) is None:
        return None
    done = _preflight_process({"adaptive_config": path}, PREFLIGHT_TIMEOUT_S, None, python)
    data = None if isinstance(done, str) else _last_json(done)
    if not data or "adaptive" not in data:
        reason = done if isinstance(done, str) else f"exited {done.returncode}: {done.stderr[-2000:]}"
        return {"ok": False, "error": f"the loader could not run: {reason}", "buckets": {}, "candidate_steps": []}
    return data["adaptive"]  # type: ignore[no-any-return]
