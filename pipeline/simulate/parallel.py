"""A space's closed-loop replays spread over worker processes: each config's replay is independent of the others and
of the cost model, so a whole space replays on every core the study's process may use instead of one.

Each worker is a fresh `python -c` process (never a fork: the study's process runs Ray's threads; and not
multiprocessing's spawn, which re-runs the caller's main module) that reads its share from stdin as one pickle,
rebuilds the simulator once and writes (config key, replay, signature) back the same way. The replays are exactly the
ones the caller would compute: the same code over the same inputs. A worker that fails (logged, with the end of its
stderr) or outlives the deadline returns nothing; its configs replay in the caller on demand.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from pipeline.simulate.replay import Replay

__all__ = ["MIN_PARALLEL", "replay_in_workers", "usable_cores", "worker_main"]

MIN_PARALLEL = 48  # fewer replays than this finish before the workers would have started

log = logging.getLogger(__name__)

Result = list[tuple[str, Replay, str]]


def usable_cores() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def worker_main() -> None:
    """A worker: stdin holds pickle(sys.path) then pickle((simulator class, its parts, trials)); stdout gets
    pickle(Result)."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.path[:0] = [p for p in pickle.load(stdin) if p not in sys.path]
    make, parts, trials = pickle.load(stdin)  # the class travels by name: unpickling imports its module
    simulator = make(**parts)
    out: Result = [(t.model_dump_json(), simulator.replay(t), simulator.signature(t)) for t in trials]
    pickle.dump(out, stdout, protocol=pickle.HIGHEST_PROTOCOL)
    stdout.flush()


def replay_in_workers(make: Callable[..., Any], parts: dict[str, Any], trials: Sequence[Any], *, workers: int,
                      deadline: float | None = None) -> Result:
    """(config key, replay, signature) of each of `trials`, computed by `workers` processes, each holding a
    simulator `make(**parts)` (a class importable by name: pipeline.simulate.simulator.Simulator) and every
    `workers`-th trial (neighbours in a grid cost alike, so the shares are even).
    Waits at most until `deadline` (time.monotonic()); a worker still running then is stopped and returns nothing."""
    shares = [list(trials[i::workers]) for i in range(workers)]
    procs: list[tuple[subprocess.Popen, Any, Any]] = []
    code = "from pipeline.simulate.parallel import worker_main; worker_main()"
    try:
        for share in shares:
            # Results go to a file, not a pipe, so a worker never blocks on a full pipe while the caller waits.
            sink, errors = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=sink, stderr=errors)
            procs.append((proc, sink, errors))
            stdin = proc.stdin
            if stdin is None:
                raise OSError("no pipe to the worker")
            with stdin:
                pickle.dump(sys.path, stdin)
                pickle.dump((make, parts, share), stdin, protocol=pickle.HIGHEST_PROTOCOL)
        out: Result = []
        for proc, sink, errors in procs:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                status = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                continue
            if status == 0:
                sink.seek(0)
                out.extend(pickle.load(sink))
            else:
                errors.seek(0)
                log.warning("simulate: a replay worker exited with %s; its configs replay here: %s", status,
                            errors.read()[-2000:].decode(errors="replace"))
        return out
    except (OSError, pickle.PickleError, EOFError) as exc:
        log.warning("simulate: the replay workers failed (%s: %s); the space replays here", type(exc).__name__, exc)
        return []
    finally:
        for proc, sink, errors in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            sink.close()
            errors.close()
