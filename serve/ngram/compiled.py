"""`NgramCache` compiled: the trie of `serve.ngram.trie` ported to C++ (`csrc/ngram_trie.cpp`), for the acceptance
simulator, which replays every config of a space through a fresh trie (pipeline/simulate/replay.py). In Python the
trie is most of that replay's time; compiled, a replay is several times faster (docs/benchmarks.md "Predict").

The Python trie stays the specification and the engine's own; this one is held to it decision for decision by
tests/unit/test_ngram_compiled.py (random streams, small capacities that evict, both match types, every tree
compared) and, through the simulator, by the exactness tests against the engine's measured accept lengths.

The library is built with g++ on first use (about 2 s) under the cache root (`$SPECDEC_CACHE`, else
`~/.cache/specdec-tuner`), one build per source text, and loaded through ctypes (no Python headers, no torch).
`ngram_cache(...)` returns the compiled trie when it loads and the Python one otherwise, saying why once; the
environment variable `SPECDEC_NGRAM_TRIE=python` asks for the Python one (a side-by-side benchmark's other side).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

from serve.model_store import cache_root
from serve.ngram.drafttree import token_ids
from serve.ngram.trie import MatchState, NgramCache

__all__ = ["CompiledNgramCache", "CompiledUnavailable", "SOURCE", "TRIE_ENV", "available", "build", "library",
           "ngram_cache", "wanted"]

SOURCE = Path(__file__).with_name("csrc") / "ngram_trie.cpp"
TRIE_ENV = "SPECDEC_NGRAM_TRIE"  # "python": never the compiled trie
# -ffp-contract=off: the replay's pricing (sdt_price_solo) must add and multiply as Python does, never fused
FLAGS = ("-std=c++17", "-O2", "-ffp-contract=off", "-shared", "-fPIC")

log = logging.getLogger(__name__)

_I32P = ctypes.POINTER(ctypes.c_int32)
_LOCK = threading.Lock()


class _Loaded:
    lib: ctypes.CDLL | None = None
    why: str | None = None  # the reason it cannot load (remembered: one build attempt per process)
    said = False  # the fallback was logged


class CompiledUnavailable(RuntimeError):
    """The compiled trie cannot be built or loaded here; the message says why and what fixes it."""


def _library_path() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"ngram-trie-{key}" / "libngramtrie.so"


def build(path: Path) -> None:
    """Compile the library to `path` (a lock beside it: concurrent builders wait and find it built)."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise CompiledUnavailable("no C++ compiler on PATH (g++ or c++); install one, e.g. apt-get install g++")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building the same source waits, then finds it built
        if path.exists():
            return
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(partial)], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            raise CompiledUnavailable(f"{compiler} failed on {SOURCE}: {done.stderr[-1500:]}")
        os.replace(partial, path)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    vp, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    signatures = {
        "sdt_cache_new": ([i32, i64, i32, i32, i32, i32], vp), "sdt_cache_free": ([vp], None),
        "sdt_cache_reset": ([vp], None), "sdt_cache_nodes": ([vp], i64),
        "sdt_cache_insert": ([vp, _I32P, i32], None), "sdt_state_new": ([], vp), "sdt_state_free": ([vp], None),
        "sdt_cache_build": ([vp, _I32P, i32, vp, i64, i32, _I32P, _I32P], i32),
        "sdt_cache_step": ([vp, _I32P, i32, i32, vp, i32, _I32P], i32), "sdt_cache_queue": ([vp, _I32P, i32], None),
        "sdt_cache_land": ([vp], None), "sdt_cache_run": ([vp, _I32P, i32, i32, vp, i32, _I32P, _I32P], i32),
        # pipeline/simulate/solo.py: one config at every warm-up count of a space (pointers to numpy arrays)
        "sdt_replay_solo": ([vp, vp, vp, vp, vp, i32, vp, i32, vp, i32, vp, vp, vp, vp, vp, vp, vp], i64),
        "sdt_price_solo": ([i32, i32, i32, vp, vp, vp, vp, vp, i32, vp, vp, ctypes.c_double, i32, vp, ctypes.c_double,
                            i64, ctypes.c_double, ctypes.c_double, vp, vp, vp, vp, vp], None),
    }
    for name, (args, result) in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = args, result
    return lib


def library() -> ctypes.CDLL:
    """The loaded library, built first if needed; CompiledUnavailable (remembered) if it cannot be."""
    with _LOCK:
        if _Loaded.lib is not None:
            return _Loaded.lib
        if _Loaded.why is not None:
            raise CompiledUnavailable(_Loaded.why)
        try:
            path = _library_path()
            if not path.exists():
                build(path)
            _Loaded.lib = _declare(ctypes.CDLL(str(path)))
        except (CompiledUnavailable, OSError, subprocess.SubprocessError) as exc:
            _Loaded.why = str(exc) if isinstance(exc, CompiledUnavailable) else f"{type(exc).__name__}: {exc}"
            raise CompiledUnavailable(_Loaded.why) from exc
        return _Loaded.lib


class _NativeState:
    """A MatchState's C++ twin (owned: freed with it)."""

    __slots__ = ("lib", "handle")

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.handle = lib.sdt_state_new()

    def __del__(self) -> None:
        self.lib.sdt_state_free(self.handle)


_SEQUENCES: dict[tuple[int, ...], ctypes.Array] = {}  # CompiledNgramCache.sequence's copies


def _ints(values: Sequence[int]) -> ctypes.Array:
    return (ctypes.c_int32 * len(values))(*values)


class CompiledNgramCache(NgramCache):
    """`NgramCache` with the trie in C++: the same constructor, checks, `insert`, `draft`, `build` and `reset`, and
    the replay's `step`. A `MatchState` passed to it carries a C++ twin (created on first use); use a state with one
    cache."""

    def __init__(self, **params) -> None:
        self._lib = library()
        self._handle = None
        super().__init__(**params)  # checks the parameters, then reset() makes the C++ trie
        self._budget = self.num_draft_tokens - 1
        self._tokens = (ctypes.c_int32 * (self._budget + 1))()
        self._parents = (ctypes.c_int32 * (self._budget + 1))()

    def __del__(self) -> None:
        if getattr(self, "_handle", None) is not None:
            self._lib.sdt_cache_free(self._handle)

    def reset(self) -> None:
        if getattr(self, "_handle", None) is None:
            self._handle = self._lib.sdt_cache_new(self.max_trie_depth, self._capacity, self.min_bfs_breadth,
                                                   self.max_bfs_breadth, int(self.match_type == "PROB"),
                                                   self.num_draft_tokens)
        else:
            self._lib.sdt_cache_reset(self._handle)

    @property
    def num_nodes(self) -> int:
        return int(self._lib.sdt_cache_nodes(self._handle))

    def insert_window(self, window: list[int]) -> None:
        self._lib.sdt_cache_insert(self._handle, _ints(window), len(window))

    def _native(self, state: MatchState) -> int:
        if state.native is None:
            state.native = _NativeState(self._lib)
        return state.native.handle

    def build(self, context: Sequence[int], budget: int, state: MatchState | None = None,
              total_len: int | None = None) -> tuple[list[int], list[int]]:
        window, total = self._query(context, total_len)
        if budget > self._budget:
            tokens, parents = (ctypes.c_int32 * (budget + 1))(), (ctypes.c_int32 * (budget + 1))()
        else:
            tokens, parents = self._tokens, self._parents
        keep = state or MatchState()
        size = self._lib.sdt_cache_build(self._handle, _ints(window), len(window), self._native(keep), total, budget,
                                         tokens, parents)
        return list(tokens[:size]), list(parents[:size])

    def sequence(self, tokens: Sequence[int]) -> ctypes.Array:
        """A request's whole sequence copied for `step` (checked as `insert` checks token ids); a replayed space
        asks for the same sequences again and again, so the copies are kept (by value, a bounded number)."""
        key = tuple(tokens)
        found = _SEQUENCES.get(key)
        if found is None:
            if len(_SEQUENCES) >= 4096:
                _SEQUENCES.clear()
            found = _SEQUENCES[key] = _ints(token_ids(key, "sequence"))
        return found

    def step(self, state: MatchState, sequence: ctypes.Array, length: int, land: bool) -> tuple[int, int]:
        """One replayed verify step on a `sequence()` copy: (draft nodes a greedy verifier accepts along
        `sequence[length:]`, the tree's real nodes) of the tree drafted from `sequence[:length]` with `state`; the
        window's insert is queued (`queue`), and `land` first lands what was queued before."""
        if not 1 <= length <= len(sequence):
            raise ValueError(f"ngram: length must be in [1, {len(sequence)}] (the sequence's tokens out so far), "
                             f"got {length}")
        real = ctypes.c_int32()
        count = self._lib.sdt_cache_step(self._handle, sequence, length, len(sequence), self._native(state),
                                          int(land), ctypes.byref(real))
        return int(count), real.value

    def run(self, state: MatchState, sequence: ctypes.Array, length: int, land: bool) -> list[tuple[int, int]]:
        """Every remaining verify step of a request alone in its rounds (each step a round: each lands the previous
        step's insert, the first only when `land`), as `step` gives them one by one: (tokens kept -- accepted drafts
        and the bonus, cut at the sequence's end --, the tree's real nodes) per step, until `sequence` is out."""
        end = len(sequence)
        if not 1 <= length < end:
            raise ValueError(f"ngram: length must be in [1, {end - 1}] (tokens out, some left), got {length}")
        kept, real = (ctypes.c_int32 * (end - length))(), (ctypes.c_int32 * (end - length))()
        steps = self._lib.sdt_cache_run(self._handle, sequence, length, end, self._native(state), int(land), kept,
                                        real)
        return list(zip(kept[:steps], real[:steps]))

    def queue(self, window: Sequence[int]) -> None:
        """Queue an insert of `window` (at most max_trie_depth tokens) for `land`; `reset` drops the queue."""
        ids = self._window(window, "window")
        self._lib.sdt_cache_queue(self._handle, _ints(ids), len(ids))

    def land(self) -> None:
        """Insert the queued windows, in the order they were queued."""
        self._lib.sdt_cache_land(self._handle)


def wanted() -> bool:
    """Whether the compiled trie may be used: not when `SPECDEC_NGRAM_TRIE=python`."""
    return os.environ.get(TRIE_ENV, "").lower() != "python"


def available() -> bool:
    """Whether `ngram_cache` returns the compiled trie here."""
    if not wanted():
        return False
    try:
        library()
    except CompiledUnavailable:
        return False
    return True


def ngram_cache(**params) -> NgramCache:
    """The compiled trie with these parameters when it loads here, else the Python one (the reason logged once)."""
    if wanted():
        try:
            return CompiledNgramCache(**params)
        except CompiledUnavailable as exc:
            if not _Loaded.said:
                _Loaded.said = True
                log.warning("ngram: the compiled trie is unavailable (%s); the replay runs the Python trie, several "
                            "times slower", exc)
    return NgramCache(**params)
