"""Open-loop load: the seeded Poisson schedule, and the runner against a tiny local SSE server."""

from __future__ import annotations

import json
import statistics
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Iterator

import pytest

from pipeline.measure.load import LoadRequest
from pipeline.measure.summary import summarize
from pipeline.measure.openloop import poisson_schedule, run_open_loop


def test_schedule_is_seeded_poisson_and_bounded() -> None:
    a = poisson_schedule(2000, 4.0, seed=7)
    assert a == poisson_schedule(2000, 4.0, seed=7) and a != poisson_schedule(2000, 4.0, seed=8)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.1)   # mean gap 1/rate
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.15)  # exponential: sd == mean
    bounded = poisson_schedule(2000, 4.0, seed=7, max_duration_s=10.0)
    assert bounded == [x for x in a if x <= 10.0] and 20 < len(bounded) < 80
    assert poisson_schedule(0, 1.0, seed=0) == []
    for count, rate in ((-1, 1.0), (1, 0.0), (1, float("inf"))):
        with pytest.raises(ValueError, match="must be"):
            poisson_schedule(count=count, rate_per_s=rate, seed=0)


class _Sse(BaseHTTPRequestHandler):
    """Streams three tokens per request the way SGLang's /generate does, with a final meta_info."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["sampling_params"]["max_new_tokens"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(1, n + 1):
            meta: dict[str, object] = {"completion_tokens": i, "prompt_tokens": 2}
            if i == n:
                meta["finish_reason"] = {"type": "length"}
            self.wfile.write(f"data: {json.dumps({'output_ids': list(range(i)), 'meta_info': meta})}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Sse)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_runner_sends_each_request_with_the_load_record_format(server: str) -> None:
    items = [LoadRequest(index=i, text=f"p{i}", max_new_tokens=3) for i in range(6)]
    records = run_open_loop(server, items, rate_per_s=50.0, seed=1, label=2, timeout_s=30)
    assert [r.prompt_index for r in records] == list(range(6))
    assert all(r.ok and r.completion_tokens == 3 and r.output_ids == (0, 1, 2) for r in records)
    schedule = poisson_schedule(6, 50.0, seed=1)
    # a request cannot start before its arrival time
    assert all(r.start_s >= offset for r, offset in zip(records, schedule))
    summary = summarize(records, seed=0)
    assert summary.n_ok == 6 and summary.concurrency == 2


def test_runner_stops_at_the_time_bound(server: str) -> None:
    items = [LoadRequest(index=i, text="p", max_new_tokens=1) for i in range(50)]
    records = run_open_loop(server, items, rate_per_s=5.0, seed=3, max_duration_s=1.0, timeout_s=30)
    assert len(records) == len(poisson_schedule(50, 5.0, seed=3, max_duration_s=1.0)) < 50
