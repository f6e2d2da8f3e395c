"""app/safe_files.py: the one policy for opening files someone else may have put there, as
the cache, the artifact store's local source and the key files use it (each caller's own
wording of the errors is tested with the caller)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from app.safe_files import UnsafeFile, file_kind, open_regular, read_regular


def test_a_regular_file_is_read_in_blocking_mode(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x" * 100)
    fd = open_regular(path, "weights")
    try:
        assert os.get_blocking(fd)  # O_NONBLOCK was only for the open
        assert os.read(fd, 200) == b"x" * 100
    finally:
        os.close(fd)


def test_reads_stop_one_byte_past_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "big"
    path.write_bytes(b"y" * 1000)
    assert read_regular(path, "big", 10) == b"y" * 11  # one more: the caller sees "too long"
    assert read_regular(path, "big", 1000) == b"y" * 1000


def test_a_symlink_is_refused_unless_it_is_to_be_followed(tmp_path: Path) -> None:
    target = tmp_path / "key.pem"
    target.write_bytes(b"secret")
    link = tmp_path / "link.pem"
    link.symlink_to(target)
    with pytest.raises(UnsafeFile) as raised:
        open_regular(link, "cached file 'a'")
    assert raised.value.kind == "symlink"
    assert str(raised.value) == "cached file 'a' is a symlink"
    # Mounted secrets are symlinks: key files follow them.
    assert read_regular(link, "trust key", 100, follow_symlinks=True) == b"secret"


def test_a_fifo_is_refused_at_once_instead_of_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for follow in (False, True):
        with pytest.raises(UnsafeFile) as raised:
            read_regular(fifo, "manifest", 100, follow_symlinks=follow)
        assert raised.value.kind == "not_regular"
        assert str(raised.value) == "manifest is not a regular file but a FIFO"


def test_a_directory_and_a_socket_are_named_for_what_they_are(tmp_path: Path) -> None:
    with pytest.raises(UnsafeFile, match="is not a regular file but a directory"):
        open_regular(tmp_path, "weights")
    sock_path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(sock_path))
        with pytest.raises(OSError):  # a socket cannot even be opened: ENXIO, as it is
            open_regular(sock_path, "weights")
    assert file_kind(os.lstat(sock_path).st_mode) == "a socket"


def test_a_missing_file_is_the_opens_own_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_regular(tmp_path / "absent", "weights")
