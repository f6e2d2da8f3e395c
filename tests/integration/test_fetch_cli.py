"""``rollout verify`` against artifact stores that fail, as a script runs it: the installed
binary as a subprocess, real HTTP servers on loopback. A store out of reach exits 7 with
``error[fetch]`` (retry later); a URI the service does not read from exits 3 (``rejected:
path``); a store whose driver is not installed exits 6 (``error[config]``); none shows the
URI's credentials."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from rollout.local.cluster import free_port

ROLLOUT = str(Path(sys.executable).with_name("rollout"))
PASSWORD = "hunter2-pass"
SIGNATURE = "f00dfacecafe5ec2e7"
DIGEST = "ab" * 32


def verify(uri: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ROLLOUT, "verify", uri, "--sha256", DIGEST, "--cache", str(tmp_path / "cache")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


@contextmanager
def answering(status: int, headers: dict[str, str] | None = None) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_store_that_is_not_listening_exits_7_with_error_fetch(tmp_path: Path) -> None:
    uri = f"http://reader:{PASSWORD}@127.0.0.1:{free_port()}/a/manifest.json"
    done = verify(f"{uri}?X-Amz-Signature={SIGNATURE}", tmp_path)
    assert done.returncode == 7, (done.returncode, done.stderr)
    line = one_line(done)
    assert line.startswith("error[fetch]:") and "Connection refused" in line, line
    assert not line.startswith("error[fetch]: fetch:"), line  # the category once
    assert PASSWORD not in done.stderr and SIGNATURE not in done.stderr, done.stderr


def test_a_server_error_exits_7(tmp_path: Path) -> None:
    with answering(503) as base:
        done = verify(f"{base}/a/manifest.json", tmp_path)
    assert done.returncode == 7, (done.returncode, done.stderr)
    assert one_line(done).startswith("error[fetch]:") and "HTTP 503" in done.stderr


@pytest.mark.skipif(importlib.util.find_spec("s3fs") is not None, reason="s3fs is installed")
def test_a_missing_s3_driver_exits_6_naming_it(tmp_path: Path) -> None:
    done = verify("s3://bucket/ranker-v42/manifest.json", tmp_path)
    assert done.returncode == 6, (done.returncode, done.stderr)
    assert one_line(done).startswith("error[config]:") and "s3fs" in done.stderr


@pytest.mark.parametrize("uri", ["ftp://store.example/a/manifest.json", "memory://a/manifest.json"])
def test_a_scheme_outside_the_allowlist_exits_3_naming_it(tmp_path: Path, uri: str) -> None:
    done = verify(uri, tmp_path)
    assert done.returncode == 3, (done.returncode, done.stderr)
    scheme = uri.split(":")[0]
    assert one_line(done).startswith(f"rejected: path: URI scheme {scheme!r} is not allowed")


def test_a_redirect_to_another_scheme_exits_3(tmp_path: Path) -> None:
    location = f"https://127.0.0.1:{free_port()}/a/manifest.json?X-Amz-Signature={SIGNATURE}"
    with answering(302, {"Location": location}) as base:
        done = verify(f"{base}/a/manifest.json", tmp_path)
    assert done.returncode == 3, (done.returncode, done.stderr)
    line = one_line(done)
    assert line.startswith("rejected: path:") and "http -> https" in line, line
    assert SIGNATURE not in done.stderr
