"""A real local HTTP server with scripted answers, for tests of a client of an engine-shaped peer (a refused flush,
a replica's start statuses): `answer(method, path)` returns (status, body) for each request."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Answer = Callable[[str, str], "tuple[int, bytes]"]


@contextmanager
def local_server(answer: Answer) -> Iterator[str]:
    """Serves on 127.0.0.1 (a free port) while the block runs; yields its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def _reply(self) -> None:
            status, body = answer(self.command, self.path)
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _reply  # noqa: N815 - http.server's naming

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
