"""A partition's consumer hands over what the log delivers at once, whatever pull request it
came under."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from engine.cluster._partition import partition_of, subject_of

from .conftest import connect

pytestmark = pytest.mark.timeout(120)

FETCH_SECONDS = 60.0  # the fetch's timeout: far longer than the entry takes to arrive
PATIENCE = 30.0  # the test's own bound on the fetch


async def test_an_entry_delivered_under_an_older_pull_request_is_handed_over_at_once(
        nats_servers, cluster_config) -> None:
    """Under load, a fetch that timed out can leave its pull request open on the server, and
    the next entry then comes under that request instead of the waiting fetch's own. The
    fetch must hand it over at once, not once its batch fills or its timeout passes (that
    wait was the 868 ms read-your-writes tail)."""
    log = await connect(nats_servers, cluster_config)
    try:
        user = next(f"u{i}" for i in range(1000)
                    if partition_of(f"u{i}", cluster_config.partitions) == 0)
        sub = await log.subscribe(0, 1, "older-pull-test")
        client = log._client

        async def scenario() -> list | None:
            # The pull request a timed-out fetch left behind on the server.
            await client.nc.publish(sub.next_subject, msgspec.json.encode(
                {"batch": 256, "expires": int(FETCH_SECONDS * 1e9)}), reply=sub.inbox)
            await client.nc.flush()
            fetching = asyncio.ensure_future(client.fetch(sub, 256, FETCH_SECONDS))
            for _ in range(50):  # the fetch runs up to its wait (no I/O needed for that)
                await asyncio.sleep(0)
            await client.js.publish(subject_of(user, cluster_config.partitions), b"entry")
            done, _ = await asyncio.wait({fetching}, timeout=PATIENCE)
            if not done:
                fetching.cancel()
                return None
            return fetching.result()

        got = await log.thread.run(scenario)
        assert got is not None, f"the fetch held the entry back for over {PATIENCE} s"
        assert [d.data for d in got] == [b"entry"]
        await log.drop(sub)
    finally:
        await log.close()
