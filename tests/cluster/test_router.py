"""The router in front of a node whose view of the leases is behind a move: it reads the
lease from the real bucket instead of answering 503 NoOwner for up to a lease tick."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import msgspec
import pytest
import trio

from engine.cluster._leases import LEASE_PREFIX, NODE_PREFIX, Beat, Leases, LeaseValue
from engine.cluster._partition import partition_of
from engine.cluster._router import Router

from .conftest import connect

pytestmark = pytest.mark.timeout(120)

USER = "ana"
PATH = f"/v1/users/{USER}/sessions/s1/turns"


class Owners:
    """The other nodes' HTTP APIs, by host: ``c.test`` holds the partition and answers; the
    others handed it on, and answer a forwarded request as a node then does."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def __call__(self, scope: dict, receive, send) -> None:
        host = dict(scope["headers"])[b"host"].decode()
        self.seen.append(host)
        if host == "c.test":
            status, body = 200, {"served_by": "c"}
        else:
            status, body = 503, {"error": "NoOwner",
                                 "message": f"{host} does not hold it now; retry"}
        payload = msgspec.json.encode(body)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


class Node:
    """What the router asks of a node, over real leases: this node owns nothing."""

    def __init__(self, leases: Leases, config) -> None:
        self.leases, self.config, self.node_id = leases, config, leases.node

    def owns(self, p: int) -> bool:
        return False


async def request(router: Router, method: str, path: str,
                  receive: Callable) -> tuple[int, dict]:
    """A request through the router, as hypercorn would pass it: the status and JSON body."""
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(),
             "query_string": b"", "headers": [(b"host", b"a.test")]}
    await router(scope, receive, send)
    return sent[0]["status"], msgspec.json.decode(sent[1]["body"])


async def get(router: Router) -> tuple[int, dict]:
    """A GET of the user's session through the router."""
    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    return await request(router, "GET", PATH, receive)


async def put(log, key: str, value) -> None:
    await log.kv("put", key, msgspec.json.encode(value))


@pytest.fixture
async def routed(nats_servers, cluster_config):
    """A router over node a's leases (never ticked: its view is empty), with c's heartbeat
    in the bucket, and where the others' answers went."""
    log = await connect(nats_servers, cluster_config)

    async def nothing(p: int) -> None:
        pass

    leases = Leases(log, "a", "a-1", "http://a.test", nothing, nothing)
    router = Router(None, Node(leases, cluster_config))
    owners = Owners()
    router.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=owners))
    await put(log, NODE_PREFIX + "c", Beat("c", "c-1", "http://c.test"))
    try:
        yield router, log, owners, partition_of(USER, cluster_config.partitions)
    finally:
        await router.client.aclose()
        await log.close()


async def test_a_lease_the_view_has_not_seen_is_read_from_the_bucket(routed) -> None:
    """The view has no owner for the user's partition (it moved since the last tick): the
    router reads the lease and forwards to its holder instead of answering NoOwner."""
    router, log, owners, p = routed
    await put(log, LEASE_PREFIX + str(p), LeaseValue("c", "c-1"))
    assert router.node.leases.owner(p) is None
    assert await get(router) == (200, {"served_by": "c"})
    assert owners.seen == ["c.test"] and router.counts["looked_up"] == 1
    assert router.node.leases.owner(p) == LeaseValue("c", "c-1")  # kept in the view


async def test_a_holder_that_handed_the_partition_on_is_passed_over(routed) -> None:
    """The view still names b, which handed the partition to c: b's NoOwner makes the router
    read the lease and send the request on to c, once."""
    router, log, owners, p = routed
    leases = router.node.leases
    await put(log, NODE_PREFIX + "b", Beat("b", "b-1", "http://b.test"))
    leases.owners[p] = LeaseValue("b", "b-1")
    leases.members["b"] = Beat("b", "b-1", "http://b.test")
    await put(log, LEASE_PREFIX + str(p), LeaseValue("c", "c-1"))
    assert await get(router) == (200, {"served_by": "c"})
    assert owners.seen == ["b.test", "c.test"] and router.counts["reforwarded"] == 1


async def test_no_lease_in_the_bucket_either_is_still_no_owner(routed) -> None:
    """Nobody holds the partition, in the view or in the bucket: 503 NoOwner, saying so."""
    router, _, owners, p = routed
    status, body = await get(router)
    assert status == 503 and body["error"] == "NoOwner"
    assert f"no lease on partition {p} in the bucket" in body["message"]
    assert owners.seen == []


async def test_a_second_holder_that_refuses_too_is_answered_no_owner_once(routed) -> None:
    """The view names b and the bucket d, and both have handed the partition on: the request
    goes to each once, and d's NoOwner is the answer (the caller retries), not a loop."""
    router, log, owners, p = routed
    leases = router.node.leases
    leases.owners[p] = LeaseValue("b", "b-1")
    leases.members["b"] = Beat("b", "b-1", "http://b.test")
    await put(log, NODE_PREFIX + "d", Beat("d", "d-1", "http://d.test"))
    await put(log, LEASE_PREFIX + str(p), LeaseValue("d", "d-1"))
    status, body = await get(router)
    assert status == 503 and body == {"error": "NoOwner",
                                      "message": "d.test does not hold it now; retry"}
    assert owners.seen == ["b.test", "d.test"] and router.counts["reforwarded"] == 1


class OwningNode:
    """What the router asks of a node that owns the user's partition, applied up to 5."""

    def __init__(self, config) -> None:
        self.config, self.node_id, self.marks = config, "a", {}
        self.asked: list[tuple[int, float]] = []

    def owns(self, p: int) -> bool:
        return True

    async def wait_applied(self, p: int, min_seq: int, timeout: float) -> bool:
        self.asked.append((min_seq, timeout))
        return self.marks.get(p, 0) >= min_seq


async def test_a_read_waits_for_its_min_seq_then_answers_503_with_retry_after(
        cluster_config) -> None:
    """On the owner, a read with ?min_seq= is served once the partition's watermark reached
    it (waiting at most read_wait); otherwise 503 NotCaughtUp with Retry-After, never a stale
    answer; a min_seq that is not a number is a 422 naming it. The wait's length is in the
    answer's Server-Timing."""
    served: list[str] = []

    async def app(scope: dict, receive, send) -> None:
        served.append(scope["query_string"].decode())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    node = OwningNode(cluster_config)
    node.marks[partition_of(USER, cluster_config.partitions)] = 5
    router = Router(app, node)
    answers, timings = [], []
    for query in (b"min_seq=5", b"min_seq=6", b"min_seq=five", b""):
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        await router({"type": "http", "method": "GET", "path": PATH, "raw_path": PATH.encode(),
                      "query_string": query, "headers": [(b"host", b"a.test")]}, receive, send)
        answers.append((sent[0]["status"], dict(sent[0]["headers"]).get(b"retry-after"),
                        sent[1]["body"]))
        timings.append(dict(sent[0]["headers"]).get(b"server-timing"))
    await router.client.aclose()
    assert [status for status, _, _ in answers] == [200, 503, 422, 200]
    assert answers[1][1] is not None and b"NotCaughtUp" in answers[1][2]
    assert b"min_seq" in answers[2][2]
    # What the wait cost is in the answer (Server-Timing), served or not; no wait, no entry.
    for timing in timings[:2]:
        name, _, dur = timing.decode().partition(";dur=")
        assert name == "min-seq" and float(dur) >= 0
    assert timings[2:] == [None, None]
    assert served == ["min_seq=5", ""]  # the stale read never reached the engine
    assert node.asked == [(5, cluster_config.read_wait), (6, cluster_config.read_wait)]
    assert router.counts["waited"] == 2 and router.counts["unavailable"] == 1


async def test_the_inspector_of_a_user_is_sent_to_the_owner(routed) -> None:
    """A page of the inspector about a user of a partition this node does not hold is a
    307 to the same page on the owner (its copy is the current one; the login and its CSRF
    checks are the owner's own), query kept; pages about no user stay here."""
    router, log, owners, p = routed
    await put(log, LEASE_PREFIX + str(p), LeaseValue("c", "c-1"))
    here: list[str] = []

    async def app(scope: dict, receive, send) -> None:
        here.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"page"})

    router.app = app
    answers = []
    for path, query in ((f"/ui/users/{USER}/memory", b"q=cats"), ("/ui/", b""),
                        ("/ui/login", b"")):
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        await router({"type": "http", "method": "GET", "path": path,
                      "raw_path": path.encode(), "query_string": query,
                      "headers": [(b"host", b"a.test")]}, receive, send)
        answers.append((sent[0]["status"], dict(sent[0]["headers"]).get(b"location")))
    assert answers[0] == (307, f"http://c.test/ui/users/{USER}/memory?q=cats".encode())
    assert answers[1:] == [(200, None), (200, None)] and here == ["/ui/", "/ui/login"]


async def test_a_body_nested_past_the_decoders_depth_goes_to_the_app() -> None:
    """The router reads a POST body for its user_id; one nested deeper than the decoder
    descends raised RecursionError out of the router (a 500) where a single node answers
    422. It goes to the app, which answers it, as a body that is not JSON does."""
    seen: list[bytes] = []

    async def app(scope: dict, receive: Callable, send: Callable) -> None:
        seen.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 422, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    body = b"[" * 5_000 + b"]" * 5_000
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    path = "/v1/retrieve_memory"
    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
             "query_string": b"", "headers": [(b"host", b"a.test")]}
    await Router(app, None)(scope, receive, send)
    assert seen == [body] and sent[0]["status"] == 422


@pytest.mark.parametrize("encode", [lambda text: b"\xef\xbb\xbf" + text.encode(),
                                    lambda text: text.encode("utf-16")])
async def test_a_body_with_a_byte_order_mark_or_in_utf_16_goes_to_the_users_owner(
        routed, encode) -> None:
    """The app reads a JSON body with a BOM, or in UTF-16, as JSON says it may come; the
    router's decoder did not, took the body for one naming no user, and served the read
    here: a non-owner answered empty results (and a write tool 503 for ever)."""
    router, log, owners, p = routed
    await put(log, LEASE_PREFIX + str(p), LeaseValue("c", "c-1"))
    body = encode(msgspec.json.encode({"user_id": USER, "query": "x"}).decode())

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    assert await request(router, "POST", "/v1/retrieve_memory/raw", receive) == (
        200, {"served_by": "c"})
    assert owners.seen == ["c.test"]


async def test_a_body_naming_a_user_with_a_lone_surrogate_goes_to_the_app() -> None:
    """msgspec refuses a lone surrogate; the fallback reader took the id, and partitioning
    it raised UnicodeEncodeError (a 500) where a single node answers 422. It names no
    partition: the app answers it."""
    async def app(scope: dict, receive: Callable, send: Callable) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 422, "headers": []})
        await send({"type": "http.response.body", "body": b'{"error": "InvalidInput"}'})

    body = b'{"user_id": "\\ud800", "query": "x"}'

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    assert await request(Router(app, None), "POST", "/v1/retrieve_memory/raw", receive) == (
        422, {"error": "InvalidInput"})


async def test_a_forwarded_body_is_held_to_the_apps_size_and_wait(routed, monkeypatch) -> None:
    """The app's edge refuses a body over 8 MiB (413) and one that stalls for 30 s (408); a
    request the router forwards was read whole first, with neither: a 300 MB body took a
    non-owner's memory to a gigabyte, and a stalled one held its connection for ever."""
    router, log, owners, p = routed
    await put(log, LEASE_PREFIX + str(p), LeaseValue("c", "c-1"))
    monkeypatch.setattr("engine.cluster._router.BODY_WAIT", 0.2)
    chunk = b"x" * (1 << 20)

    async def huge() -> dict:
        return {"type": "http.request", "body": chunk, "more_body": True}

    recall = f"/v1/users/{USER}/recall"  # a read: forwarded to the owner
    status, answer = await request(router, "POST", recall, huge)
    assert (status, answer["error"]) == (413, "TooLarge")
    parts = [{"type": "http.request", "body": b'{"query": ', "more_body": True}]

    async def stalls() -> dict:
        if parts:
            return parts.pop()
        await trio.sleep_forever()

    status, answer = await request(router, "POST", recall, stalls)
    assert (status, answer["error"]) == (408, "RequestTimeout")
    assert owners.seen == []
