"""free_port hands one process's components ports of their own: `ray start` refuses a node
whose components share one, and the kernel may give a just-closed port to the next bind."""

from __future__ import annotations

import socket

from rollout.local.cluster import free_port


def test_a_process_is_never_given_the_same_port_twice() -> None:
    ports = [free_port() for _ in range(400)]
    assert len(set(ports)) == len(ports)


def test_each_port_given_is_free_to_bind() -> None:
    for _ in range(20):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", free_port()))
