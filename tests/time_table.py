"""Where a run's time went: seconds per test module and per marker, printed at the end of
every run (beside pytest's own slowest-tests list), so a change sees what it spends of the
suite's budget (docs/testing.md).

A test's time is its setup, call and teardown together: a module's shared fixtures (its Serve
application, its artifacts) count in the module that first asks for them, and the session's
(the cluster, the PostgreSQL server) in the first module that runs. A test carries every
marker on it, its tier's included, so the marker rows overlap and do not add up to the total.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

# Each directory under tests/ is a tier, and its tests carry the tier's marker: ``-m`` selects
# by tier as it does by scenario.
TIERS = ("unit", "inprocess", "integration", "e2e")

_seconds: dict[str, float] = defaultdict(float)
_markers_of: dict[str, tuple[str, ...]] = {}
# Marker names the run knows (pyproject's list and the tiers). A report carries its item's
# keywords (marker, module and function names alike); these pick the markers out of them. The
# reports are what a pytest-xdist controller receives: it collects no items of its own.
_marker_names: set[str] = set(TIERS)


def tier_of(path: Path) -> str | None:
    parts = path.parts
    if "tests" not in parts:
        return None
    below = parts[parts.index("tests") + 1 :]
    return below[0] if below and below[0] in TIERS else None


def pytest_configure(config: pytest.Config) -> None:
    for line in config.getini("markers"):
        _marker_names.add(line.split(":", 1)[0].split("(", 1)[0].strip())
    _marker_names.difference_update({"parametrize", "timeout", "xdist_group"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item.path)
        if tier is not None:
            item.add_marker(tier)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[report.nodeid] += report.duration
    _markers_of[report.nodeid] = tuple(sorted(k for k in report.keywords if k in _marker_names))


def rows(key_of: dict[str, tuple[str, ...]]) -> list[tuple[str, int, float]]:
    tests: dict[str, int] = defaultdict(int)
    seconds: dict[str, float] = defaultdict(float)
    for nodeid, spent in _seconds.items():
        for key in key_of.get(nodeid, ()):
            tests[key] += 1
            seconds[key] += spent
    return sorted(((k, tests[k], seconds[k]) for k in tests), key=lambda r: -r[2])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _seconds:
        return
    total = sum(_seconds.values())
    modules = {nodeid: (nodeid.split("::", 1)[0],) for nodeid in _seconds}
    write = terminalreporter.write_line
    for title, key_of in (("module", modules), ("marker", _markers_of)):
        terminalreporter.section(f"time per {title}", sep="-")
        write(f"{'seconds':>9} {'share':>6} {'tests':>6}  {title}")
        for key, count, spent in rows(key_of):
            write(f"{spent:9.1f} {spent / total:6.1%} {count:6d}  {key}")
    write(f"{total:9.1f} {1:6.0%} {len(_seconds):6d}  all tests (setup, call, teardown)")
