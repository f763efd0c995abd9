"""A node killed by SIGKILL the moment a logged call's write has committed neither loses nor
repeats it. The fault series under steady writes (kill -9 of the stream's leader server, of an
owner node, and a restart within the lease TTL) is tests/test_cluster_faults.py, the bench's
own run in the issue's shape.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from .conftest import NodeProcess, all_held, retrying, wait_for

pytestmark = pytest.mark.timeout(300)


async def test_a_kill_9_right_after_a_call_is_applied_neither_loses_nor_repeats_it(
        nodes: list[NodeProcess], cluster_config: Any) -> None:
    """The node dies by SIGKILL the moment a logged call's write has committed; restarted, it
    replays from its watermark, which moved in that same transaction: the call is there, once
    (a second apply of remember_fact would reinforce the fact: access_count 1)."""
    node = nodes[0]
    await node.restart(["tests.cluster.node_child", "remember_fact"])
    await wait_for(lambda: all_held([node], cluster_config.partitions), 60,
                   "every partition held")
    async with httpx.AsyncClient(timeout=30) as client:
        turn = await client.post(f"{node.url}/v1/users/ana/sessions/s/turns",
                                 json={"role": "user", "text": "I have a cat", "durable": True})
        assert turn.status_code == 201, turn.text
        with pytest.raises(httpx.HTTPError):  # the node died answering it
            await client.post(f"{node.url}/v1/users/ana/facts",
                              json={"category": "pets", "key": "cat", "value": "Miso"})
        assert await trio.to_thread.run_sync(node.proc.wait, 30) == -9
        await node.restart()
        await wait_for(lambda: all_held([node], cluster_config.partitions), 60,
                       "every partition held again")
        answer = await retrying(client, "GET", f"{node.url}/v1/users/ana/facts/pets/cat/"
                                "history", params={"min_seq": turn.json()["log_seq"] + 1})
        assert answer.status_code == 200, answer.text
        history = answer.json()
        assert [(f["value"], f["status"], f["access_count"]) for f in history] == [
            ("Miso", "active", 0)], history
        assert (await node.read_figures())["watermarks"]
