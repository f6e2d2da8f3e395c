"""A local HTTP artifact store whose downloads the test can hold (a gate, not a timer).

Serves a directory over HTTP on a free loopback port. Requests for files (not the manifest)
of a held artifact block until the test releases the gate, which makes "a slow candidate"
deterministic: the test knows the download has started and decides when it finishes.
"""

from __future__ import annotations

import functools
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


class GatedArtifactServer:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._held: dict[str, threading.Event] = {}
        self._waiting: dict[str, int] = {}
        self._lock = threading.Lock()
        handler = functools.partial(_Handler, server_state=self, directory=str(root))
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def manifest_uri(self, artifact_dir: str) -> str:
        return f"http://127.0.0.1:{self.port}/{artifact_dir}/manifest.json"

    def hold(self, artifact_dir: str) -> None:
        with self._lock:
            self._held[artifact_dir] = threading.Event()
            self._waiting[artifact_dir] = 0

    def release(self, artifact_dir: str) -> None:
        with self._lock:
            self._held[artifact_dir].set()

    def waiting(self, artifact_dir: str) -> int:
        """Requests that reached the gate so far (downloads started and held)."""
        with self._lock:
            return self._waiting.get(artifact_dir, 0)

    def _gate(self, path: str) -> None:
        parts = path.lstrip("/").split("/")
        if len(parts) < 2 or parts[-1] == "manifest.json":
            return
        with self._lock:
            gate = self._held.get(parts[0])
            if gate is None:
                return
            self._waiting[parts[0]] += 1
        gate.wait(120)

    def close(self) -> None:
        for gate in self._held.values():
            gate.set()
        self._httpd.shutdown()
        self._httpd.server_close()


class _Handler(SimpleHTTPRequestHandler):
    def __init__(self, *args: Any, server_state: GatedArtifactServer, **kwargs: Any) -> None:
        self._state = server_state
        super().__init__(*args, **kwargs)

    def do_GET(self) -> None:
        self._state._gate(self.path)
        super().do_GET()

    def log_message(self, format: str, *args: Any) -> None:
        pass
