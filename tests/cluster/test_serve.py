"""``engram-trio node``'s own flags: the address it serves on and the one it advertises."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from engine import InvalidInput
from engine.cluster import _log
from engine.cluster._local import free_port
from engine.cluster._log import LogUnavailable
from engine.cluster._serve import serve_node

from .conftest import make_store

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.write_text("k1 *\n")
    return path


@pytest.mark.parametrize("http", ["0.0.0.0:8081", "[::]:8081", ":::8081", "127.0.0.1:0",
                                  "127.0.0.1:\u00b2", "127.0.0.1:99999", "[::1:8081"])
async def test_an_address_other_nodes_cannot_use_is_invalid_input_naming_http(
        http: str, keys: Path, tmp_path: Path) -> None:
    """A node publishes its address in its heartbeat for the others to forward to: a
    wildcard (0.0.0.0 or ::, which another machine reaches as itself), port 0 or a port
    that is not one is refused before anything is opened, unless ``advertise`` says where
    the node is reached."""
    with trio.fail_after(10):
        with pytest.raises(InvalidInput) as bad:
            await serve_node(tmp_path / "store", ["nats://127.0.0.1:1"], http, "n1",
                             api_keys=keys, handle_signals=False)
    assert bad.value.field == "http" and http in str(bad.value)
    assert not (tmp_path / "store").exists()


async def test_a_wildcard_bind_with_an_advertised_address_goes_on(
        keys: Path, tmp_path: Path, monkeypatch) -> None:
    """``advertise`` is what lets a node bind every interface (a container's)."""
    monkeypatch.setattr(_log, "CONNECT_SECONDS", 0.5)
    store = await trio.to_thread.run_sync(make_store, tmp_path / "store")
    with trio.fail_after(30):
        with pytest.raises(LogUnavailable):  # it got as far as the log
            await serve_node(store, ["nats://127.0.0.1:1"],
                             "0.0.0.0:8081", "n1", api_keys=keys, handle_signals=False,
                             advertise="http://10.0.0.5:8081")
        with pytest.raises(InvalidInput) as bad:
            await serve_node(tmp_path / "store", ["nats://127.0.0.1:1"], "0.0.0.0:8081",
                             "n1", api_keys=keys, handle_signals=False,
                             advertise="10.0.0.5:8081")
    assert bad.value.field == "advertise"


async def test_a_node_on_an_ipv6_address_advertises_a_url_the_others_can_use(
        nats_servers, cluster_config, tmp_path: Path) -> None:
    """``--http ::1:PORT`` binds IPv6; the heartbeat must carry ``http://[::1]:PORT``, not
    ``http://::1:PORT``, which no other node can send a request to."""
    port = free_port()
    store = await trio.to_thread.run_sync(make_store, tmp_path / "store")
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            node = await nursery.start(lambda task_status: serve_node(
                store, nats_servers.urls, f"::1:{port}", "n6",
                cluster_config=cluster_config, config={"long_term": False},
                handle_signals=False, say=lambda line: None, task_status=task_status))
            assert node.leases.http == f"http://[::1]:{port}"
            async with httpx.AsyncClient() as client:
                answer = await client.get(node.leases.http + "/cluster/node")
            assert answer.status_code == 200 and answer.json()["node"] == "n6"
            nursery.cancel_scope.cancel()
