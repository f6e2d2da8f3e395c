"""How Serve control tells "out of reach, try again" from "refused": the controller holds a
rollout (deadlines paused) only for the first. Real HTTP on loopback, no Ray."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rollout.local.cluster import free_port
from rollout.serve_control import ServeControl, ServeControlError, ServeUnreachable
from tests.dashboard_stub import answering_dashboard
from tests.unit.fakes import FakeDashboard


@pytest.fixture
def dashboard() -> Iterator[tuple[str, list[int]]]:
    with answering_dashboard() as stub:
        yield stub


def test_nothing_listening_is_unreachable() -> None:
    control = ServeControl(f"http://127.0.0.1:{free_port()}", token="t", timeout_s=2)
    try:
        with pytest.raises(ServeUnreachable, match="unreachable") as info:
            control.details()
        assert info.value.category == "serve.unavailable"
        with pytest.raises(ServeUnreachable):
            control.apply({"applications": []})
    finally:
        control.close()


@pytest.mark.parametrize("status", [500, 502, 503, 504])
def test_a_server_error_is_unreachable(dashboard, status: int) -> None:
    url, statuses = dashboard
    statuses.append(status)
    control = ServeControl(url, token="t")
    try:
        with pytest.raises(ServeUnreachable, match=f"could not read the Serve config \\({status}"):
            control.details()
    finally:
        control.close()


@pytest.mark.parametrize("status", [400, 401, 422])
def test_a_refusal_is_not_an_outage(dashboard, status: int) -> None:
    url, statuses = dashboard
    statuses.append(status)
    control = ServeControl(url, token="t")
    try:
        with pytest.raises(ServeControlError) as info:
            control.apply({"applications": []})
        assert not isinstance(info.value, ServeUnreachable)
        assert info.value.category == "serve.control"
        assert f"({status})" in str(info.value)
    finally:
        control.close()


def test_wait_applied_returns_the_status_or_names_what_is_pending() -> None:
    dashboard = FakeDashboard()
    control = ServeControl("http://dashboard", token="t", transport=dashboard.transport)
    status = control.wait_applied("ranker", "canary", num_replicas=1, timeout_s=1, poll_s=0.01)
    assert status["target_num_replicas"] == 1
    with pytest.raises(ServeControlError, match=r"not applied within 0s: .*pending=\['replicas'\]"):
        control.wait_applied("ranker", "canary", num_replicas=2, timeout_s=0.05, poll_s=0.01)
    with pytest.raises(ServeControlError, match="no deployment 'nope'"):
        control.wait_applied("ranker", "nope", timeout_s=0.05, poll_s=0.01)
