"""The fault side of benchmarks/soak.py: this run's processes, and the faults injected through the endpoint (the
engine paused then killed, clients that leave mid-request, oversize bodies, a canary whose engine dies and a
promotion), the registry they use, and the cool-down and capture readings after them."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

LEAVING = "I will not wait for this: "  # the prompts of clients that leave (told apart in the capture)
PROMPTS = ["Write a haiku about the sea.", "List three colors.", "Say hello in French.",
           "What is 2 + 2? Answer briefly.", "Name a fruit that is yellow.", "Describe a cat in one sentence."]


def sse_outcome(lines: list[str]) -> tuple[bool, dict | None, int]:
    """(ended with [DONE], the last error event if one came, data chunks before the end) of an SSE stream's lines."""
    done, error, chunks = False, None, 0
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            error = event["error"]
        else:
            chunks += 1
    return done, error, chunks


ROOT: list[int] = []  # the endpoint's driver process (`python -m serve.production`), set by the soak


def descendants() -> list[psutil.Process]:
    try:
        return psutil.Process(ROOT[0] if ROOT else None).children(recursive=True)
    except psutil.Error:
        return []


def our_processes() -> dict[str, list[psutil.Process]]:
    """The engine, watchdog and Serve actor processes of this run: descendants of its driver (its local Ray), never
    another run's on a shared machine."""
    groups: dict[str, list[psutil.Process]] = {"engine": [], "watchdog": [], "ingress": [], "proxy": [],
                                               "replicas": []}
    for proc in descendants():
        try:
            cmd = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "serve.engines.watchdog" in cmd:
            groups["watchdog"].append(proc)
        elif "serve.engines.cpu" in cmd and "--model-path" in cmd:
            groups["engine"].append(proc)
        elif "OpenAIIngress" in cmd:
            groups["ingress"].append(proc)
        elif "ProxyActor" in cmd:
            groups["proxy"].append(proc)
        elif "ServeReplica:" in cmd or "ServeController" in cmd:
            groups["replicas"].append(proc)
    return groups


def rss_now() -> dict[str, int]:
    """Per group: RSS (`name`) and private memory (`name private`, USS). RSS also counts the pages of Ray's shared
    object store a process has touched (request bodies travel from the proxy to a replica through it), which stay
    mapped and are reused: private memory is what a process holds itself."""
    sample: dict[str, int] = {}
    for name, procs in our_processes().items():
        rss = uss = 0
        for proc in procs:
            try:
                rss += proc.memory_info().rss
                uss += proc.memory_full_info().uss
            except psutil.Error:
                pass
        sample[name], sample[f"{name} private"] = rss, uss
    return sample


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def engine_process() -> psutil.Process | None:
    engines = [p for p in our_processes()["engine"] if alive(p)]
    return engines[0] if len(engines) == 1 else None


FAULTS_FROM = 0.15  # share of the run before any fault (the memory's start level is read then)


async def faults(base: str, run: Any, pause: bool = True, kill: bool = True) -> None:
    """The engine paused at 25% of the run, killed at 50%; each fault's window ends when /health is 200 again."""
    args = run.args
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        async def healthy_again(window: list[float]) -> None:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                try:
                    if (await http.get("/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
            window[1] = run.now()

        await asyncio.sleep(0.25 * args.duration)
        engine = engine_process() if pause else None
        if engine is not None:
            window = [run.now(), 0.0]
            run.windows.append(window)
            engine.send_signal(signal.SIGSTOP)
            run.events.append(f"{window[0]:.0f} s: engine {engine.pid} SIGSTOP for {args.pause_s:g} s")
            await asyncio.sleep(args.pause_s)  # the fault's length
            engine.send_signal(signal.SIGCONT)
            await healthy_again(window)
        await asyncio.sleep(max(0.0, run.started + 0.5 * args.duration - time.monotonic()))
        engine = engine_process() if kill else None
        if engine is not None:
            window = [run.now(), 0.0]
            run.windows.append(window)
            engine.kill()
            run.events.append(f"{window[0]:.0f} s: engine {engine.pid} SIGKILL")
            await healthy_again(window)
            run.events.append(f"{window[1]:.0f} s: /health 200 again (replica replaced)")


async def disconnecting_client(base: str, key: str, idx: int, run: Any) -> None:
    """Leaves mid-request: a stream closed after its first event, or a plain request whose socket is closed once
    sent (the engine must stop decoding for both)."""
    headers = {"Authorization": f"Bearer {key}"}
    host, port = base.rsplit("/", 1)[-1].split(":")
    await asyncio.sleep(FAULTS_FROM * run.args.duration)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=120) as http:
        n = 0
        while run.running():
            n += 1
            body = {"model": "m", "max_tokens": 64, "temperature": 0, "ignore_eos": True,  # LEAVING: not a client's
                    "messages": [{"role": "user", "content": LEAVING + PROMPTS[(idx + n) % len(PROMPTS)]}]}
            try:
                if n % 2:
                    async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
                        async for _ in response.aiter_lines():
                            break
                else:
                    payload = json.dumps(body).encode()
                    reader, writer = await asyncio.open_connection(host, int(port))
                    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: "
                                 + str(len(payload)).encode() + b"\r\n\r\n" + payload)
                    await writer.drain()
                    await asyncio.sleep(0.5)
                    writer.close()
                run.counts["disconnects"] += 1
            except (httpx.HTTPError, OSError) as exc:
                run.counts[f"disconnect client {type(exc).__name__}"] += 1
            await asyncio.sleep(1.0)


def _chunked_upload(base: str, key: str, mib: int) -> str:
    """A chunked POST of `mib` MiB without a Content-Length, written by hand; the status the server answered."""
    host, port = base.rsplit("/", 1)[-1].split(":")
    with socket.create_connection((host, int(port)), timeout=120) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                     b"Content-Type: application/json\r\nAuthorization: Bearer " + key.encode() + b"\r\n\r\n")
        chunk = b"x" * 2**20
        try:
            for _ in range(mib):
                sock.sendall(b"100000\r\n" + chunk + b"\r\n")
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed: read what it said
        try:
            reply = sock.recv(256)
        except OSError as exc:
            return type(exc).__name__
    return reply.split(b" ", 2)[1].decode() if reply.startswith(b"HTTP/") else "no answer"


async def oversize_client(base: str, key: str, run: Any) -> None:
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
    await asyncio.sleep(FAULTS_FROM * run.args.duration)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=120) as http:
        n = 0
        while run.running():
            n += 1
            if n % 2:
                status = await asyncio.to_thread(_chunked_upload, base, key, run.args.oversize_mib)
                run.counts[f"oversize chunked {run.args.oversize_mib} MiB -> {status}"] += 1
            else:
                try:
                    response = await http.post("/v1/completions", content=b'{"prompt": "' + b"x" * 5_000_000 + b'"}')
                    status = str(response.status_code)
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                run.counts[f"oversize 5 MB with Content-Length -> {status}"] += 1
            if status != "413":
                run.failures.append(f"oversize body answered {status}")
            await asyncio.sleep(2.0)


def cool_down(base: str, key: str) -> tuple[dict[str, int], float | None]:
    """Memory once the engine is idle (`rss_now`, median of three samples 2 s apart), and the engine's running
    requests then."""
    running = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30).text
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith('specdec_engine_requests{state="running"}')]
        running = values[0] if values else None
        if running == 0:
            break
        time.sleep(1.0)  # polling a condition under a deadline
    samples = []
    for _ in range(3):
        samples.append(rss_now())
        time.sleep(2.0)
    return {k: int(statistics.median(s[k] for s in samples)) for k in samples[0]}, running


# --- the closed loop's faults: a canary whose engine dies, a promotion mid-soak ------------------------------------

REGISTERED = "specdec-soak"
NGRAM = {"algorithm": "ngram", "num_draft_tokens": 4, "max_bfs_breadth": 2, "min_bfs_breadth": 1,
         "match_type": "BFS", "max_trie_depth": 8, "capacity": 100000}


def registry(folder: Path, args: Any) -> tuple[str, Any]:
    """MLflow on SQLite with version 1 (the baseline, in production), 2 and 3 (NGRAM configs: the canary that dies,
    the promoted one); returns its URI and the promotion (alias production -> 3)."""
    from pipeline.records.registry import CANDIDATE, register_config, set_production
    from pipeline.records.tracking import Tracker
    from serve.engines.base import ReplicaConfig
    from serve.serving import Provenance, ServingConfig

    uri = f"sqlite:///{folder / 'mlflow.db'}"
    tracker = Tracker(uri, "soak", artifact_dir=folder / "artifacts")
    run_id = tracker.client().create_run(tracker.experiment_id(), run_name="soak").info.run_id
    for spec, production in (({"algorithm": "none"}, True), (NGRAM, False), ({**NGRAM, "num_draft_tokens": 3}, False)):
        config = ServingConfig(replica=ReplicaConfig(model=args.model, threads=args.threads, spec=spec),
                               provenance=Provenance(study="soak", decision="promote", source="soak",
                                                     workload="soak", workload_digest="0" * 16))
        register_config(tracker, run_id, REGISTERED, config, move_production=production,
                        alias="production" if production else CANDIDATE)
    return uri, lambda: set_production(tracker, REGISTERED, "3")


def captured(folder: Path) -> int | None:
    """Capture rows of the streaming clients' requests (not those of clients that left), None without a capture."""
    import pyarrow.parquet as pq

    if not folder.is_dir():
        return None
    rows = [r for part in sorted(folder.glob("part-*.parquet")) for r in pq.read_table(part).to_pylist()]
    return sum(1 for r in rows if not json.loads(r["messages"] or "[{}]")[-1].get("content", "").startswith(LEAVING))



def canary_engine() -> psutil.Process | None:
    """The candidate's engine process (under the `<app>-canary` replica), None when there is none."""
    for proc in descendants():
        try:
            if "ServeReplica:production-canary:" not in " ".join(proc.cmdline()):
                continue
            found = [p for p in proc.children(recursive=True)
                     if "serve.engines.cpu" in " ".join(p.cmdline()) and "--model-path" in p.cmdline()]
        except psutil.Error:
            continue
        if found:
            return found[0]
    return None


async def _poll(what: str, check: Any, deadline_s: float, period_s: float = 0.5) -> Any:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        found = await check()
        if found:
            return found
        await asyncio.sleep(period_s)  # polling a condition under a deadline
    raise TimeoutError(f"soak: {what} not within {deadline_s:.0f} s")


async def loop_faults(base: str, admin: str, run: Any, promote: Any) -> None:
    """After the engine's faults: a canary (share 0.5) whose engine is SIGKILLed once it has answered requests, then
    a promotion as the loop makes it (a canary of the next version, stopped, the alias moved by `promote()`, the
    endpoint rolling to it). Each phase is a strict window: a request that fails in it is a failure of the soak."""
    headers = {"Authorization": f"Bearer {admin}"}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=60) as http:
        async def canary() -> dict:
            return (await http.get("/v1/canary")).json()

        async def start(version: str) -> None:
            body = {"candidate": {"registered_model": run.registered_model, "version": version}, "share": 0.5}
            answer = await http.post("/v1/canary/start", json=body)
            assert answer.status_code == 200, answer.text
            state = await _poll("the candidate running", lambda: _state(canary, ("running", "failed")), 900)
            assert state["state"] == "running", state
            await _poll("the candidate answering", lambda: _answered(canary, 8), 600)

        window = [run.now(), 0.0]
        run.strict_windows.append(window)
        await start(run.canary_version)
        engine = canary_engine()
        assert engine is not None, "no candidate engine found"
        engine.kill()
        run.events.append(f"{run.now():.0f} s: the candidate's engine {engine.pid} SIGKILL (canary of version "
                          f"{run.canary_version} at share 0.5)")
        ended = await _poll("the canary failing", lambda: _state(canary, ("failed",)), 300)
        run.loop_figures["candidate requests before its engine died"] = ended["requests"]["candidate"]
        metrics = (await http.get("/metrics")).text
        run.loop_figures["requests production took over from the dead candidate"] = sum(
            float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
            if line.startswith("specdec_generation_requests_total{") and 'arm="candidate"' in line
            and 'status="503"' in line)
        run.events.append(f"{run.now():.0f} s: canary {ended['state']}: {ended['reason'][:120]}")
        await asyncio.sleep(5.0)  # traffic on production alone before the promotion starts
        window[1] = run.now()

        window = [run.now(), 0.0]
        run.strict_windows.append(window)
        await start(run.promote_version)
        stopped = await http.post("/v1/canary/stop", json={"reason": "promoted: the canary ends first"})
        assert stopped.status_code == 200, stopped.text
        await _poll("the canary off", lambda: _state(canary, ("off",)), 300)
        rolled_at = run.now()
        await asyncio.to_thread(promote)
        run.events.append(f"{rolled_at:.0f} s: canary of version {run.promote_version} stopped; alias production -> "
                          f"version {run.promote_version}")

        async def serving() -> bool:
            return (await http.get("/v1/config")).json().get("version") == run.promote_version

        await _poll("the endpoint serving the promoted version", serving, 900)
        run.loop_figures["roll to the promoted version, s"] = round(run.now() - rolled_at, 1)
        run.events.append(f"{run.now():.0f} s: the endpoint serves version {run.promote_version}")
        await asyncio.sleep(5.0)
        window[1] = run.now()
    run.loop_done = True


async def _state(canary: Any, states: tuple[str, ...]) -> dict | None:
    found = await canary()
    return found if found.get("state") in states else None


async def _answered(canary: Any, n: int) -> dict | None:
    found = await canary()
    return found if (found.get("requests") or {}).get("candidate", 0) >= n else None
