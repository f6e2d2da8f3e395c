"""app/supervised.py: the restart loop the replica's background threads run on."""

from __future__ import annotations

import logging

import pytest

from app.supervised import MAX_RESTART_PAUSE_S, log_crash, restart_pause, supervise


def test_the_pause_doubles_with_each_restart_up_to_its_cap() -> None:
    assert [restart_pause(n) for n in (1, 2, 3)] == [0.1, 0.2, 0.4]
    assert restart_pause(1000) == MAX_RESTART_PAUSE_S
    assert restart_pause(3, first_s=0.5, cap_s=1.0) == 1.0


def test_a_body_that_raises_is_run_again_after_the_owners_pause() -> None:
    runs: list[int] = []
    crashes: list[str] = []
    waits: list[float] = []

    def body() -> None:
        runs.append(len(runs))
        if len(runs) < 3:
            raise RuntimeError(f"bug {len(runs)}")

    def on_crash(exc: Exception) -> float:
        crashes.append(str(exc))
        return restart_pause(len(crashes))

    supervise(body, on_crash=on_crash, wait=waits.append)
    assert runs == [0, 1, 2]  # ran until it returned
    assert crashes == ["bug 1", "bug 2"]
    assert waits == [0.1, 0.2]


def test_what_is_not_an_exception_ends_the_loop() -> None:
    def body() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        supervise(body, on_crash=lambda exc: 0.0, wait=lambda s: None)


def test_the_crash_line_carries_the_traceback_scrubbed(caplog: pytest.LogCaptureFixture) -> None:
    try:
        raise ValueError("s3://key:secret@bucket/m.json unreadable")
    except ValueError as exc:
        with caplog.at_level(logging.ERROR):
            log_crash(
                logging.getLogger("t"), "r1: the worker", exc, 0.4, 3,
                lambda text: text.replace("secret", "***"),
            )  # fmt: skip
    (record,) = caplog.records
    assert record.getMessage().startswith(
        "r1: the worker died of an unexpected error; restarted in 0.4 s (3 restarts): Traceback"
    )
    assert "***" in record.getMessage() and "secret" not in record.getMessage()
