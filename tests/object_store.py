"""A real S3-compatible server on loopback for the object-store tests: moto's server mode in
a process of its own (its own port; stopped by PID), and a TCP proxy in front of it that can
stall a response mid-body, as a congested or half-dead store does.

    with S3Server.start(tmp) as s3:
        s3.upload_dir(packed.out_dir, "bucket", "artifacts/v1")
        fetch = s3.fetch_config(read_timeout_s=2)
        ... f"s3://bucket/artifacts/v1/manifest.json" ...
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.contracts import FetchConfig
from rollout.local.cluster import free_port

# moto accepts any credentials; boto3 and s3fs read these from the environment.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class StallingProxy:
    """Forwards loopback TCP to ``upstream``. ``stall_after(n, times)``: the next ``times``
    connections (every one: None) whose answers pass ``n`` bytes stop forwarding there and
    hold the socket open (no bytes, no close). Counts the stalls it made and the bytes it
    passed back."""

    upstream: int
    port: int = field(default_factory=free_port)
    stalls: int = 0
    bytes_back: int = 0
    _stall_after: int | None = None
    _stalls_left: int | None = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _closed: threading.Event = field(default_factory=threading.Event)

    def start(self) -> StallingProxy:
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def stall_after(self, nbytes: int | None, times: int | None = 1) -> None:
        with self._lock:
            self._stall_after, self._stalls_left = nbytes, times

    def close(self) -> None:
        self._closed.set()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(client,), daemon=True).start()

    def _pipe(self, client: socket.socket) -> None:
        server = socket.create_connection(("127.0.0.1", self.upstream))
        sent_back = 0
        stalling = False
        try:
            while not self._closed.is_set():
                ready, _, _ = select.select([client, server], [], [], 0.5)
                if stalling:
                    if client in ready and not client.recv(65536):
                        return  # the client gave up on the stalled answer
                    continue
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    if sock is server:
                        with self._lock:
                            limit = self._stall_after
                            if limit is not None and sent_back + len(data) > limit:
                                if self._stalls_left is not None:
                                    self._stalls_left -= 1
                                    if self._stalls_left <= 0:
                                        self._stall_after = None
                                self.stalls += 1
                                stalling = True
                                data = data[: max(0, limit - sent_back)]
                        client.sendall(data)
                        sent_back += len(data)
                        with self._lock:
                            self.bytes_back += len(data)
                        if stalling:
                            break
                    else:
                        server.sendall(data)
        except OSError:
            return
        finally:
            client.close()
            server.close()


@dataclass
class S3Server:
    process: subprocess.Popen[bytes]
    port: int
    proxy: StallingProxy

    @classmethod
    @contextmanager
    def start(cls, log_dir: Path) -> Iterator[S3Server]:
        port = free_port()
        binary = Path(sys.executable).parent / "moto_server"
        log = open(log_dir / "moto.log", "wb")  # noqa: SIM115 - closed below
        process = subprocess.Popen(
            [str(binary), "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **CREDENTIALS},
        )
        proxy = StallingProxy(upstream=port).start()
        server = cls(process, port, proxy)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"moto_server did not start: see {log.name}") from None
                    time.sleep(0.2)
            saved = {k: os.environ.get(k) for k in CREDENTIALS}
            os.environ.update(CREDENTIALS)
            try:
                yield server
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
        finally:
            proxy.close()
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
            log.close()

    @property
    def url(self) -> str:
        """Through the proxy (which passes everything until told to stall)."""
        return f"http://127.0.0.1:{self.proxy.port}"

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{self.port}", **_boto_args())

    def upload_dir(self, directory: Path, bucket: str, prefix: str) -> str:
        """Every file of ``directory`` under ``prefix``; the manifest's ``s3://`` URI."""
        client = self.client()
        with suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=bucket)
        for path in sorted(directory.rglob("*")):
            if path.is_file():
                key = f"{prefix}/{path.relative_to(directory).as_posix()}"
                client.upload_file(str(path), bucket, key)
        return f"s3://{bucket}/{prefix}/manifest.json"

    def fetch_config(self, **changes: Any) -> FetchConfig:
        return FetchConfig(s3_endpoint_url=self.url, **changes)


def _boto_args() -> dict[str, str]:
    return {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": CREDENTIALS["AWS_DEFAULT_REGION"],
    }
