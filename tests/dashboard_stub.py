"""A stand-in for the Ray dashboard's REST API that answers each request with the next queued
status code (and body): real HTTP on loopback, for the tests of how errors are told apart."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@contextmanager
def answering_dashboard() -> Iterator[tuple[str, list[Any]]]:
    """(base URL, the queue of answers: a status code, or (status, JSON body); 503 once it is
    empty)."""
    statuses: list[Any] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            answer = statuses.pop(0) if statuses else 503
            status, payload = answer if isinstance(answer, tuple) else (answer, None)
            body = json.dumps(payload or {"detail": "stand-in dashboard"}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_PUT = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", statuses
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
