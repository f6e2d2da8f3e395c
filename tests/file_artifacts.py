"""Builders of generic (non-model) artifacts for cache and manifest tests, plus a tiny HTTP
artifact server whose downloads a test can hold midway."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from app.manifest import MANIFEST_NAME, Architecture, sha256_hex
from app.packing import PackResult, pack_artifact

ARCH = Architecture(name="ranker-mlp", version=1, params={})


def make_file_artifact(
    root: Path, files: dict[str, bytes], artifact_id: str = "blob-1", **kwargs: Any
) -> PackResult:
    src = root / f"src-{artifact_id}"
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    return pack_artifact(
        src,
        root / artifact_id,
        model="ranker",
        artifact_id=artifact_id,
        feature_schema="ranker-features-v3",
        architecture=ARCH,
        **kwargs,
    )


def rewrite_manifest(result: PackResult, mutate: Any) -> str:
    """Apply ``mutate(dict)`` to the stored manifest; return the new manifest digest (as a
    registry that pinned the rewritten manifest would)."""
    path = result.out_dir / MANIFEST_NAME
    doc = json.loads(path.read_bytes())
    mutate(doc)
    data = json.dumps(doc, indent=2).encode()
    path.write_bytes(data)
    return sha256_hex(data)


def file_entry(path: str, data: bytes) -> dict[str, Any]:
    return {"path": path, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


class HeldFileServer:
    """Serves a directory over HTTP; GETs of ``held`` stop after ``held_after`` bytes until
    ``release`` is set. ``holding`` is set once a download is being held."""

    def __init__(self, directory: Path, held: str | None = None, held_after: int = 0) -> None:
        self.release = threading.Event()
        self.holding = threading.Event()
        outer = self

        class Handler(SimpleHTTPRequestHandler):
            def __init__(self, *args: Any, **kw: Any) -> None:
                super().__init__(*args, directory=str(directory), **kw)

            def log_message(self, *args: Any) -> None:
                pass

            def copyfile(self, source: Any, outputfile: Any) -> None:
                if held is None or not self.path.endswith("/" + held):
                    return super().copyfile(source, outputfile)
                outputfile.write(source.read(held_after))
                outputfile.flush()
                outer.holding.set()
                outer.release.wait(timeout=60)
                return super().copyfile(source, outputfile)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def uri(self, rel: str) -> str:
        return f"{self.base}/{rel}"

    @contextmanager
    def running(self) -> Iterator[HeldFileServer]:
        thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.release.set()
            self.httpd.shutdown()
            self.httpd.server_close()
