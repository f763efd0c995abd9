"""The partitioner: crc32 of the user id, the same in every process and on every machine."""

from __future__ import annotations

import subprocess
import sys
import urllib.parse
import zlib

from engine.cluster._partition import partition_of, subject_of, user_digest


def test_partition_is_crc32_of_the_utf8_user_id_mod_partitions() -> None:
    """Known values: a change of formula would move every user of a live cluster."""
    assert partition_of("maya") == zlib.crc32(b"maya") % 64 == 36
    assert partition_of("maya", 8) == zlib.crc32(b"maya") % 8
    assert partition_of("Zoë", 64) == zlib.crc32("Zoë".encode()) % 64
    assert {partition_of(f"user-{i}") for i in range(2000)} == set(range(64))


def test_partition_does_not_depend_on_the_process_hash_seed() -> None:
    """Python's salted hash() would differ between two nodes; crc32 does not."""
    code = ("from engine.cluster._partition import partition_of;"
            "print([partition_of(f'u{i}') for i in range(50)])")
    # Side by side: each child spends its time importing the package.
    children = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                 text=True, env={"PYTHONHASHSEED": seed})
                for seed in ("1", "2", "random")]
    outs = set()
    for child in children:
        out, _ = child.communicate(timeout=120)
        assert child.returncode == 0
        outs.add(out)
    assert len(outs) == 1
    assert outs.pop().strip() == str([partition_of(f"u{i}") for i in range(50)])


def test_a_users_subject_names_its_partition_and_a_digest_not_the_id() -> None:
    """Subjects can be purged per user, and never carry the id (dots, wildcards) in clear."""
    subject = subject_of("a.b*>", 64)
    root, p, digest = subject.split(".")
    assert (root, int(p), digest) == ("turns", partition_of("a.b*>", 64), user_digest("a.b*>"))
    assert len(digest) == 16 and all(c in "0123456789abcdef" for c in digest)


async def test_the_router_places_a_user_whose_id_holds_a_slash_by_the_whole_id() -> None:
    """"team/alice" reaches a node as /v1/users/team%2Falice/...: the router takes the user
    from that encoded segment (not "team" from the decoded path), so her reads go to her
    partition's owner and her turn writes are seen as writes through the log."""
    from types import SimpleNamespace

    from engine.cluster._router import Router

    owned = partition_of("team/alice", 8)
    assert owned != partition_of("team", 8)

    async def lookup(p: int) -> tuple[None, None]:  # nobody holds "team"'s partition
        return None, None

    node = SimpleNamespace(config=SimpleNamespace(partitions=8), owns=lambda p: p == owned,
                           leases=SimpleNamespace(owner=lambda p: None, lookup=lookup),
                           node_id="n1")
    served: list[tuple[str, str]] = []

    async def app(scope, receive, send) -> None:
        served.append((scope["method"], scope["raw_path"].decode()))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    router = Router(app, node)
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    try:
        for method, raw in (("GET", "/v1/users/team%2Falice/sessions"),
                            ("POST", "/v1/users/team%2Falice/sessions/a%2Fb/turns"),
                            ("GET", "/v1/users/team/sessions")):
            path = urllib.parse.unquote(raw)
            await router({"type": "http", "method": method, "path": path,
                          "raw_path": raw.encode(), "query_string": b"", "headers": []},
                         receive, send)
    finally:
        await router.client.aclose()
    assert served == [("GET", "/v1/users/team%2Falice/sessions"),
                      ("POST", "/v1/users/team%2Falice/sessions/a%2Fb/turns")]
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [200, 200, 503]
