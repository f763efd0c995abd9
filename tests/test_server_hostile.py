"""The HTTP face against hostile or careless clients: whatever a caller sends is a JSON 4xx
naming what was wrong, never a 5xx, and never lands under an id it did not mean."""

from __future__ import annotations

import json

import httpx
import pytest
import trio

from engine import InvalidInput
from engine._http_edge import KeysFirst, LocalOnly
from engine._http_wire import MAX_BATCH_TURNS
from engine._server import create_app, load_api_keys, serve

from .test_server import ADMIN_KEY, ANA_KEY, BO_KEY, ROUTES, _fill, _free_port, seg


def lenient(app, key: str | None = None) -> httpx.AsyncClient:
    """A client that sees a 500 as an answer, as a remote one would, not as a raised error."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                             base_url="http://127.0.0.1", headers=headers)


def invalid(response: httpx.Response, field: str) -> str:
    """Assert a 422 InvalidInput naming ``field``; its message."""
    assert response.status_code == 422, response.text
    assert response.json()["error"] == "InvalidInput", response.text
    assert response.json()["field"] == field, response.text
    return response.json()["message"]


async def test_a_body_field_named_query_is_named_in_its_422(mem) -> None:
    """A field called `query` (recall's, seed 001's) is named like any other, not as `body`;
    query-string and other body fields still are."""
    async with lenient(create_app(mem)) as http:
        invalid(await http.post("/v1/users/ana/recall", json={"query": 5}), "query")
        invalid(await http.post("/v1/users/ana/recall", json={}), "query")
        for route in ("/v1/retrieve_memory", "/v1/retrieve_memory/raw",
                      "/v1/context_pre_retrieve"):
            invalid(await http.post(route, json={"user_id": "ana", "query": ["x"]}), "query")
        invalid(await http.post("/v1/users/ana/recall", json={"query": "x", "limit": 0}),
                "limit")
        invalid(await http.get("/v1/users/ana/sessions/s1/turns", params={"limit": 0}), "limit")


async def test_malformed_json_is_a_422_on_the_body_on_every_route(mem) -> None:
    """Broken JSON, or bytes that are not UTF-8, are the body's fault (422, field `body`) on
    the routes FastAPI parses as on those that parse their own: no offset posing as a field,
    no bare 400."""
    async with lenient(create_app(mem)) as http:
        for url in ("/v1/users/ana/sessions/s1/turns", "/v1/users/ana/notes",
                    "/v1/users/ana/turns", "/v1/retrieve_memory", "/v1/tools/search_memory"):
            for content in (b"{", b'{"text": "x"} trailing', b'{"text": "\xff"}'):
                message = invalid(await http.post(url, content=content), "body")
                assert "JSON" in message, (url, content, message)


async def test_json_nested_too_deep_is_a_422_that_says_so_on_every_route(mem) -> None:
    """A body nested deeper than the parser goes is refused as that, on the routes FastAPI
    parses too, where it was reported as bytes that are not UTF-8."""
    deep = b"[" * 100_000 + b"]" * 100_000
    async with lenient(create_app(mem)) as http:
        for url in ("/v1/users/ana/sessions/s1/turns", "/v1/users/ana/notes",
                    "/v1/users/ana/turns", "/v1/retrieve_memory", "/v1/tools/search_memory"):
            message = invalid(await http.post(url, content=deep), "body")
            assert "UTF-8" not in message, (url, message)
            assert "nested" in message or "recursion limit" in message, (url, message)


async def test_invalid_utf8_in_a_path_or_query_is_422_never_another_id(mem) -> None:
    """Percent-escapes that are not UTF-8 (%FF, an encoded lone surrogate) are refused, not
    replaced by U+FFFD, which would make distinct ids ("x%FE", "x%FF") one user; escapes that
    are UTF-8 (an emoji) still reach their id."""
    async with lenient(create_app(mem)) as http:
        turn = {"role": "user", "text": "hi", "durable": True}
        for url in ("/v1/users/x%FE/sessions/s/turns", "/v1/users/x%FF/sessions/s/turns",
                    "/v1/users/ana/sessions/s%ED%A0%80/turns"):
            invalid(await http.post(url, json=turn), "path")
        invalid(await http.get("/v1/users/ana/facts?category=%FF"), "query")
        invalid(await http.delete("/v1/users/ana/scopes?agent_id=%FE"), "query")
        assert (await http.get(f"/v1/users/{seg('x' + chr(0xFFFD))}/sessions")).json() == []
        assert (await http.get("/v1/users/ana/sessions")).json() == []
        emoji = await http.post("/v1/users/%F0%9F%98%80/sessions/s/turns", json=turn)
        assert emoji.status_code == 201, emoji.text
        assert [t["user_id"] for t in (await http.get(
            f"/v1/users/{seg(chr(0x1F600))}/sessions/s/turns")).json()] == [chr(0x1F600)]


async def test_tool_arguments_holding_a_lone_surrogate_are_422_not_5xx(mem) -> None:
    """The tool route's JSON parser lets "\\ud800" through (the others refuse it); text that
    UTF-8 cannot hold is refused before the engine sees it, wherever it sits."""
    async with lenient(create_app(mem)) as http:
        url = "/v1/tools/search_memory"
        for arguments in (rb'{"user_id": "ana", "query": "x", "where": {"\ud800": 1}}',
                          rb'{"user_id": "ana", "query": "x", "where": {"a": "\udc00\ud800"}}',
                          rb'{"user_id": "ana", "query": "\ud800"}'):
            message = invalid(await http.post(url, content=arguments), "arguments")
            assert "UTF-8" in message
        fine = await http.post(url, json={"user_id": "ana", "query": "x", "where": {"a": "é"}})
        assert fine.status_code == 200, fine.text


async def test_a_snapshot_dest_the_server_cannot_use_is_422_naming_dest(
        mem, tmp_path, monkeypatch) -> None:
    """A relative dest (it would land in the server's working directory), NUL, a lone
    surrogate, a name too long or a path through a file are the caller's mistakes: 422 on
    `dest`, nothing written; an absolute new directory still works."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    (tmp_path / "a-file").write_text("not a directory")
    async with lenient(create_app(mem)) as http:
        for dest in ("relative", " ", str(tmp_path / "nul\x00byte"), str(tmp_path / "\ud800"),
                     str(tmp_path / ("x" * 300)), str(tmp_path / "a-file" / "snap")):
            sent = json.dumps({"dest": dest}).encode()  # "\ud800" escaped, as JSON allows
            invalid(await http.post("/v1/snapshot", content=sent), "dest")
        assert list(cwd.iterdir()) == []
        ok = await http.post("/v1/snapshot", json={"dest": str(tmp_path / "snap")})
        assert ok.status_code == 200, ok.text


async def test_a_401_never_echoes_the_key_it_was_sent(mem, tmp_path) -> None:
    """A key sent without its scheme (or with a tab for the space) is refused without being
    written back into the answer, where logs and proxies would keep it."""
    keys = tmp_path / "keys"
    keys.write_text(f"{ANA_KEY} ana\n")
    async with lenient(create_app(mem, load_api_keys(keys))) as http:
        for header in (ANA_KEY, f"Bearer\t{ANA_KEY}", f"Token {ANA_KEY}", f"{ANA_KEY} x"):
            refused = await http.get("/v1/users/ana/sessions",
                                     headers={"Authorization": header})
            assert refused.status_code == 401, (header, refused.text)
            assert ANA_KEY not in refused.text, (header, refused.text)
            assert "no 'Bearer ' scheme" in refused.json()["message"], refused.text


async def test_a_key_no_http_header_can_carry_is_refused_when_the_file_is_read(
        mem, tmp_path) -> None:
    """A key with a character outside printable ASCII (an accented passphrase) could never be
    presented: a header's bytes are read as Latin-1, so the key the client sends hashes to
    another digest and every call is a 401. The file is refused at start-up instead, naming
    the line and not the key."""
    keys = tmp_path / "keys"
    keys.write_text("ana-plain ana\npassphrase-do-jos\u00e9 jose\n", encoding="utf-8")
    try:
        app = create_app(mem, load_api_keys(keys))
    except InvalidInput as exc:
        assert exc.field == "api_keys"
        assert f"{keys}:2" in str(exc) and "printable ASCII" in str(exc), exc
        assert "passphrase" not in str(exc), exc
    else:
        async with lenient(app) as http:  # curl sends the key as it is in the file: UTF-8
            sent = {"Authorization": "Bearer passphrase-do-jos\u00e9".encode()}
            answer = await http.get("/v1/users/jose/sessions", headers=sent)
        raise AssertionError(f"a key no client can present was loaded: {answer.status_code}")
    for odd in ("key\x7fdel ana", "key\x01ctl ana"):
        keys.write_text(odd + "\n")
        with pytest.raises(InvalidInput, match="printable ASCII"):
            load_api_keys(keys)
    keys.write_bytes("ana-key jos\u00e9\n".encode("latin-1"))  # an editor's legacy encoding
    with pytest.raises(InvalidInput, match=r"expected a keys file in UTF-8, found byte 0xe9"):
        load_api_keys(keys)


async def test_a_keys_file_saved_with_a_byte_order_mark_and_crlf_reads_as_written(
        mem, tmp_path) -> None:
    """A keys file from a Windows editor (a UTF-8 byte order mark, CRLF line ends): its first
    key works like the others, instead of holding an invisible U+FEFF no client sends."""
    keys = tmp_path / "keys"
    keys.write_bytes(f"\ufeff{ANA_KEY} ana\r\n{ADMIN_KEY} *\r\n".encode())
    app = create_app(mem, load_api_keys(keys))
    async with lenient(app, ANA_KEY) as http, lenient(app, ADMIN_KEY) as admin:
        assert (await http.get("/v1/users/ana/sessions")).status_code == 200
        assert (await admin.get("/v1/stats")).status_code == 200


async def test_hostile_bodies_and_ids_never_get_a_5xx_and_leave_the_engine_usable(
        mem, tmp_path) -> None:
    """A sweep of wrong types, bad numbers, unicode edge cases and odd ids over the routes:
    every answer is a JSON 2xx or 4xx, and another user's data is untouched afterwards."""
    keys = tmp_path / "keys"
    keys.write_text(f"{ANA_KEY} ana\n{ADMIN_KEY} *\n")
    app = create_app(mem, load_api_keys(keys), max_body_bytes=50_000)
    async with lenient(app, ANA_KEY) as http, lenient(app, ADMIN_KEY) as admin:
        kept = await admin.post("/v1/users/bo/sessions/s/turns",
                                json={"role": "user", "text": "bo's", "durable": True})
        assert kept.status_code == 201
        turns = "/v1/users/ana/sessions/s1/turns"
        values = [None, 0, -1, 10**20, 1.5, True, "", " ", [], {}, {"a": [1]}, "a\x00b",
                  "\u202e\u05d0", "\U0001F600", "x" * 40_000]
        for value in values:
            for body in ({"role": "user", "text": value}, {"role": value, "text": "x"},
                         {"role": "user", "text": "x", "at": value},
                         {"role": "user", "text": "x", "meta": {"k": value}},
                         {"role": "user", "text": "x", "agent_id": value}):
                answer = await http.post(turns, json=body)
                assert answer.status_code < 500 and answer.json(), (body, answer.text)
            for url, body in (("/v1/users/ana/recall", {"query": "x", "limit": value}),
                              ("/v1/users/ana/recall", {"query": value}),
                              ("/v1/retrieve_memory", {"user_id": "ana", "query": "x",
                                                       "episodic_limit": value}),
                              ("/v1/context_pre_retrieve", {"user_id": "ana", "query": "x",
                                                            "semantic_limit": value}),
                              ("/v1/tools/search_memory", {"user_id": "ana", "query": "x",
                                                           "limit": value}),
                              ("/v1/users/ana/notes", {"text": value}),
                              ("/v1/users/ana/facts", {"category": "c", "key": "k",
                                                       "value": "v", "importance": value})):
                answer = await http.post(url, json=body)
                assert answer.status_code < 500, (url, body, answer.text)
        for at in ("0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00",
                   "2026-03-01T09:00:00", "2026-13-01T00:00:00Z"):
            invalid(await http.post(turns, json={"role": "user", "text": "x", "at": at}), "at")
            invalid(await http.post("/v1/users/ana/recall", json={"query": "x", "as_of": at}),
                    "as_of")
        for ident in ("%2E%2E", "%2F", "%00", "a%20", "%F0%9F%98%80", "x" * 300, "%E2%80%AE"):
            for method in ("GET", "POST", "DELETE", "HEAD", "OPTIONS"):
                answer = await http.request(method, f"/v1/users/ana/sessions/{ident}/turns")
                assert answer.status_code < 500, (method, ident, answer.text)
        for limit in ("0", "-1", str(10**20), "1&limit=2", "nan"):
            answer = await http.get(f"{turns}?limit={limit}")
            assert answer.status_code < 500, (limit, answer.text)
        for method in ("HEAD", "OPTIONS", "PATCH"):
            assert (await http.request(method, "/v1/retrieve_memory")).status_code == 405
        assert (await http.post(turns, content=b"x" * 60_000)).status_code == 413
        assert (await http.post("/v1/users/ana/recall", json={"query": "x"})).status_code == 200
        assert [t["text"] for t in (await admin.get("/v1/users/bo/sessions/s/turns")).json()] == [
            "bo's"]


async def test_a_key_for_one_user_cannot_reach_another_through_a_body(
        mem, tmp_path) -> None:
    """The seed-001 routes and the tools take the user from the body: another user's id there
    is 403 however it is spelled (a duplicate key, the wrong type), and nothing is written."""
    keys = tmp_path / "keys"
    keys.write_text(f"{ANA_KEY} ana\n")
    async with lenient(create_app(mem, load_api_keys(keys)), ANA_KEY) as http:
        for url in ("/v1/retrieve_memory", "/v1/retrieve_memory/raw",
                    "/v1/context_pre_retrieve", "/v1/tools/search_memory"):
            assert (await http.post(url, json={"user_id": "bo", "query": "x"})
                    ).status_code == 403
            # JSON's last duplicate wins, for the check and the call alike.
            assert (await http.post(url, content=b'{"user_id": "ana", "user_id": "bo", '
                                                 b'"query": "x"}')).status_code == 403
            assert (await http.post(url, json={"user_id": ["bo"], "query": "x"})
                    ).status_code == 422
        for name, arguments in (("store_note", {"user_id": "bo", "text": "planted"}),
                                ("remember_fact", {"user_id": "bo", "category": "c",
                                                   "key": "k", "value": "v"}),
                                ("store_note", {"text": "planted"})):
            assert (await http.post(f"/v1/tools/{name}", json=arguments)).status_code in (
                403, 422)
    assert await mem.list_notes("bo") == [] and await mem.profile("bo") == []


async def test_a_batch_of_more_turns_than_the_cap_is_a_422_and_writes_none(mem) -> None:
    """A body within the byte limit can carry ~190,000 tiny turns, each a model to build
    before any await: past MAX_BATCH_TURNS it is refused naming `turns` and both counts."""
    one = {"session_id": "s1", "role": "user", "text": "x"}
    async with lenient(create_app(mem)) as http:
        over = await http.post("/v1/users/ana/turns",
                               json={"turns": [one] * (MAX_BATCH_TURNS + 1)})
        message = invalid(over, "turns")
        assert f"at most {MAX_BATCH_TURNS}" in message and str(MAX_BATCH_TURNS + 1) in message
        assert (await http.get("/v1/users/ana/sessions")).json() == []
        full = await http.post("/v1/users/ana/turns", json={"turns": [one] * MAX_BATCH_TURNS})
        assert full.status_code == 202 and len(full.json()["turns"]) == MAX_BATCH_TURNS


async def test_parallel_writes_to_one_session_keep_every_turn_in_its_order(mem) -> None:
    """Many concurrent posts to one session, single and batched: each answered seq holds its
    own text, seqs are dense, and every batch's turns stay contiguous and in order."""
    async with lenient(create_app(mem)) as http:
        url = "/v1/users/ana/sessions/s1/turns"
        seq_of: dict[str, int] = {}

        async def one(i: int) -> None:
            answer = await http.post(url, json={"role": "user", "text": f"m{i}",
                                                "durable": i % 4 == 0})
            assert answer.status_code in (201, 202), answer.text
            seq_of[f"m{i}"] = answer.json()["seq"]

        async def batch(i: int) -> None:
            answer = await http.post("/v1/users/ana/turns", json={"turns": [
                {"session_id": "s1", "role": "user", "text": f"b{i}.{j}"} for j in range(4)]})
            assert answer.status_code == 202, answer.text
            for j, receipt in enumerate(answer.json()["turns"]):
                seq_of[f"b{i}.{j}"] = receipt["seq"]

        async with trio.open_nursery() as nursery:
            for i in range(60):
                nursery.start_soon(one, i)
                if i % 6 == 0:
                    nursery.start_soon(batch, i)
        history = (await http.get(url, params={"limit": 10_000})).json()
        assert len(history) == len(seq_of) == 100
        assert [t["seq"] for t in history] == list(range(100))
        assert all(seq_of[t["text"]] == t["seq"] for t in history)
        for i in range(0, 60, 6):
            seqs = [seq_of[f"b{i}.{j}"] for j in range(4)]
            assert seqs == list(range(seqs[0], seqs[0] + 4))
        await mem.flush()
        assert (await http.get(url, params={"limit": 10_000})).json() == history


async def test_a_where_filter_with_an_integer_out_of_range_is_422(mem) -> None:
    """An integer no index can hold (past 2**63, or past a float's range for gt/lt) is the
    filter's fault: 422 naming it, not a 503 EngineBroken or a 500."""
    async with lenient(create_app(mem)) as http:
        for where, field in (({"a": 10**30}, "where.a"), ({"a": {"in": [-10**30]}}, "where.a"),
                             ({"a": {"gt": 10**400}}, "where.a.gt")):
            answer = await http.post("/v1/users/ana/recall", json={"query": "x", "where": where})
            assert answer.status_code == 422, (where, answer.text)
            assert answer.json()["field"].startswith(field), answer.text



async def test_head_answers_as_get_without_the_body(mem, tmp_path) -> None:
    """HEAD, which every HTTP server must support, is GET's status and headers with no body:
    probes and user routes alike, keys checked as for GET; a route without GET stays 405."""
    keys = tmp_path / "keys"
    keys.write_text(f"{ANA_KEY} ana\n")
    app = create_app(mem, load_api_keys(keys))
    async with lenient(app, ANA_KEY) as http, lenient(app) as anon:
        for url in ("/healthz", "/v1/users/ana/sessions", "/v1/tools"):
            got, head = await http.get(url), await http.head(url)
            assert head.status_code == got.status_code == 200, (url, head.text)
            assert head.content == b"" and head.headers["content-length"] == str(
                len(got.content))
        assert (await anon.head("/v1/users/ana/sessions")).status_code == 401
        assert (await http.head("/v1/users/bo/sessions")).status_code == 403
        assert (await http.head("/v1/retrieve_memory")).status_code == 405


async def _serving(nursery: trio.Nursery, store) -> str:
    """`serve` of ``store`` on a free loopback port in ``nursery`` (no keys, no background
    embedding): its URL."""
    binds = await nursery.start(lambda task_status: serve(
        store, port=_free_port(), say=lambda line: None, handle_signals=False,
        config={"background_embedding": False}, task_status=task_status))
    return binds[0]


async def test_head_and_a_bad_escape_over_a_real_socket(tmp_path) -> None:
    """Through Hypercorn (which decodes the path itself, and frames a HEAD answer with no
    body): HEAD is answered, and a %FF in a path is a 422, not the user U+FFFD."""
    async with trio.open_nursery() as nursery:
        url = await _serving(nursery, tmp_path / "store")
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            head = await http.head("/healthz")
            assert head.status_code == 200 and head.content == b""
            assert (await http.get("/healthz")).json() == {"status": "ok"}  # still in step
            bad = await http.post("/v1/users/x%FF/sessions/s/turns",
                                  json={"role": "user", "text": "hi", "durable": True})
            assert (bad.status_code, bad.json()["field"]) == (422, "path")
        nursery.cancel_scope.cancel()


async def test_a_server_without_keys_serves_only_this_machines_own_clients(mem, tmp_path) -> None:
    """With no api-keys file a web page in the same machine's browser must not reach the API:
    neither by a cross-site form or no-cors POST (read as JSON whatever its label, and never
    preflighted), nor under a name of its own rebound to 127.0.0.1. curl-like clients (no
    Origin) and the server's own origin still write; with keys, the key is the guard."""
    app = create_app(mem)
    turns = "/v1/users/ana/sessions/s1/turns"
    planted = b'{"role": "user", "text": "planted"}'
    async with lenient(app) as http:
        for origin in ("http://evil.example", "null", "http://127.0.0.1:9999"):
            answer = await http.post(turns, content=planted, headers={
                "content-type": "text/plain", "origin": origin})
            assert answer.status_code == 403 and "Origin" in answer.json()["message"], origin
        answer = await http.delete("/v1/users/ana", headers={"origin": "http://evil.example"})
        assert answer.status_code == 403
        assert (await http.post(turns, json={"role": "user", "text": "mine",
                                                "durable": True})).status_code == 201
        same = await http.post(turns, json={"role": "user", "text": "from my page",
                                            "durable": True},
                               headers={"origin": "http://127.0.0.1"})
        assert same.status_code == 201
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://rebound.evil.example:8080") as rebound:
        for answer in (await rebound.get(f"{turns}"), await rebound.get("/healthz"),
                       await rebound.post(turns, json={"role": "user", "text": "planted"})):
            assert answer.status_code == 403 and "loopback" in answer.json()["message"]
    texts = [t.text for t in await mem.session_history("ana", "s1", 10)]
    assert texts == ["mine", "from my page"]
    keys = tmp_path / "keys"
    keys.write_text(f"{ANA_KEY} ana\n")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(
            app=create_app(mem, load_api_keys(keys))), base_url="https://memory.example",
            headers={"Authorization": f"Bearer {ANA_KEY}", "origin": "https://bot.example"}) as far:
        answer = await far.post(turns, json={"role": "user", "text": "remote", "durable": True})
        assert answer.status_code == 201


async def test_a_keyless_cluster_node_refuses_before_its_router_forwards() -> None:
    """A node's router forwards a request to the user's owner before any Edge sees it, so the
    node puts LocalOnly in front of it: a rebound name or a cross-site write never reaches an
    owner, whose Edge would see the router's loopback Host and no Origin."""
    reached = []

    async def router(scope, receive, send) -> None:
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    app = LocalOnly(router)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://rebound.evil.example") as evil:
        assert (await evil.get("/v1/users/ana/sessions")).status_code == 403
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://127.0.0.1:8080") as local:
        answer = await local.delete("/v1/users/ana", headers={"origin": "http://evil.example"})
        assert answer.status_code == 403
        assert (await local.delete("/v1/users/ana")).status_code == 204
    assert reached == ["/v1/users/ana"]


async def test_a_keyed_cluster_node_refuses_a_keyless_caller_before_its_router(
        tmp_path) -> None:
    """A node's router reads a body to find its user (retrieve_memory, the tools) and forwards
    requests to their owner before the owner's Edge checks the key: an anonymous client made
    every node hold and parse its 8 MiB, and had it forwarded. The node puts KeysFirst in
    front of its router: no key, an unknown one, or another user's path is refused there,
    before a byte of the body is read."""
    keys = tmp_path / "keys"
    keys.write_text(f"{ANA_KEY} ana\n{ADMIN_KEY} *\n")
    reached = []

    async def router(scope, receive, send) -> None:
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    app = KeysFirst(router, load_api_keys(keys))
    read: list[str] = []

    async def receive() -> dict:
        read.append("receive")
        await trio.sleep_forever()

    for path, key, expected in (("/v1/retrieve_memory", None, 401),
                                ("/v1/tools/search_memory", "wrong", 401),
                                ("/v1/users/bo/notes", ANA_KEY, 403), ("/metrics", None, 401)):
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        headers = [(b"host", b"127.0.0.1:8080"), (b"content-length", b"1000")]
        if key is not None:
            headers.append((b"authorization", f"Bearer {key}".encode()))
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": b"", "root_path": "", "headers": headers,
                 "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8080)}
        with trio.fail_after(5):
            await app(scope, receive, send)
        assert sent[0]["status"] == expected, (path, key)
    assert (reached, read) == ([], [])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://127.0.0.1:8080") as http:
        ana = {"Authorization": f"Bearer {ANA_KEY}"}
        assert (await http.post("/v1/retrieve_memory", headers=ana, json={})).status_code == 204
        assert (await http.get("/healthz")).status_code == 204
    assert reached == ["/v1/retrieve_memory", "/healthz"]


async def test_a_client_that_never_reads_its_answers_cannot_hold_the_server(
        tmp_path, monkeypatch) -> None:
    """Hypercorn writes an answer in a shielded send: a client that pipelines requests and
    never reads what comes back held its connection for ever, past every timeout, and a
    SIGTERM's graceful stop never ended (the process exited only when that client went
    away). The listening sockets now bound how long an answer may sit untaken (SEND_WAIT,
    TCP_USER_TIMEOUT): such a connection is dropped, and the stop ends. The server also
    takes every file descriptor its hard limit allows, as each connection holds one."""
    import resource
    import socket
    import threading
    import time

    from engine import _server

    monkeypatch.setattr(_server, "SEND_WAIT", 1.0)
    keys = tmp_path / "keys"
    keys.write_text(f"{ANA_KEY} ana\n")
    port = _free_port()
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    # Were the stop to wait on that client, it waits until the client goes away: here after
    # 30 s (a hang is a failure below, not a hung suite).
    gone = threading.Timer(30, stuck.close)
    gone.start()
    started = time.monotonic()
    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                await nursery.start(lambda task_status: serve(
                    tmp_path / "store", port=port, api_keys=keys, say=lambda line: None,
                    handle_signals=False, config={"background_embedding": False},
                    task_status=task_status))
                soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                assert soft == hard or hard == resource.RLIM_INFINITY
                await trio.to_thread.run_sync(stuck.connect, ("127.0.0.1", port))
                await trio.to_thread.run_sync(
                    stuck.sendall, b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n" * 300)
                await trio.sleep(1)  # the answers fill every buffer between the two
                nursery.cancel_scope.cancel()  # the stop waits for the stuck send to end
        assert time.monotonic() - started < 20, "the stop waited for a client that never reads"
    finally:
        gone.cancel()
        stuck.close()


async def test_durable_in_a_body_is_a_json_boolean_or_a_422(mem) -> None:
    """pydantic's lax bool read "no", "off" and 0 as false and "yes", "1" and 1 as true: a
    string or a number for durable is refused naming durable, and nothing is written."""
    one = {"session_id": "s1", "role": "user", "text": "x"}
    async with lenient(create_app(mem)) as http:
        for durable in ("no", "yes", "true", 1, 0, None):
            invalid(await http.post("/v1/users/ana/sessions/s1/turns",
                                    json={"role": "user", "text": "x", "durable": durable}),
                    "durable")
            invalid(await http.post("/v1/users/ana/turns",
                                    json={"turns": [one], "durable": durable}), "durable")
        assert (await http.get("/v1/users/ana/sessions")).json() == []
        buffered = await http.post("/v1/users/ana/sessions/s1/turns",
                                   json={"role": "user", "text": "x", "durable": False})
        durable = await http.post("/v1/users/ana/turns", json={"turns": [one], "durable": True})
        assert (buffered.status_code, durable.status_code) == (202, 201)


async def test_a_review_rating_of_true_or_a_float_is_a_422_and_records_nothing(mem) -> None:
    """pydantic's Literal took JSON true for the rating 1 ("again") and 3.0 for 3, and the
    review was recorded, where the engine and the documented schema take neither."""
    receipt = await mem.add_turn("ana", "s1", "user", "I moved to Lisbon", durable=True)
    url = f"/v1/users/ana/memories/{receipt.turn_id}/review"
    async with lenient(create_app(mem)) as http:
        for rating in (True, False, 1.0, 3.0, "3", None):
            invalid(await http.post(url, json={"rating": rating}), "rating")
        first = await http.post(url, json={"rating": "good"})
        assert first.status_code == 200 and first.json()["reps"] == 1, first.text
        assert (await http.post(url, json={"rating": 4})).json()["reps"] == 2


async def test_a_number_field_given_true_or_a_string_is_a_422_and_stores_nothing(mem) -> None:
    """pydantic's lax numbers took JSON true for 1 and "0.5" for 0.5, so a client's bug was
    stored as a note's or a fact's importance; a number field takes a JSON number."""
    fact = {"category": "c", "key": "k", "value": "v"}
    async with lenient(create_app(mem)) as http:
        for value in (True, False, "0.5", "1"):
            for url, body, field in (
                    ("/v1/users/ana/facts", {**fact, "importance": value}, "importance"),
                    ("/v1/users/ana/facts", {**fact, "confidence": value}, "confidence"),
                    ("/v1/users/ana/notes", {"text": "x", "importance": value}, "importance"),
                    ("/v1/users/ana/recall", {"query": "x", "limit": value}, "limit"),
                    ("/v1/users/ana/recall", {"query": "x", "min_importance": value},
                     "min_importance"),
                    ("/v1/retrieve_memory", {"user_id": "ana", "query": "x",
                                             "episodic_limit": value}, "episodic_limit"),
                    ("/v1/context_pre_retrieve", {"user_id": "ana", "query": "x",
                                                  "semantic_limit": value}, "semantic_limit")):
                invalid(await http.post(url, json=body), field)
        assert (await http.get("/v1/users/ana/notes")).json() == []
        assert (await http.get("/v1/users/ana/facts")).json() == []
        kept = await http.post("/v1/users/ana/notes", json={"text": "x", "importance": 1})
        assert kept.status_code == 201 and kept.json()["importance"] == 1.0, kept.text
        assert (await http.post("/v1/users/ana/recall",
                                json={"query": "x", "limit": 5.0})).status_code == 200


async def test_a_caller_without_a_key_is_refused_before_its_body_is_read(mem,
                                                                         tmp_path) -> None:
    """Every route but the two lean ones read and parsed the whole body (up to 8 MiB) before
    it checked the key: an anonymous client held ~8 MiB of the server a connection, and
    twenty bodies of empty objects held the loop (and every user's turns) for seconds. Now no
    key, an unknown key, and a key for another user's path are answered before a byte of the
    body is asked for (a route with the user in its body checks it once the body is read)."""
    keys = tmp_path / "keys"
    keys.write_text(f"{ANA_KEY} ana\n{BO_KEY} bo\n{ADMIN_KEY} *\n")
    app = create_app(mem, load_api_keys(keys))
    for method, path, body in [*ROUTES, ("GET", "/metrics", None), ("GET", "/v1/tools", None),
                               ("GET", "/v1/stats", None), ("POST", "/v1/snapshot", {})]:
        for key, user, expected in ((None, "ana", 401), ("wrong", "ana", 401),
                                    (BO_KEY, "ana", 403), (ANA_KEY, "bo", 403)):
            if expected == 403 and not path.startswith("/v1/users/"):
                continue
            asked: list[str] = []
            sent: list[dict] = []

            async def receive() -> dict:
                asked.append("receive")
                await trio.sleep_forever()

            async def send(message: dict) -> None:
                sent.append(message)

            raw = _fill(path, user).encode()
            target, _, query = raw.partition(b"?")
            headers = [(b"host", b"127.0.0.1:8080"), (b"content-length", b"1000")]
            if key is not None:
                headers.append((b"authorization", f"Bearer {key}".encode()))
            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                     "method": method, "scheme": "http", "path": target.decode(),
                     "raw_path": target, "query_string": query, "root_path": "",
                     "headers": headers, "client": ("127.0.0.1", 5000),
                     "server": ("127.0.0.1", 8080)}
            with trio.fail_after(5):
                await app(scope, receive, send)
            assert (sent[0]["status"], asked) == (expected, []), (method, path, key, sent[:1])
            answer = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
            assert answer["error"] == {401: "Unauthorized", 403: "Forbidden"}[expected]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://127.0.0.1:8080") as http:
        blank = await http.get("/v1/users/ana/notes", headers={"Authorization": "Bearer   "})
        # The scheme is there and the key is blank: it said "a header with no 'Bearer '
        # scheme".
        assert blank.status_code == 401 and "'Bearer' and no key" in blank.json()["message"]
        # Refused before routing, still counted under the route's template (not "unmatched").
        metrics = (await http.get("/metrics", headers={
            "Authorization": f"Bearer {ADMIN_KEY}"})).text
    assert ('engram_http_requests_total{method="GET",route="/v1/users/{user_id}/notes",'
            'status="401"}') in metrics, [m for m in metrics.splitlines() if "401" in m]


async def test_a_body_that_stops_arriving_is_a_408_and_nothing_is_written(mem,
                                                                        monkeypatch) -> None:
    """A client that sends part of a body and then nothing (a stalled upload, a slow-body
    attack) held its request, and the task serving it, until the server stopped: nothing
    bounded the wait for the rest. Once BODY_WAIT passes without a byte it is a 408 with the
    engine's JSON error, and the turn it carried is not written. A response that takes long
    is not cut: only the wait for the request's own bytes is bounded."""
    from engine import _http_edge

    monkeypatch.setattr(_http_edge, "BODY_WAIT", 0.05)
    app = create_app(mem)
    parts = [{"type": "http.request", "body": b'{"role": "user", "text": "hal',
              "more_body": True}]
    sent: list[dict] = []

    async def receive() -> dict:
        if parts:
            return parts.pop(0)
        await trio.sleep_forever()

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/users/ana/sessions/s/turns",
             "raw_path": b"/v1/users/ana/sessions/s/turns", "query_string": b"",
             "root_path": "", "headers": [(b"host", b"127.0.0.1:8080"),
                                          (b"content-length", b"60")],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8080)}
    with trio.fail_after(10):
        await app(scope, receive, send)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 408
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert body["error"] == "RequestTimeout" and "body" in body["message"]
    await mem.flush()
    assert await mem.session_history("ana", "s") == []


async def test_a_client_gone_mid_body_is_no_server_failure(mem, caplog) -> None:
    """A client that disconnects while its body is read: nothing is stored, nothing is logged
    as an error, and /metrics counts it as 499 (the client closed it), not 500 (before, a
    traceback at ERROR and a 500 in the metrics for every dropped upload)."""
    app = create_app(mem)

    async def send(message: dict) -> None:
        pass

    # A route that reads its own body, and one whose body FastAPI reads (answering a 422).
    for path in ("/v1/users/ana/sessions/s/turns", "/v1/users/ana/notes"):
        messages = [{"type": "http.request", "body": b'{"role": "user", "te',
                     "more_body": True}, {"type": "http.disconnect"}]

        async def receive() -> dict:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": b"", "headers": [(b"host", b"127.0.0.1")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "root_path": ""}
        with caplog.at_level("WARNING"):
            await app(scope, receive, send)
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    async with lenient(app) as http:
        counted = [line for line in (await http.get("/metrics")).text.splitlines()
                   if line.startswith("engram_http_requests_total")
                   and ("turns" in line or "notes" in line)]
    assert len(counted) == 2 and all('status="499"' in line for line in counted), counted
    assert await mem.session_history("ana", "s") == []
    assert await mem.list_notes("ana") == []


async def test_a_made_up_method_is_no_label_of_its_own_in_the_metrics(mem) -> None:
    """Any method name a client sends (no key needed) became a label value of the request
    counter and the latency histogram, kept for good: a few thousand requests with made-up
    8 KB methods made /metrics 150 MB. Methods outside HTTP's own are counted as "other"."""
    async with lenient(create_app(mem)) as http:
        for i in range(50):
            await http.request(f"M{i:06d}" + "X" * 200, "/healthz")
        await http.request("PATCH", "/healthz")
        text = (await http.get("/metrics")).text
    methods = {line.split('method="', 1)[1].split('"', 1)[0]
               for line in text.splitlines()
               if line.startswith("engram_http_requests_total{")}
    assert methods == {"PATCH", "other"}, methods  # the GET is counted once it is answered


async def test_a_time_is_an_iso_string_never_a_number_read_in_a_guessed_unit(mem) -> None:
    """The API documents ISO 8601 times. pydantic's lax reading took a JSON number (or a
    string of digits) as a Unix time whose unit it guessed from its size: at=2.5e10 was
    stored as a turn of 17 October 1970, and "1700000000" as one of 2023. Each is a 422
    naming the field; an ISO time still goes in."""
    async with lenient(create_app(mem), ADMIN_KEY) as http:
        for at in (2.5e10, 1_700_000_000, "1700000000", "1.7e9", True):
            turn = {"role": "user", "text": "x", "at": at}
            invalid(await http.post("/v1/users/ana/sessions/s1/turns", json=turn), "at")
            batch = {"turns": [{"session_id": "s2", **turn}]}
            assert invalid(await http.post("/v1/users/ana/turns", json=batch), "turns.0.at")
            invalid(await http.post("/v1/users/ana/recall", json={"query": "x", "since": at}),
                    "since")
            invalid(await http.post("/v1/users/ana/facts", json={
                "category": "identity", "key": "city", "value": "Porto", "valid_at": at}),
                "valid_at")
            invalid(await http.get("/v1/users/ana/facts", params={"as_of": str(at)}), "as_of")
        ok = await http.post("/v1/users/ana/sessions/s1/turns",
                             json={"role": "user", "text": "x", "at": "2026-03-01T09:00:00Z"})
        assert ok.status_code == 202, ok.text
        assert (await http.get("/v1/users/ana/sessions/s1/turns")).json()[0]["at"].startswith(
            "2026-03-01T09:00:00")


async def test_a_batch_item_the_engine_refuses_is_named_as_the_body_names_it(mem) -> None:
    """The same bad item of POST /v1/users/{u}/turns was `turns.0.at` when the body's model
    refused it and `items[0].at`, a field the body does not have, when the engine did (a time
    without its zone): both are named as the body names them."""
    async with lenient(create_app(mem)) as http:
        batch = {"turns": [{"session_id": "s", "role": "user", "text": "x"},
                           {"session_id": "s", "role": "user", "text": "y",
                            "at": "2026-03-01T09:00:00"}]}
        message = invalid(await http.post("/v1/users/ana/turns", json=batch), "turns.1.at")
        assert "timezone" in message


async def test_big_bodies_are_parsed_a_few_at_a_time(nursery) -> None:
    """A JSON body near the 8 MiB limit parses into about 200 MB of objects (a list of
    millions of empty objects) before any check of the engine's can refuse it, and those
    live until the request ends: four at once took the server from 220 to 840 MB, so a
    handful of callers could take all of its memory. The Edge lets at most BIG_BODIES such
    bodies (over BIG_BODY_BYTES) into the app at once; small ones are not held."""
    from engine._http_edge import BIG_BODIES, BIG_BODY_BYTES, Edge, Metrics
    from engine._tools import MAX_REQUEST_BYTES

    inside = peak = 0

    async def app(scope: dict, receive, send) -> None:
        nonlocal inside, peak
        while (await receive()).get("more_body"):
            pass
        inside += 1
        peak = max(peak, inside)
        await trio.sleep(0.05)  # the parse and the engine's work, while the objects live
        inside -= 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    edge = Edge(app, Metrics(), max_body=MAX_REQUEST_BYTES)

    async def post(size: int) -> None:
        chunks = [b"x" * (size // 4)] * 4
        scope = {"type": "http", "method": "POST", "path": "/v1/users/u/turns",
                 "raw_path": b"/v1/users/u/turns", "query_string": b"",
                 "headers": [(b"host", b"127.0.0.1"), (b"content-length", b"%d" % size)]}

        async def receive() -> dict:
            body = chunks.pop(0)
            await trio.sleep(0)
            return {"type": "http.request", "body": body, "more_body": bool(chunks)}

        async def send(message: dict) -> None:
            pass

        await edge(scope, receive, send)

    for size, most in ((BIG_BODY_BYTES + 4, BIG_BODIES), (BIG_BODY_BYTES // 2, 3 * BIG_BODIES)):
        inside = peak = 0
        async with trio.open_nursery() as requests:
            for _ in range(3 * BIG_BODIES):
                requests.start_soon(post, size)
        assert peak == most, (size, peak)


async def test_big_bodies_over_a_real_socket_are_all_answered(tmp_path) -> None:
    """More big bodies at once than BIG_BODIES, through Hypercorn: each waits its turn and
    is answered (here a 422 for a batch over the cap), and the server serves on."""
    from engine._http_edge import BIG_BODIES, BIG_BODY_BYTES

    one = {"session_id": "s1", "role": "user", "text": "x" * 2_000}
    body = json.dumps({"turns": [one] * (MAX_BATCH_TURNS + 1)})
    assert len(body) > BIG_BODY_BYTES
    statuses: list[int] = []
    async with trio.open_nursery() as nursery:
        url = await _serving(nursery, tmp_path / "store")
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:

            async def post() -> None:
                answer = await http.post("/v1/users/ana/turns", content=body)
                statuses.append(answer.status_code)

            with trio.fail_after(60):  # a hang guard
                async with trio.open_nursery() as clients:
                    for _ in range(3 * BIG_BODIES):
                        clients.start_soon(post)
            assert (await http.get("/healthz")).json() == {"status": "ok"}
        nursery.cancel_scope.cancel()
    assert statuses == [422] * (3 * BIG_BODIES)
