"""Cluster mode against what a fleet sends it: writes larger than the log takes, read
positions that are not plain numbers, ids that are special in URLs, owners that answer
garbage. Each is refused as the caller's error, naming what to fix; nothing is half written
and nobody else's writes stop."""

from __future__ import annotations

import functools
from pathlib import Path
from urllib.parse import unquote

import httpx
import msgspec
import pytest
import trio

from actors.base.config import Config
from engine import EngineError, InvalidInput
from engine.cluster import _client
from engine.cluster._client import ClusterClient
from engine.cluster._leases import LeaseValue
from engine.cluster._partition import partition_of
from engine.cluster._router import LAST_SEQ_SECONDS, Router

from .conftest import one_node, wait_for

pytestmark = pytest.mark.timeout(120)

BIG = {"long_term": False, "max_text_chars": 400_000, "max_meta_bytes": 2 << 20}
WIDE = "\U0001F600" * 300_000  # within BIG's max_text_chars, 1.2 MB as UTF-8: over max_payload


async def test_a_turn_larger_than_the_log_takes_is_refused_up_front_naming_its_field(
        nats_servers, cluster_config, tmp_path: Path) -> None:
    """A turn within the engine's limits but over the log's max_payload is InvalidInput naming
    text or meta, from a node and from a thin client, durable or not (never a NATS error or
    a receipt that waits forever), and the partition goes on applying others' turns."""
    with trio.fail_after(60):
        async with one_node(nats_servers, cluster_config, tmp_path / "s", config=BIG) as (
                engine, node, writer, log):
            client = ClusterClient(log, Config.checked(BIG), httpx.AsyncClient())
            before = await log.last_seq()
            for who in (writer, client):
                for durable in (True, False):
                    with pytest.raises(InvalidInput, match="max_payload") as text:
                        await who.add_turn("ana", "s1", "user", WIDE, durable=durable)
                    assert text.value.field == "text"
                    with pytest.raises(InvalidInput, match="max_payload") as meta:
                        await who.add_turn("ana", "s1", "user", "hi", durable=durable,
                                           meta={"blob": "x" * (1100 << 10)})
                    assert meta.value.field == "meta"
            assert await log.last_seq() == before  # nothing reached the log
            receipt = await writer.add_turn("bo", "s1", "user", "still here", durable=True)
            p = partition_of("bo", cluster_config.partitions)
            await wait_for(lambda: node.marks.get(p, 0) >= receipt.log_seq, 20, "bo applied")
            assert [t.text for t in await engine.session_history("bo", "s1")] == ["still here"]
            await client._http.aclose()


async def test_a_batch_with_one_turn_too_large_for_the_log_publishes_none(
        nats_servers, cluster_config, tmp_path: Path) -> None:
    """add_turns checks every turn's size before publishing any: no half-applied batch."""
    with trio.fail_after(60):
        async with one_node(nats_servers, cluster_config, tmp_path / "s", config=BIG) as (
                engine, node, writer, log):
            before = await log.last_seq()
            items = [{"user_id": "ana", "session_id": "s1", "role": "user", "text": text}
                     for text in ("first", WIDE, "third")]
            with pytest.raises(InvalidInput, match="max_payload") as refused:
                await writer.add_turns(items, durable=True)
            assert refused.value.field == "items[1].text"
            assert await log.last_seq() == before


async def test_a_logged_call_too_large_for_the_log_is_refused_naming_its_argument(
        nats_servers, cluster_config, tmp_path: Path) -> None:
    """A note over max_payload is InvalidInput naming its text, not a NATS error (500)."""
    with trio.fail_after(60):
        async with one_node(nats_servers, cluster_config, tmp_path / "s", config=BIG) as (
                engine, node, writer, log):
            before = await log.last_seq()
            with pytest.raises(InvalidInput, match="max_payload") as refused:
                await writer.store_note("ana", WIDE)
            assert refused.value.field == "text"
            assert await log.last_seq() == before
            note = await writer.store_note("ana", "small")
            assert note is not None


async def test_the_log_refuses_an_oversized_entry_without_stranding_the_others(
        nats_servers, cluster_config) -> None:
    """Below the writers' own check: an entry over max_payload handed to the log directly
    fails as InvalidInput, awaited or buffered, and the buffered entries behind it still go
    out (a raise in the sending task used to leave them, and its own receipt, unsettled)."""
    from engine.cluster._log import Log

    with trio.fail_after(30):
        log = await Log.connect(nats_servers.urls, cluster_config, name="t")
        try:
            too_big = b"x" * (log.max_payload + 2048)
            with pytest.raises(InvalidInput, match="max_payload"):
                await log.publish("turns.0.aa", too_big, "m-0")
            pendings = [log.publish_soon("turns.0.aa", data, f"m-{i}")
                        for i, data in enumerate((b"one", too_big, b"three"), 1)]
            first, third = await pendings[0].wait(), await pendings[2].wait()
            assert third[0] == first[0] + 1
            with pytest.raises(InvalidInput, match="max_payload"):
                await pendings[1].wait()
        finally:
            await log.close()


class OwningNode:
    """What the router asks of a node that owns every partition, applied up to 5."""

    def __init__(self, config) -> None:
        self.config, self.node_id, self.marks = config, "a", {}

    def owns(self, p: int) -> bool:
        return True

    async def wait_applied(self, p: int, min_seq: int, timeout: float) -> bool:
        return self.marks.get(p, 0) >= min_seq


@pytest.mark.parametrize("min_seq", ["%C2%B2", "%D9%A3", "9" * 5000, "+5", "5%20", "-1", "",
                                     "5&min_seq=9"],
                         ids=["superscript", "arabic-indic", "5000-digits", "plus", "space",
                              "negative", "blank", "twice"])
async def test_a_min_seq_that_is_not_a_plain_number_is_a_422_never_a_500(
        cluster_config, min_seq: str) -> None:
    """Unicode digits ('²', Arabic-Indic), 5000 digits (past int()'s limit), signs and
    spaces, a blank (a caller's None formatted as '') or two values: each a 422 naming
    min_seq, and the read never reaches the engine (unchecked, without the wait it asked
    for)."""
    served = []

    async def app(scope: dict, receive, send) -> None:
        served.append(scope)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    router = Router(app, OwningNode(cluster_config))
    status, body = await _read_at(router, min_seq)
    await router.client.aclose()
    assert status == 422
    assert body["field"] == "min_seq"
    assert served == []


class LogAt:
    """What the router asks of the log: its last sequence, here ``last``."""

    def __init__(self, last: int) -> None:
        self.last = last

    async def last_seq(self) -> int:
        return self.last


async def _read_at(router: Router, min_seq: int) -> tuple[int, dict]:
    """The router's status and JSON body for a session read with ``?min_seq=``."""
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    path = "/v1/users/ana/sessions/s1/turns"
    await router({"type": "http", "method": "GET", "path": path, "raw_path": path.encode(),
                  "query_string": f"min_seq={min_seq}".encode(),
                  "headers": [(b"host", b"127.0.0.1")]}, receive, send)
    return sent[0]["status"], msgspec.json.decode(sent[1]["body"])


async def test_a_min_seq_past_the_end_of_the_log_is_a_422_not_a_503_for_ever(
        cluster_config) -> None:
    """A min_seq no write ever got (past the log's last sequence) cannot be caught up with:
    a 422 naming min_seq with the log's last sequence, not a 503 inviting retries for ever;
    one within the log (7) that is not applied yet (5) is still the 503."""
    async def app(scope: dict, receive, send) -> None:
        raise AssertionError("a read before its min_seq reached the engine")

    node = OwningNode(cluster_config)
    node.marks = {p: 5 for p in range(cluster_config.partitions)}
    router = Router(app, node, LogAt(7))
    status, body = await _read_at(router, 8)
    assert (status, body["error"], body["field"]) == (422, "InvalidInput", "min_seq"), body
    assert "at most 7" in body["message"] and "found 8" in body["message"]
    status, body = await _read_at(router, 7)
    assert (status, body["error"]) == (503, "NotCaughtUp")
    await router.client.aclose()


class SilentLog:
    """A log that never says its last sequence (a leader election, a partition)."""

    async def last_seq(self) -> int:
        await trio.sleep_forever()
        raise AssertionError("unreachable")


async def test_a_log_that_does_not_say_its_last_sequence_delays_the_503_by_little(
        cluster_config, autojump_clock) -> None:
    """A read not caught up after read_wait asks the log whether its min_seq exists; a log
    that does not answer added a second read_wait to the 503 (400 ms in all by default),
    on every such read. The question has LAST_SEQ_SECONDS."""
    async def app(scope: dict, receive, send) -> None:
        raise AssertionError("a read before its min_seq reached the engine")

    class WaitingNode(OwningNode):  # waits its timeout for a min_seq it has not applied
        async def wait_applied(self, p: int, min_seq: int, timeout: float) -> bool:
            if self.marks.get(p, 0) < min_seq:
                await trio.sleep(timeout)
            return self.marks.get(p, 0) >= min_seq

    node = WaitingNode(cluster_config)
    node.marks = {p: 5 for p in range(cluster_config.partitions)}
    router = Router(app, node, SilentLog())
    start = trio.current_time()
    status, body = await _read_at(router, 7)
    took = trio.current_time() - start
    await router.client.aclose()
    assert (status, body["error"]) == (503, "NotCaughtUp")
    assert took <= cluster_config.read_wait + LAST_SEQ_SECONDS + 0.01, took


async def test_a_min_seq_past_the_real_logs_end_is_a_422_naming_its_last_sequence(
        nats_servers, cluster_config, tmp_path: Path) -> None:
    """Against a real log: a write's own log_seq is served, one past the log's end is a 422
    naming min_seq and the log's last sequence (the owner reads it from the stream)."""
    from engine._server import create_app

    with trio.fail_after(60):
        async with one_node(nats_servers, cluster_config, tmp_path / "s",
                            config={"long_term": False}) as (engine, node, writer, log):
            receipt = await writer.add_turn("ana", "s1", "user", "hi", durable=True)
            router = Router(create_app(writer), node, log)
            status, turns = await _read_at(router, receipt.log_seq)
            assert status == 200 and [t["text"] for t in turns] == ["hi"]
            status, body = await _read_at(router, receipt.log_seq + 1000)
            await router.client.aclose()
    assert (status, body["field"]) == (422, "min_seq"), body
    assert f"at most {receipt.log_seq}" in body["message"]


class OneOwner:
    """The client's lease lookups: every partition held by one node at ``http://owner``."""

    def __init__(self) -> None:
        self.members: dict[str, str] = {}

    async def lookup(self, partition: int):
        return LeaseValue("n1", "i1"), "http://owner"


def fake_client(handler) -> ClusterClient:
    """A ClusterClient whose owner is ``handler`` (an httpx MockTransport); no log needed for
    reads."""

    client = ClusterClient.__new__(ClusterClient)
    client._log, client._config, client._partitions = None, Config(), 64
    client._http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    client._leases = OneOwner()
    return client


@pytest.mark.parametrize("status,body", [
    (200, b"<html>not json</html>"),
    (200, b"[1, 2]"),
    (200, b'{"no_hits": []}'),
    (500, b"[1, 2]"),
    (500, b'"a string"'),
    (422, b'{"error": "InvalidInput", "message": 7}'),
])
async def test_an_owner_answering_garbage_is_an_engine_error(status: int, body: bytes) -> None:
    """Whatever a node (or something at its address) answers, a read raises EngineError
    saying so, never a KeyError, AttributeError or JSONDecodeError out of the client."""
    client = fake_client(lambda request: httpx.Response(status, content=body))
    with trio.fail_after(10):
        with pytest.raises(EngineError):
            await client.recall("ana", "where")
    await client._http.aclose()


async def test_an_owner_that_hangs_ends_the_read_in_bounded_time(monkeypatch) -> None:
    """An owner that never answers is tried again until READ_SECONDS, then LogUnavailable."""
    monkeypatch.setattr(_client, "READ_SECONDS", 0.5)

    def hang(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("no answer", request=request)

    client = fake_client(hang)
    with trio.fail_after(10):
        with pytest.raises(_client.LogUnavailable, match="did not answer"):
            await client.recall("ana", "where")
    await client._http.aclose()


async def test_an_owner_that_never_answers_costs_no_more_than_the_read_budget(autojump_clock
                                                                              ) -> None:
    """An owner that accepts the request and never answers (the client's own timeout is
    30 s): the read ends with LogUnavailable by READ_SECONDS, not after the attempt's 30 s."""
    async def hang(request: httpx.Request) -> httpx.Response:
        await trio.sleep_forever()
        raise AssertionError

    client = fake_client(hang)
    start = trio.current_time()
    with trio.fail_after(120):
        with pytest.raises(_client.LogUnavailable, match="did not answer"):
            await client.recall("ana", "where")
    assert trio.current_time() - start <= _client.READ_SECONDS
    await client._http.aclose()


@pytest.mark.parametrize("user,session", [("..", "s1"), (".", "s1"), ("ana", ".."),
                                          ("a/b?c#d %", "."), ("é.*>", "x.y")])
async def test_ids_that_are_path_dots_reach_the_owner_as_themselves(user: str,
                                                                     session: str) -> None:
    """'.' and '..' are valid ids: the client escapes them so the URL is not collapsed
    (httpx resolves dot segments) into another route or another user's."""
    seen: list[str] = []

    def owner(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.raw_path.decode())
        return httpx.Response(200, json=[])

    client = fake_client(owner)
    await client.session_history(user, session)
    await client._http.aclose()
    [raw] = seen
    parts = raw.split("?", 1)[0].split("/")
    assert parts[:3] == ["", "v1", "users"] and parts[4] == "sessions" and parts[6] == "turns"
    assert (unquote(parts[3]), unquote(parts[5])) == (user, session)


@pytest.mark.parametrize("min_seq", [-1, 2**64, 10**5000, True, 1.0, "5"],
                         ids=["negative", "2**64", "10**5000", "bool", "float", "str"])
async def test_the_client_refuses_a_min_seq_outside_the_logs_range(min_seq) -> None:
    """A min_seq the log can never reach or that is not an int is InvalidInput, asked of no
    owner."""
    asked = []
    client = fake_client(lambda request: asked.append(request) or httpx.Response(200, json={}))
    with pytest.raises(InvalidInput, match="min_seq"):
        await client.recall("ana", "where", min_seq=min_seq)
    await client._http.aclose()
    assert asked == []


async def test_a_log_address_where_no_server_answers_is_log_unavailable_not_a_hang(
        monkeypatch) -> None:
    """``cluster status`` / ``init``, a node and a thin client given a port where no log
    server listens fail with LogUnavailable naming the address, in bounded time (nats-py,
    told to reconnect for ever, retried its first connect for ever)."""
    from engine.cluster import _log
    from engine.cluster._local import free_port
    from engine.cluster._log import Log, LogUnavailable

    monkeypatch.setattr(_log, "CONNECT_SECONDS", 1.0)
    url = f"nats://127.0.0.1:{free_port()}"
    with trio.fail_after(20):
        with pytest.raises(LogUnavailable, match=f"{url}.*no server answered within 1"):
            await Log.connect([url], name="nobody")
        with pytest.raises(LogUnavailable, match=url):
            async with ClusterClient.connect([url]):
                pass


def test_a_fetch_batch_larger_than_one_apply_takes_is_refused() -> None:
    """A ``fetch_batch`` over what ``apply_log_batch`` takes at once is refused at config,
    naming the field: the node would otherwise crash applying the first full fetch, and
    again after every restart, while its partitions' backlog stayed that long."""
    from engine._logbatch import MAX_BATCH
    from engine.cluster._log import ClusterConfig

    assert ClusterConfig.checked({"fetch_batch": MAX_BATCH}).fetch_batch == MAX_BATCH
    with pytest.raises(InvalidInput, match=f"expected at most {MAX_BATCH}.*found 5000") as bad:
        ClusterConfig.checked({"fetch_batch": 5000})
    assert bad.value.field == "cluster_config.fetch_batch"


@pytest.mark.parametrize("retry_after", ["Wed, 21 Oct 2015 07:28:00 GMT", "soon", "inf", "nan",
                                         "-3", "1e400", ""])
async def test_a_503_with_an_odd_retry_after_is_retried_not_raised(retry_after: str,
                                                                  autojump_clock) -> None:
    """A Retry-After a node never sends (an HTTP date from a proxy in front of it, words,
    inf) is a short pause and another try, never a ValueError out of the read or a
    LogUnavailable before the owner was asked again."""
    answers = [httpx.Response(503, headers={"retry-after": retry_after},
                              json={"error": "NotCaughtUp", "message": "retry"}),
               httpx.Response(200, json={"hits": [{"id": "t1"}]})]
    client = fake_client(lambda request: answers.pop(0))
    with trio.fail_after(_client.READ_SECONDS):
        assert await client.recall("ana", "where") == [{"id": "t1"}]
    await client._http.aclose()


@pytest.mark.parametrize("url", ["nats://127.0.0.1:99999", "nats://127.0.0.1:abc", "nats://[::1",
                                 "nats://", "nats://:4222", "nats://127.0.0.1:0",
                                 "http://127.0.0.1:4222", "127.0.0.1:4222"])
async def test_a_log_url_that_is_not_host_and_port_is_invalid_input_naming_nats(url: str
                                                                               ) -> None:
    """A malformed log address (``--nats`` of a node, ``cluster init|status``, a thin
    client) is the caller's error, InvalidInput on ``nats`` saying what was expected and
    what it found, not LogUnavailable as if the servers were down."""
    from engine.cluster._log import Log

    with trio.fail_after(10):
        with pytest.raises(InvalidInput, match="expected nats://HOST:PORT") as bad:
            await Log.connect(["nats://127.0.0.1:4222", url], name="bad-url")
    assert bad.value.field == "nats" and url in str(bad.value)


@pytest.mark.parametrize("answer", [b"[]", b'{"watermarks": []}', b'{"watermarks": {"1": "x"}}',
                                    b"\xff\xfe"])
async def test_cluster_status_survives_whatever_answers_at_a_nodes_address(
        nats_servers, cluster_config, answer: bytes) -> None:
    """``cluster status`` asks every heartbeat's address for its watermarks: a node restarted
    on another port leaves its old address to whatever listens there next, and an operator
    may have put a key of their own in the bucket. Such a node shows no watermarks and such
    a key is passed over; status still answers for every partition."""
    from engine.cluster._cli import status
    from engine.cluster._leases import Leases
    from engine.cluster._local import free_port
    from engine.cluster._log import Log

    async def other_program(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                              b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                              % (len(answer), answer))
        await stream.aclose()

    port = free_port()
    log = await Log.connect(nats_servers.urls, cluster_config, name="status-test")
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(trio.serve_tcp, other_program, port,
                                                  host="127.0.0.1"))
            with trio.fail_after(30):
                leases = Leases(log, "n1", "n1-1", f"http://127.0.0.1:{port}", _nothing_yet,
                                _nothing_yet)
                await leases.tick()
                await log.kv("put", "partition.x", b"not a lease")
                await log.kv("put", "node.zz", b"\x00 not a beat")
                await log.kv("put", "partition.3", b'{"node": 5}')
                await log.kv("put", "node.odd", b'{"node": "odd", "incarnation": "1", '
                                                b'"http": "http://["}')
                report = await status(nats_servers.urls, cluster_config)
            nursery.cancel_scope.cancel()
    finally:
        await log.close()
    assert report["nodes"] == {"n1": f"http://127.0.0.1:{port}", "odd": "http://["}
    assert [p["partition"] for p in report["partitions"]] == list(range(8))
    assert {p["owner"] for p in report["partitions"]} == {"n1", None}
    assert all(p["watermark"] is None for p in report["partitions"])


async def _nothing_yet(partition: int) -> None:
    return None


def test_a_partition_count_no_node_could_tick_through_is_refused() -> None:
    """``--cluster-config '{"partitions": 100000000}'`` (a typo's zeros) is refused naming
    the field: the stream would record it for the cluster's life, and every node's lease
    tick plans over every partition (a list of them all), so the first node never started."""
    from engine.cluster._log import MAX_PARTITIONS, ClusterConfig

    assert ClusterConfig.checked({"partitions": MAX_PARTITIONS}).partitions == MAX_PARTITIONS
    with pytest.raises(InvalidInput, match=f"expected at most {MAX_PARTITIONS}.*found "
                                           "100000000") as bad:
        ClusterConfig.checked({"partitions": 100_000_000})
    assert bad.value.field == "cluster_config.partitions"


@pytest.mark.parametrize("overrides,field,expected", [
    ({"duplicate_window": 120.0, "max_age": 100.0, "snapshot_interval": 10.0},
     "duplicate_window", "expected at most max_age"),
    ({"lease_ttl": float("inf")}, "lease_ttl", "expected finite seconds"),
    ({"max_age": float("inf")}, "max_age", "expected finite seconds"),
    ({"grace": float("inf")}, "grace", "expected finite seconds"),
])
def test_settings_the_log_servers_refuse_are_invalid_input_up_front(overrides: dict,
                                                                     field: str,
                                                                     expected: str) -> None:
    """A duplicate window longer than max_age (the servers refuse the stream: 30 s of
    retries, then LogUnavailable saying the log could not be reached) and seconds of
    Infinity (json.loads takes it from --cluster-config; an OverflowError out of nats-py)
    are InvalidInput naming the field before anything is asked of the log."""
    from engine.cluster._log import ClusterConfig

    with pytest.raises(InvalidInput, match=expected) as bad:
        ClusterConfig.checked(overrides)
    assert bad.value.field == f"cluster_config.{field}"


async def test_status_and_a_thin_client_never_make_the_stream_they_do_not_find(
        nats_servers, cluster_config) -> None:
    """``cluster status`` (a look) and a bot's ClusterClient started before any node, or
    with a misspelt stream name or another partition count, must not create the stream and
    buckets: that made an empty cluster under the wrong name, or stamped the real one with
    the bot's partition count so every node was refused at connect. They say to run
    ``cluster init`` (or start a node) instead."""
    import nats.js.errors

    from engine.cluster._cli import status
    from engine.cluster._log import Log, LogUnavailable

    fresh = msgspec.structs.replace(cluster_config, stream=f"{cluster_config.stream}X",
                                    bucket=f"{cluster_config.bucket}x",
                                    objects=f"{cluster_config.objects}x", partitions=64)
    log = await Log.connect(nats_servers.urls, cluster_config, name="looker")
    try:
        with trio.fail_after(30):
            with pytest.raises(LogUnavailable, match="cluster init"):
                await status(nats_servers.urls, fresh)
            with pytest.raises(LogUnavailable, match="cluster init"):
                async with ClusterClient.connect(nats_servers.urls, fresh):
                    pass
            for name in (fresh.stream, f"KV_{fresh.bucket}", f"OBJ_{fresh.objects}"):
                with pytest.raises(nats.js.errors.NotFoundError):
                    await log.thread.run(log._client.js.stream_info, name)
    finally:
        for name in (fresh.stream, f"KV_{fresh.bucket}", f"OBJ_{fresh.objects}"):
            try:  # what a failing run made
                await log.thread.run(log._client.js.delete_stream, name)
            except nats.js.errors.NotFoundError:
                pass
        await log.close()
