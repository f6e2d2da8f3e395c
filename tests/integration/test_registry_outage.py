"""The PostgreSQL registry through an outage of its own server (started and stopped here, not
the session's): while the server is down a call fails with the driver's reason, without
waiting on the pool again; after a restart the first call goes through, on a new connection,
without waiting for the pool's reconnect backoff (1, 2, 4 ... s) or failing on a connection the
restart cut. The rollout controller ticks every second against this: each tick of an outage
waited out the pool's timeout (10 s) and held its lock, and after the outage the rollout
resumed only when the pool's backoff let it (about 10 s later in the e2e scenario)."""

from __future__ import annotations

import pytest

from app.errors import RegistryUnavailable
from app.polling import wait_until
from app.registry.postgres import PostgresRegistry
from tests.postgres import running_server

MODEL, ENV = "ranker", "default"
POOL_TIMEOUT = "no registry database connection available"


def test_a_stopped_server_is_named_at_once_and_a_restarted_one_serves_the_next_call() -> None:
    with running_server() as server:
        url = server.create_database("outage")
        # A short pool timeout: a call that has to wait for the pool's own reconnect fails
        # within it (PoolTimeout), where the default would only make it slow.
        with PostgresRegistry(url, connect_timeout_s=1) as registry:
            assert registry.list_targets(MODEL, ENV) == []
            server.stop()

            with pytest.raises(RegistryUnavailable):
                registry.list_targets(MODEL, ENV)  # finds the pooled connection cut
            for _ in range(3):
                with pytest.raises(RegistryUnavailable) as refused:
                    registry.list_targets(MODEL, ENV)
                said = str(refused.value)
                assert POOL_TIMEOUT not in said and "refused" in said.lower(), said

            server.start()
            # Each call after the restart goes through, on a connection of its own until the
            # pool has one to lend again; from then on, on the pool's.
            for _ in range(5):
                assert registry.list_targets(MODEL, ENV) == []
            wait_until(
                lambda: registry._pool.get_stats().get("pool_available"), 60, "pool reconnected"
            )
            assert registry.list_targets(MODEL, ENV) == []
            assert not registry._unreachable
