"""The HTTP face: routes, auth on every route, error mapping, probes, metrics, a real socket."""

from __future__ import annotations

import gc
import hashlib
import json
import socket
import warnings
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import msgspec
import pytest
import trio

from actors.base.records import Turn
from engine import Engine, EngineClosed
from engine._retrieval import Explain, Hit
from engine._http_wire import json_response, plain
from engine._server import STATUS_BY_ERROR, create_app, load_api_keys, serve
from engine.errors import EngineError, InvalidInput

from .conftest import open_engine

ANA_KEY, BO_KEY, ADMIN_KEY = "ana-secret", "bo-secret", "admin-secret"


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    hashed = hashlib.sha256(BO_KEY.encode()).hexdigest()
    path.write_text(f"# who may do what\n{ANA_KEY} ana\n\nsha256:{hashed} bo,carl\n"
                    f"{ADMIN_KEY} *\n")
    return path


@pytest.fixture
async def engine(store_path, clock) -> AsyncIterator[Engine]:
    async with open_engine(store_path, clock=clock) as mem:
        yield mem


def client(app, key: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1",
                             headers=headers)


async def test_turns_round_trip_with_201_for_durable_and_202_for_buffered(engine) -> None:
    """A buffered turn answers 202, a durable one 201, both with their ids; history lists them
    oldest first and honours limit."""
    async with client(create_app(engine)) as http:
        url = "/v1/users/ana/sessions/s1/turns"
        first = await http.post(url, json={"role": "user", "text": "I moved to Lisbon",
                                           "meta": {"channel": "web"}})
        assert first.status_code == 202 and first.json()["turn_id"]
        second = await http.post(url, json={"role": "assistant", "text": "Welcome!",
                                            "at": "2026-03-01T10:00:00Z", "durable": True})
        assert second.status_code == 201 and second.json()["seq"] == first.json()["seq"] + 1
        history = (await http.get(url)).json()
        assert [t["text"] for t in history] == ["I moved to Lisbon", "Welcome!"]
        assert history[0]["meta"] == {"channel": "web"}
        assert history[1]["at"] == "2026-03-01T10:00:00Z"
        assert [t["text"] for t in (await http.get(url, params={"limit": 1})).json()] == [
            "Welcome!"]
        form_labelled = await http.post(url, content=b'{"role": "user", "text": "curl -d"}',
                                        headers={"content-type":
                                                 "application/x-www-form-urlencoded"})
        assert form_labelled.status_code == 202  # curl -d labels JSON as a form: still JSON
        batch = await http.post("/v1/users/ana/turns", json={"durable": True, "turns": [
            {"session_id": "s2", "role": "user", "text": "one"},
            {"session_id": "s2", "role": "user", "text": "two"}]})
        assert batch.status_code == 201 and len(batch.json()["turns"]) == 2
        sessions = (await http.get("/v1/users/ana/sessions")).json()
        assert {s["session_id"] for s in sessions} == {"s1", "s2"}
        turn_id = first.json()["turn_id"]
        assert (await http.get(f"/v1/users/ana/turns/{turn_id}")).json()["text"] == (
            "I moved to Lisbon")


async def test_recall_and_seed_001_routes(engine) -> None:
    """recall returns the engine's Hit fields; retrieve_memory answers Markdown, /raw JSON,
    context_pre_retrieve Markdown of facts."""
    async with client(create_app(engine)) as http:
        await http.post("/v1/users/ana/sessions/s1/turns",
                        json={"role": "user", "text": "I live in Lisbon with my dog Pixel"})
        await engine.flush()
        hits = (await http.post("/v1/users/ana/recall",
                                json={"query": "dog Pixel", "limit": 3,
                                      "kinds": ["turn"], "roles": ["user"]})).json()["hits"]
        assert hits and set(hits[0]) >= {"id", "kind", "text", "score", "session_id", "at",
                                          "turn_ids", "via"}
        assert hits[0]["text"] == "I live in Lisbon with my dog Pixel"
        body = {"user_id": "ana", "query": "where do I live", "conversation_id": "s1"}
        markdown = await http.post("/v1/retrieve_memory", json=body)
        assert markdown.headers["content-type"].startswith("text/markdown")
        assert "Lisbon" in markdown.text
        raw = (await http.post("/v1/retrieve_memory/raw", json=body)).json()
        assert set(raw) >= {"semantic", "episodic"}
        by_meaning = {"user_id": "ana", "query": "my pet", "semantic_limit": 0}
        assert (await http.post("/v1/retrieve_memory/raw", json=by_meaning)).json()["episodic"]
        assert (await http.post("/v1/retrieve_memory/raw", json=by_meaning | {
            "legs": ["bm25"]})).json()["episodic"] == []
        assert "Pixel" not in (await http.post("/v1/retrieve_memory", json=by_meaning | {
            "legs": ["bm25"]})).text
        facts = await http.post("/v1/context_pre_retrieve", json=body)
        assert "Lisbon" in facts.text


async def test_notes_facts_links_review_entities_tools_and_forget(engine) -> None:
    """The rest of the surface answers through the engine: notes CRUD with 404s, facts,
    links, review, entities, the agent tools, and forgetting a user."""
    async with client(create_app(engine)) as http:
        note = (await http.post("/v1/users/ana/notes", json={"text": "likes jazz",
                                                              "tags": ["music"]})).json()
        url = f"/v1/users/ana/notes/{note['note_id']}"
        assert (await http.get(url)).json()["text"] == "likes jazz"
        assert (await http.put(url, json={"text": "likes bebop"})).json()["text"] == "likes bebop"
        listed = (await http.get("/v1/users/ana/notes")).json()
        assert [(n["note_id"], n["text"]) for n in listed] == [(note["note_id"], "likes bebop")]
        assert (await http.delete(url)).status_code == 200
        assert (await http.get("/v1/users/ana/notes")).json() == []
        assert (await http.get(url)).status_code == 404
        assert (await http.put(url, json={"text": "x"})).status_code == 404
        assert (await http.delete(url)).status_code == 404

        fact = await http.post("/v1/users/ana/facts", json={
            "category": "identity", "key": "location", "value": "Lisbon"})
        assert fact.status_code == 201 and fact.json()["value"] == "Lisbon"
        assert (await http.put("/v1/users/ana/facts/identity/location",
                               json={"value": "Porto"})).json()["value"] == "Porto"
        assert (await http.post("/v1/users/ana/facts/identity/location/confirm")
                ).json()["protected"] is True
        assert [f["value"] for f in (await http.get("/v1/users/ana/facts")).json()] == ["Porto"]
        history = (await http.get("/v1/users/ana/facts/identity/location/history")).json()
        assert [f["value"] for f in history] == ["Lisbon", "Porto"]
        assert (await http.delete("/v1/users/ana/facts/identity/location")).status_code == 200
        assert (await http.delete("/v1/users/ana/facts/identity/location")).status_code == 404

        # Since when a value is true, and the profile as the store knew it then.
        then = datetime(2026, 1, 1, tzinfo=timezone.utc)
        assert (await http.post("/v1/users/ana/facts", json={
            "category": "home", "key": "city", "value": "Braga", "valid_at": then.isoformat()})
                ).json()["valid_at"] == "2026-01-01T00:00:00Z"
        corrected = (await http.put("/v1/users/ana/facts/home/city", json={
            "value": "Faro", "valid_at": "2026-02-01T00:00:00Z"})).json()
        assert (corrected["value"], corrected["valid_at"]) == ("Faro", "2026-02-01T00:00:00Z")
        # as_of is the store's knowledge too: in January it had not been told either.
        before = await http.get("/v1/users/ana/facts", params={"as_of": "2026-01-15T00:00:00Z"})
        assert before.status_code == 200 and before.json() == []
        naive_as_of = await http.get("/v1/users/ana/facts", params={"as_of": "2026-01-15T00:00"})
        assert naive_as_of.status_code == 422 and "as_of" in naive_as_of.text
        naive = await http.put("/v1/users/ana/facts/home/city", json={
            "value": "Faro", "valid_at": "2026-02-01T00:00:00"})
        assert naive.status_code == 422 and "valid_at" in naive.text

        a = (await http.post("/v1/users/ana/sessions/s1/turns", json={
            "role": "user", "text": "Pixel is my dog", "durable": True})).json()["turn_id"]
        b = (await http.post("/v1/users/ana/sessions/s1/turns", json={
            "role": "user", "text": "We walk in Monsanto", "durable": True})).json()["turn_id"]
        assert (await http.post("/v1/users/ana/links", json={"from_id": a, "to_id": b})
                ).status_code == 201
        await engine.flush()
        linked = {"query": "Pixel dog", "limit": 1, "kinds": ["turn"], "link_depth": 1}
        via = [h["via"] for h in (await http.post("/v1/users/ana/recall", json=linked | {
            "link_types": ["relates_to"]})).json()["hits"]]
        assert via[0] != ["link"] and ["link"] in via  # the hit, then what it links to
        assert [h["via"] for h in (await http.post("/v1/users/ana/recall", json=linked | {
            "link_types": ["summarises"]})).json()["hits"]] == via[:1]
        # "Pixel is my dog" also states a fact, linked to the turn it came from.
        assert [l["to_id"] for l in (await http.get(f"/v1/users/ana/memories/{a}/links")).json()
                if l["type"] == "relates_to"] == [b]
        assert "stability" in (await http.post(f"/v1/users/ana/memories/{a}/review",
                                               json={"rating": "good"})).json()
        await engine.flush()
        assert (await http.get("/v1/users/ana/entities/pixel")).json()["entity"]["name"]
        assert (await http.get("/v1/users/ana/entities/nobody")).status_code == 404
        # An id the user does not have is a 404 naming it, from the engine's NotFound.
        for method, url, body, named in (
                ("POST", "/v1/users/ana/memories/t_nobody/review", {"rating": "good"},
                 "t_nobody"),
                ("POST", "/v1/users/ana/sessions/nowhere/close", None, "nowhere"),
                ("POST", "/v1/users/ana/links", {"from_id": a, "to_id": "t_nobody"},
                 "t_nobody"),
                ("PUT", "/v1/users/bo/notes/n_nobody", {"text": "x"}, "n_nobody"),
                ("POST", "/v1/tools/no_such_tool", {"user_id": "ana"}, "no_such_tool")):
            missing = await http.request(method, url, json=body)
            assert missing.status_code == 404, (url, missing.text)
            assert missing.json()["error"] == "NotFound" and named in missing.json()["message"]
        assert (await http.get("/v1/users/ana/episodes")).json() == []
        assert (await http.get("/v1/users/ana/stats")).json()["turns"] == 2
        tools = (await http.get("/v1/tools")).json()
        assert {t["function"]["name"] for t in tools} >= {"search_memory", "remember_fact"}
        found = await http.post("/v1/tools/search_memory",
                                json={"user_id": "ana", "query": "dog", "limit": 2})
        # The fact the turn stated ranks first and stands for it.
        assert found.json()["results"][0]["text"] == "Has a dog called Pixel"

        assert (await http.delete("/v1/users/ana")).json() == {"forgotten": "ana"}
        assert (await http.get("/v1/users/ana/sessions")).json() == []


async def test_bad_input_is_422_naming_the_field_and_never_a_traceback(engine) -> None:
    """Validation by the app and by the engine both answer 422 with the field; an unknown
    route is 404; a body over the limit is 413; all as JSON errors."""
    async with client(create_app(engine, max_body_bytes=10_000)) as http:
        url = "/v1/users/ana/sessions/s1/turns"
        bad_role = await http.post(url, json={"role": "bot", "text": "hi"})
        assert bad_role.status_code == 422
        assert bad_role.json()["field"] == "role" and bad_role.json()["error"] == "InvalidInput"
        naive = await http.post(url, json={"role": "user", "text": "hi",
                                           "at": "2026-03-01T09:00:00"})
        assert naive.status_code == 422 and naive.json()["field"] == "at"
        empty = await http.post(url, json={"role": "user", "text": ""})
        assert empty.status_code == 422 and empty.json()["field"] == "text"
        extra = await http.post(url, json={"role": "user", "text": "x", "colour": "red"})
        assert extra.status_code == 422 and extra.json()["field"] == "colour"
        tool = await http.post("/v1/tools/search_memory",
                               json={"user_id": "ana", "query": "x", "limit": 500})
        assert tool.status_code == 422 and tool.json()["field"] == "arguments.limit"
        assert (await http.get("/v1/nowhere")).json()["error"] == "NotFound"
        huge = await http.post(url, json={"role": "user", "text": "x" * 20_000})
        assert huge.status_code == 413 and huge.json()["error"] == "TooLarge"

        async def chunks():  # no Content-Length: the limit is counted as the body streams in
            yield b'{"role": "user", "text": "'
            for _ in range(30):
                yield b"x" * 1000
            yield b'"}'

        # The server stops reading, so the test transport's body generator is left
        # unexhausted: it is finalised here (at once, or by the collection if a reference cycle
        # holds it), where its ResourceWarning is expected, not wherever a later allocation
        # happens to trigger a collection.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            streamed = await http.post(url, content=chunks(),
                                       headers={"content-type": "application/json"})
            gc.collect()
        assert streamed.status_code == 413 and streamed.json()["error"] == "TooLarge"
        for response in (bad_role, naive, empty, extra, huge, streamed):
            assert "Traceback" not in response.text


async def test_engine_errors_map_by_class_so_new_ones_fit(engine, store_path) -> None:
    """Statuses come from the error's class hierarchy: a subclass of InvalidInput is 422, an
    error named StoreInUse (added elsewhere) 503, and a closed engine 503."""

    class StoreInUse(EngineError):
        pass

    class Oddly(InvalidInput):
        pass

    assert STATUS_BY_ERROR["StoreInUse"] == 503
    app = create_app(engine)

    @app.get("/raise/{which}")
    async def raiser(which: str) -> None:
        raise {"in-use": StoreInUse("the store is open in process 42"),
               "odd": Oddly("field_x", "expected y"),
               "bug": RuntimeError("secret internals")}[which]

    async with client(app) as http:
        in_use = await http.get("/raise/in-use")
        assert (in_use.status_code, in_use.json()["error"]) == (503, "StoreInUse")
        odd = await http.get("/raise/odd")
        assert (odd.status_code, odd.json()["field"]) == (422, "field_x")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                 base_url="http://127.0.0.1") as http:
        bug = await http.get("/raise/bug")
        assert bug.status_code == 500 and "secret" not in bug.text and "Traceback" not in bug.text

    async with open_engine(store_path.with_name("other")) as closing:
        app = create_app(closing)
    async with client(app) as http:
        closed = await http.get("/v1/users/ana/sessions")
        assert (closed.status_code, closed.json()["error"]) == (503, "EngineClosed")
        assert EngineClosed.__name__ in STATUS_BY_ERROR


ROUTES = [
    ("POST", "/v1/users/{u}/sessions/s/turns", {"role": "user", "text": "hi"}),
    ("GET", "/v1/users/{u}/sessions/s/turns", None),
    ("POST", "/v1/users/{u}/turns", {"turns": []}),
    ("GET", "/v1/users/{u}/turns/t", None),
    ("GET", "/v1/users/{u}/sessions", None),
    ("POST", "/v1/users/{u}/sessions/s/close", None),
    ("DELETE", "/v1/users/{u}/sessions/s", None),
    ("POST", "/v1/users/{u}/recall", {"query": "x"}),
    ("POST", "/v1/retrieve_memory", {"user_id": "{u}", "query": "x"}),
    ("POST", "/v1/retrieve_memory/raw", {"user_id": "{u}", "query": "x"}),
    ("POST", "/v1/context_pre_retrieve", {"user_id": "{u}", "query": "x"}),
    ("POST", "/v1/users/{u}/notes", {"text": "x"}),
    ("GET", "/v1/users/{u}/notes", None),
    ("GET", "/v1/users/{u}/notes/n", None),
    ("PUT", "/v1/users/{u}/notes/n", {"text": "x"}),
    ("DELETE", "/v1/users/{u}/notes/n", None),
    ("GET", "/v1/users/{u}/facts", None),
    ("POST", "/v1/users/{u}/facts", {"category": "c", "key": "k", "value": "v"}),
    ("PUT", "/v1/users/{u}/facts/c/k", {"value": "v"}),
    ("POST", "/v1/users/{u}/facts/c/k/confirm", None),
    ("DELETE", "/v1/users/{u}/facts/c/k", None),
    ("GET", "/v1/users/{u}/facts/c/k/history", None),
    ("GET", "/v1/users/{u}/episodes", None),
    ("GET", "/v1/users/{u}/entities/e", None),
    ("POST", "/v1/users/{u}/links", {"from_id": "a", "to_id": "b"}),
    ("GET", "/v1/users/{u}/memories/m/links", None),
    ("POST", "/v1/users/{u}/memories/m/review", {"rating": "good"}),
    ("GET", "/v1/users/{u}/stats", None),
    ("POST", "/v1/tools/memory_stats", {"user_id": "{u}"}),
    ("DELETE", "/v1/users/{u}/scopes?agent_id=bot", None),
    ("DELETE", "/v1/users/{u}", None),
]


def _fill(value, user: str):
    if isinstance(value, str):
        return value.replace("{u}", user)
    if isinstance(value, dict):
        return {k: _fill(v, user) for k, v in value.items()}
    return value


async def test_every_route_refuses_no_key_401_and_another_users_key_403(
        engine, keys_file) -> None:
    """Every user route: 401 without a key or with an unknown one, 403 with a key for other
    users, and through with the user's own key, a hashed key, or the admin key."""
    app = create_app(engine, load_api_keys(keys_file))
    async with client(app) as anon, client(app, "wrong") as stranger, \
            client(app, ANA_KEY) as ana, client(app, BO_KEY) as bo, \
            client(app, ADMIN_KEY) as admin:
        assert (await anon.get("/healthz")).status_code == 200
        for method, path, body in ROUTES:
            for who, user, expected in ((anon, "ana", {401}), (stranger, "ana", {401}),
                                        (bo, "ana", {403}), (ana, "bo", {403}),
                                        (ana, "ana", {200, 201, 202, 404, 422}),
                                        (bo, "carl", {200, 201, 202, 404, 422}),
                                        (admin, "dee", {200, 201, 202, 404, 422})):
                response = await who.request(method, _fill(path, user), json=_fill(body, user))
                assert response.status_code in expected, (method, path, user, response.text)
        assert (await ana.get("/v1/stats")).status_code == 403
        assert (await ana.post("/v1/snapshot", json={"dest": "/tmp/x"})).status_code == 403
        assert (await anon.get("/v1/tools")).status_code == 401
        assert (await ana.get("/v1/tools")).status_code == 200
        assert (await admin.get("/v1/stats")).json()["schema_version"] >= 1
        assert (await anon.get("/metrics")).status_code == 401
        assert (await ana.get("/metrics")).status_code == 200


def test_an_api_keys_file_is_checked_line_by_line(tmp_path) -> None:
    """A malformed line is refused with its file and line number."""
    bad = tmp_path / "keys"
    bad.write_text("k1 ana\nk2\n")
    with pytest.raises(InvalidInput, match=r"keys:2, found 1 fields"):
        load_api_keys(bad)
    bad.write_text("sha256:abc ana\n")
    with pytest.raises(InvalidInput, match=r"64 hex digits at .*keys:1"):
        load_api_keys(bad)
    bad.write_text("# nothing\n")
    with pytest.raises(InvalidInput, match=r"at least one key"):
        load_api_keys(bad)


async def test_metrics_show_how_far_vectors_lag_in_seconds(store_path, mock_clock) -> None:
    """With nothing embedding, /metrics shows the records behind and how long ago the oldest of
    them was committed, on the engine's trio clock."""
    mock_clock.autojump_threshold = 0.05  # jump only when idle: waits on threads stay real
    async with open_engine(store_path, config={"background_embedding": False}) as mem:
        async with client(create_app(mem)) as http:
            before = trio.current_time()
            await mem.add_turn("ana", "s1", "user", "not embedded yet", durable=True)
            acked = trio.current_time()
            await trio.sleep(30)
            asked = trio.current_time()
            text = (await http.get("/metrics")).text
            answered = trio.current_time()
    lag = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
           if line.startswith(("engram_embedding_lag ", "engram_vector_lag_seconds "))}
    assert lag["engram_embedding_lag"] == 1.0
    # The turn committed between before and acked, and was measured between asked and
    # answered. (A wait on a thread longer than the threshold lets the clock jump to the
    # next deadline, an hour's maintenance among them: the bounds are the clock's own.)
    assert 30 <= asked - acked <= lag["engram_vector_lag_seconds"] <= answered - before


async def test_probes_metrics_and_openapi(engine) -> None:
    """readyz is 503 while an index lags and 200 once caught up; metrics count requests by
    route template (no user ids in labels); the OpenAPI document lists the issue's routes."""
    async with client(create_app(engine)) as http:
        await http.post("/v1/users/ana/sessions/s1/turns", json={"role": "user", "text": "hi"})
        assert (await http.get("/healthz")).json() == {"status": "ok"}
        await engine.flush()
        ready = await http.get("/readyz")
        assert ready.status_code == 200 and ready.json()["lag"] == {"embedding": 0,
                                                                      "fulltext": 0}
        text = (await http.get("/metrics")).text
        assert ('engram_http_requests_total{method="POST",'
                'route="/v1/users/{user_id}/sessions/{session_id}/turns",status="202"} 1.0'
                in text)
        assert "engram_http_request_seconds_bucket" in text and "engram_turns 1.0" in text
        assert "engram_vector_lag_seconds 0.0" in text
        assert "ana" not in text
        spec = (await http.get("/openapi.json")).json()
        for path in ("/v1/users/{user_id}/sessions/{session_id}/turns",
                     "/v1/users/{user_id}/recall", "/v1/retrieve_memory",
                     "/v1/retrieve_memory/raw", "/v1/context_pre_retrieve",
                     "/v1/users/{user_id}", "/healthz", "/metrics"):
            assert path in spec["paths"], path
        body = spec["components"]["schemas"]["TurnIn"]["properties"]["text"]
        assert body["examples"]
        recall = spec["paths"]["/v1/users/{user_id}/recall"]["post"]["responses"]
        assert recall["200"]["content"]["application/json"]["example"]["hits"][0]["kind"]
        assert recall["403"]["content"]["application/json"]["example"]["error"] == "Forbidden"


async def test_readyz_is_503_while_the_indexes_lag(store_path) -> None:
    """With background embedding off, committed turns stay unembedded: not ready."""
    async with open_engine(store_path, config={"background_embedding": False}) as mem:
        await mem.add_turn("ana", "s1", "user", "hello", durable=True)
        async with client(create_app(mem)) as http:
            lagging = await http.get("/readyz")
        assert lagging.status_code == 503 and lagging.json()["lag"]["embedding"] >= 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_serve_answers_on_a_real_loopback_socket(tmp_path, keys_file) -> None:
    """`serve` runs Hypercorn's trio worker on the engine's loop: a real TCP client ingests and
    recalls with a key; without a keys file a public host is replaced by 127.0.0.1."""
    said: list[str] = []
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(lambda task_status: serve(
            tmp_path / "store", port=_free_port(), api_keys=keys_file, say=said.append,
            handle_signals=False, config={"background_embedding": False},
            task_status=task_status))
        base = binds[0]
        # httpx's 5 s default is shorter than a durable commit can take on a loaded machine.
        async with httpx.AsyncClient(base_url=base, timeout=60, headers={
                "Authorization": f"Bearer {ANA_KEY}"}) as http:
            added = await http.post("/v1/users/ana/sessions/s1/turns",
                                    json={"role": "user", "text": "over the wire",
                                          "durable": True})
            assert added.status_code == 201
            hits = (await http.post("/v1/users/ana/recall", json={"query": "wire"})).json()
            assert hits["hits"][0]["text"] == "over the wire"
            assert (await http.get("/v1/users/bo/sessions")).status_code == 403
            # Hypercorn decodes the path before routing: an id's %2F must survive that.
            admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
            url = f"/v1/users/{seg('team/ana')}/sessions/{seg('a/b%')}/turns"
            assert (await http.post(url, headers=admin, json={
                "role": "user", "text": "slashed", "durable": True})).status_code == 201
            assert [(t["user_id"], t["session_id"]) for t in
                    (await http.get(url, headers=admin)).json()] == [("team/ana", "a/b%")]
        nursery.cancel_scope.cancel()
    assert "api keys" in said[-1]

    said.clear()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(lambda task_status: serve(
            tmp_path / "store2", host="0.0.0.0", port=_free_port(), say=said.append,
            handle_signals=False, config={"background_embedding": False},
            task_status=task_status))
        assert binds[0].startswith("http://127.0.0.1:")
        nursery.cancel_scope.cancel()
    assert "binding to 127.0.0.1 instead of 0.0.0.0" in said[0]


class Page(msgspec.Struct):
    turns: list[Turn]
    note: str = ""


class Loose(msgspec.Struct):
    anything: Any


def test_json_bodies_name_fields_at_every_depth_and_pass_plain_structs_as_they_are() -> None:
    """A stored record (an array_like Struct) comes out by field name even nested in an answer
    msgspec could otherwise encode itself; an answer with none reachable is passed through."""
    class Local(msgspec.Struct):  # annotations msgspec cannot resolve: walked by hand
        turn: Turn

    at = datetime(2026, 3, 1, 9, tzinfo=timezone.utc)
    turn = Turn(3, "t_1", "ana", "s1", 0, "user", "hi", at, None)
    hit = Hit(id="t_1", kind="turn", text="hi", score=0.5, session_id="s1", at=at,
              turn_ids=("t_1",), explain=Explain(ranks={"bm25": 1}, fused=0.2))
    assert json.loads(json_response(Page([turn])).body)["turns"][0]["text"] == "hi"
    assert json.loads(json_response(Loose(turn)).body)["anything"]["session_id"] == "s1"
    assert json.loads(json_response(Local(turn)).body)["turn"]["seq"] == 0
    assert plain(hit) is hit
    assert json.loads(json_response([hit]).body)[0]["explain"]["ranks"] == {"bm25": 1}


def seg(value: str) -> str:
    """An id as one path segment, as the README tells clients to write it."""
    return quote(value, safe="")


async def test_ids_holding_slashes_and_percents_are_one_encoded_path_segment(
        engine, tmp_path) -> None:
    """A user, session, note, fact key or entity whose id holds '/' or '%' is reached by
    percent-encoding it as one segment (%2F, %25): every kind of /v1/users route answers for
    that id and no other, a key for "team/alice" reaches only her, and the same path unencoded
    is another route or none."""
    keys = tmp_path / "keys"
    keys.write_text("alice-key team/alice\n")
    user, session = "team/alice", "chat/1%"
    base = f"/v1/users/{seg(user)}"
    async with client(create_app(engine)) as http:
        url = f"{base}/sessions/{seg(session)}/turns"
        added = await http.post(url, json={"role": "user", "text": "My dog Pixel loves AC/DC",
                                           "durable": True})
        assert added.status_code == 201, added.text
        turn_id = added.json()["turn_id"]
        assert [t["user_id"] for t in (await http.get(url)).json()] == [user]
        assert [t["session_id"] for t in (await http.get(url)).json()] == [session]
        assert (await http.get(f"{base}/turns/{seg(turn_id)}")).json()["text"].startswith("My")
        assert [s["session_id"] for s in (await http.get(f"{base}/sessions")).json()] == [
            session]
        hits = (await http.post(f"{base}/recall", json={"query": "Pixel"})).json()["hits"]
        assert hits and all(h["session_id"] == session for h in hits if h["kind"] == "turn")
        assert (await http.get("/v1/users/team/sessions")).json() == []  # "team" is another

        note = await http.post(f"{base}/notes", json={"text": "likes jazz", "note_id": "n/1%"})
        assert note.status_code == 201 and note.json()["note_id"] == "n/1%"
        note_url = f"{base}/notes/{seg('n/1%')}"
        assert (await http.get(note_url)).json()["text"] == "likes jazz"
        assert (await http.put(note_url, json={"text": "likes bebop"})).json()["user_id"] == user
        assert (await http.post(f"{base}/links", json={"from_id": "n/1%", "to_id": turn_id})
                ).status_code == 201
        assert [l["to_id"] for l in (await http.get(f"{base}/memories/{seg('n/1%')}/links")
                                     ).json()] == [turn_id]
        assert "stability" in (await http.post(f"{base}/memories/{seg(turn_id)}/review",
                                               json={"rating": "good"})).json()
        assert (await http.delete(note_url)).json() == {"deleted": "n/1%"}

        fact_url = f"{base}/facts/{seg('music/live')}/{seg('band/fav')}"
        assert (await http.post(f"{base}/facts", json={
            "category": "music/live", "key": "band/fav", "value": "AC/DC"})).status_code == 201
        assert (await http.put(fact_url, json={"value": "Queen"})).json()["value"] == "Queen"
        assert (await http.post(f"{fact_url}/confirm")).json()["protected"] is True
        assert [f["value"] for f in (await http.get(f"{fact_url}/history")).json()] == [
            "AC/DC", "Queen"]
        assert (await http.delete(fact_url)).json() == {"forgotten": "music/live/band/fav"}

        await engine.flush()
        assert (await http.get(f"{base}/episodes")).json() == []
        assert (await http.get(f"{base}/stats")).json()["turns"] == 1
        assert (await http.post(f"{base}/sessions/{seg(session)}/close")).status_code == 200
        assert (await http.delete(f"{base}/sessions/{seg(session)}")).json() == {
            "forgotten": session}
        await http.post(url, json={"role": "user", "text": "again", "durable": True})
        # Unencoded, the id's slash splits it: /v1/users/team/alice is no route at all.
        assert (await http.delete(f"/v1/users/{user}")).status_code == 404
        assert (await http.get(f"{base}/sessions")).json() != []
        assert (await http.delete(base)).json() == {"forgotten": user}
        assert (await http.get(f"{base}/sessions")).json() == []

    async with client(create_app(engine, load_api_keys(keys)), "alice-key") as alice:
        assert (await alice.get(f"{base}/sessions")).status_code == 200
        assert (await alice.get("/v1/users/team/sessions")).status_code == 403
        assert (await alice.get(f"/v1/users/{seg('team/alice/x')}/sessions")).status_code == 403


async def test_every_json_answer_matches_the_schema_the_openapi_document_declares(
        engine, tmp_path) -> None:
    """Each /v1 route that answers JSON declares its success body's schema (the engine's
    records, by field name as they are sent), and real answers validate against it."""
    import jsonschema

    async with client(create_app(engine)) as http:
        spec = (await http.get("/openapi.json")).json()
        markdown = {("/v1/retrieve_memory", "post"), ("/v1/context_pre_retrieve", "post")}
        for path, operations in spec["paths"].items():
            for method, operation in operations.items():
                if not path.startswith("/v1/") or (path, method) in markdown:
                    continue
                ok = [s for s in operation["responses"] if s.startswith("2")]
                assert ok, (method, path)
                for status in ok:
                    declared = operation["responses"][status]["content"]["application/json"]
                    assert declared.get("schema"), (method, path, status)

        def check(method: str, template: str, answer: httpx.Response) -> Any:
            assert answer.status_code < 300, (template, answer.text)
            declared = spec["paths"][template][method]["responses"][str(answer.status_code)]
            schema = declared["content"]["application/json"]["schema"]
            jsonschema.validate(answer.json(), {**schema, "components": spec["components"]})
            return answer.json()

        turns = "/v1/users/{user_id}/sessions/{session_id}/turns"
        a = check("post", turns, await http.post("/v1/users/ana/sessions/s1/turns", json={
            "role": "user", "text": "Pixel is my dog", "durable": True}))["turn_id"]
        check("post", turns, await http.post("/v1/users/ana/sessions/s1/turns", json={
            "role": "assistant", "text": "We walk in Monsanto", "meta": {"mood": "calm"}}))
        check("post", "/v1/users/{user_id}/turns", await http.post(
            "/v1/users/ana/turns", json={"turns": [{"session_id": "s2", "role": "user",
                                                    "text": "I live in Lisbon"}]}))
        await engine.flush()
        b = check("get", turns, await http.get("/v1/users/ana/sessions/s1/turns"))[1]["turn_id"]
        check("get", "/v1/users/{user_id}/turns/{turn_id}", await http.get(
            f"/v1/users/ana/turns/{a}"))
        check("get", "/v1/users/{user_id}/sessions", await http.get("/v1/users/ana/sessions"))
        check("post", "/v1/users/{user_id}/recall", await http.post(
            "/v1/users/ana/recall", json={"query": "dog", "limit": 3}))
        check("post", "/v1/retrieve_memory/raw", await http.post(
            "/v1/retrieve_memory/raw", json={"user_id": "ana", "query": "where do I live"}))
        note = check("post", "/v1/users/{user_id}/notes", await http.post(
            "/v1/users/ana/notes", json={"text": "likes jazz", "tags": ["music"]}))
        one = "/v1/users/{user_id}/notes/{note_id}"
        check("get", one, await http.get(f"/v1/users/ana/notes/{note['note_id']}"))
        check("put", one, await http.put(f"/v1/users/ana/notes/{note['note_id']}",
                                         json={"text": "likes bebop"}))
        check("get", "/v1/users/{user_id}/notes", await http.get("/v1/users/ana/notes"))
        check("delete", one, await http.delete(f"/v1/users/ana/notes/{note['note_id']}"))
        facts = "/v1/users/{user_id}/facts"
        check("post", facts, await http.post("/v1/users/ana/facts", json={
            "category": "pets", "key": "dog", "value": "Pixel"}))
        key = "/v1/users/{user_id}/facts/{category}/{key}"
        check("put", key, await http.put("/v1/users/ana/facts/pets/dog", json={"value": "Rex"}))
        check("post", key + "/confirm", await http.post("/v1/users/ana/facts/pets/dog/confirm"))
        check("get", facts, await http.get("/v1/users/ana/facts"))
        check("get", key + "/history", await http.get("/v1/users/ana/facts/pets/dog/history"))
        check("delete", key, await http.delete("/v1/users/ana/facts/pets/dog"))
        check("post", "/v1/users/{user_id}/links", await http.post(
            "/v1/users/ana/links", json={"from_id": a, "to_id": b}))
        check("get", "/v1/users/{user_id}/memories/{memory_id}/links", await http.get(
            f"/v1/users/ana/memories/{a}/links"))
        check("post", "/v1/users/{user_id}/memories/{memory_id}/review", await http.post(
            f"/v1/users/ana/memories/{a}/review", json={"rating": "good"}))
        check("post", "/v1/users/{user_id}/sessions/{session_id}/close", await http.post(
            "/v1/users/ana/sessions/s1/close"))
        await engine.flush()
        check("get", "/v1/users/{user_id}/episodes", await http.get("/v1/users/ana/episodes"))
        check("get", "/v1/users/{user_id}/entities/{name}", await http.get(
            "/v1/users/ana/entities/pixel"))
        check("get", "/v1/users/{user_id}/stats", await http.get("/v1/users/ana/stats"))
        check("get", "/v1/tools", await http.get("/v1/tools"))
        check("post", "/v1/tools/{name}", await http.post(
            "/v1/tools/search_memory", json={"user_id": "ana", "query": "dog"}))
        check("get", "/v1/stats", await http.get("/v1/stats"))
        check("post", "/v1/snapshot", await http.post("/v1/snapshot", json={
            "dest": str(tmp_path / "snap")}))
        check("delete", "/v1/users/{user_id}/scopes", await http.delete(
            "/v1/users/ana/scopes", params={"agent_id": "bot"}))
        check("delete", "/v1/users/{user_id}/sessions/{session_id}", await http.delete(
            "/v1/users/ana/sessions/s2"))
        check("delete", "/v1/users/{user_id}", await http.delete("/v1/users/ana"))
