"""The CLI's progress bars follow a load's stages (rollout/cli/progress.py ``watching`` over
app/loading/control.py ``LoadControl``): a stage that begins and ends between two looks of
the watcher still gets its bar, with its last figures."""

from __future__ import annotations

from typing import Any

from app.loading.control import LoadControl
from rollout.cli.progress import watching


class RecordedBars:
    """Bars that keep what they were told (the real ones draw with rich)."""

    def __init__(self) -> None:
        self.updates: list[tuple[str, int, int | None]] = []

    def update(self, name: str, done: int, total: int | None = None) -> None:
        self.updates.append((name, done, total))


def test_the_control_keeps_the_figures_of_the_stages_that_ended() -> None:
    control = LoadControl(clock=iter([0.0, 2.0, 2.5, 3.0]).__next__)
    control.begin("verify", 100)
    control.advance("verify", 100)
    control.begin("load", 40)
    control.advance("load", 10)
    (ended,) = control.ended()
    assert (ended.stage, ended.done_bytes, ended.total_bytes, ended.elapsed_s) == (
        "verify",
        100,
        100,
        2.0,
    )
    now = control.progress()
    assert now is not None and (now.stage, now.done_bytes) == ("load", 10)


def test_a_stage_missed_between_two_looks_still_gets_its_bar() -> None:
    bars: Any = RecordedBars()
    with watching(LoadControl(), bars) as control:
        # Both stages well inside one refresh interval: the poller never sees "re-hash".
        control.begin("verify", 64)
        control.advance("verify", 64)
        control.begin("load", 8)
        control.advance("load", 8)
    assert bars.updates[-2:] == [("re-hash", 64, 64), ("load", 8, 8)]
