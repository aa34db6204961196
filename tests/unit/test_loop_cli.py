"""The loop's command lines: durations as people write them, and clear refusals: an endpoint without the loop's
routes, a registry without production."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from pipeline.loop.__main__ import duration_s
from pipeline.loop.__main__ import main as loop_main
from pipeline.loop.retune import main as retune_main


def test_durations_read_as_people_write_them():
    assert [duration_s(t) for t in ("6h", "30m", "90s", "1.5d", "600", "off", "0")] == \
        [21600, 1800, 90, 129600, 600, None, None]
    with pytest.raises(ValueError, match="'six hours' is not a duration; give e.g. 6h"):
        duration_s("six hours")


@pytest.mark.parametrize("flag, value", [("--trials", "0"), ("--measure-prompts", "two"), ("--warmup-prompts", "-1")])
def test_re_tune_sizes_are_refused_at_the_command_line_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as stopped:
        loop_main(["--endpoint", "http://127.0.0.1:9", "--tracking-uri", "sqlite://", flag, value])
    assert stopped.value.code == 2
    assert f"argument {flag}: {value!r}: give a whole number" in capsys.readouterr().err


class OldEndpoint(BaseHTTPRequestHandler):
    """An endpoint from before the closed loop: /v1/config, and 404 for the loop's routes."""

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path != "/v1/config":
            self.send_error(404)
            return
        body = json.dumps({"version": "3", "origin": {"registered_model": "specdec-old"}}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_the_loop_stops_at_once_on_an_endpoint_without_its_routes(tmp_path, capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), OldEndpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code = loop_main(["--endpoint", f"http://127.0.0.1:{server.server_address[1]}", "--tracking-uri",
                          f"sqlite:///{tmp_path / 'mlflow.db'}", "--state-dir", str(tmp_path / "loop"), "--poll", "1s"])
    finally:
        server.shutdown()
        server.server_close()
    assert code == 2
    assert "does not serve GET /v1/live: the endpoint predates the closed loop" in capsys.readouterr().err


def test_retune_without_production_in_the_registry_says_so(tmp_path, capsys):
    code = retune_main(["--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--registered-model", "specdec-none",
                        "--capture", str(tmp_path)])
    assert code == 2
    assert "registered model 'specdec-none' has no alias 'production': nothing to re-tune from" in \
        capsys.readouterr().err
