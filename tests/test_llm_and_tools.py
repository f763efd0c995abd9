"""The optional LLM (against a fake OpenAI-compatible server on loopback) and the agent tools."""

from __future__ import annotations

import json
from functools import partial

import pytest
import trio

from engine import TOOLS, InvalidInput, LLMFailed, OpenAICompatibleLLM

from .conftest import open_engine


async def _fake_openai(replies: list[dict], seen: list[dict], stream: trio.SocketStream) -> None:
    """One HTTP/1.1 exchange: read a chat completion request, answer with the next reply."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive_some(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += await stream.receive_some(65536)
    request = json.loads(body)
    seen.append({"path": head.split(b" ")[1].decode(), "auth": b"Bearer k3y" in head, **request})
    status, payload, *retry_after = replies.pop(0) if replies else (200, {"choices": []})
    out = json.dumps(payload).encode()
    extra = b"".join(b"\r\nRetry-After: " + v.encode() for v in retry_after)
    await stream.send_all(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d"
                          b"\r\nConnection: close%s\r\n\r\n" % (status, len(out), extra) + out)
    await stream.aclose()


async def _server(nursery: trio.Nursery, replies: list, seen: list) -> str:
    listeners = await nursery.start(partial(trio.serve_tcp, partial(_fake_openai, replies, seen),
                                            0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def _chat(content: str) -> tuple[int, dict]:
    return 200, {"choices": [{"message": {"role": "assistant", "content": content}}]}


async def test_the_adapter_speaks_the_chat_completions_protocol(nursery) -> None:
    """POST /v1/chat/completions with the model, both messages and the key; errors are
    LLMFailed with what the server said."""
    seen: list[dict] = []
    url = await _server(nursery, [_chat("hello"), (503, {"error": "overloaded"}),
                                  (200, {"nope": 1})], seen)
    llm = OpenAICompatibleLLM(url, "tiny-model", api_key="k3y", timeout=5, retries=0)
    assert await llm.complete("be brief", "hi") == "hello"
    assert seen[0]["path"] == "/v1/chat/completions" and seen[0]["auth"]
    assert seen[0]["model"] == "tiny-model"
    assert [m["role"] for m in seen[0]["messages"]] == ["system", "user"]
    with pytest.raises(LLMFailed, match=r"answered HTTP 503: .*overloaded"):
        await llm.complete("be brief", "hi")
    with pytest.raises(LLMFailed, match=r"expected choices\[0\].message.content"):
        await llm.complete("be brief", "hi")


async def test_the_adapter_retries_what_may_pass_and_not_what_cannot(nursery) -> None:
    """A 503, a 429 (waiting what its Retry-After asks) and a timeout are tried again after a
    backoff; a 400 fails at once; when the retries run out, LLMFailed says what the last
    attempt met and how many were made."""
    seen: list[dict] = []
    url = await _server(nursery, [(503, {"error": "busy"}), (429, {"error": "slow"}, "0.2"),
                                  _chat("ok"), (400, {"error": "no such model"}),
                                  (503, {"try": 1}), (502, {"try": 2}), (503, {"try": 3})],
                        seen)
    llm = OpenAICompatibleLLM(url, "m", timeout=5, retries=2, backoff=0.01)
    start = trio.current_time()
    assert await llm.complete("s", "p") == "ok" and len(seen) == 3
    assert trio.current_time() - start >= 0.2  # the 429's Retry-After, not the backoff
    with pytest.raises(LLMFailed, match=r"HTTP 400: .*no such model"):
        await llm.complete("s", "p")
    assert len(seen) == 4
    with pytest.raises(LLMFailed, match=r"HTTP 503: .*\"try\": 3.*\(3 attempts\)"):
        await llm.complete("s", "p")
    assert len(seen) == 7

    accepted: list[int] = []

    async def silent(stream: trio.SocketStream) -> None:  # takes the request, never answers
        accepted.append(1)
        await trio.sleep_forever()

    listeners = await nursery.start(partial(trio.serve_tcp, silent, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    slow = OpenAICompatibleLLM(f"http://127.0.0.1:{port}/v1", "m", timeout=0.2, retries=1,
                               backoff=0.01)
    with pytest.raises(LLMFailed, match=r"ReadTimeout.*\(2 attempts\)"):
        await slow.complete("s", "p")
    assert len(accepted) == 2


async def test_an_llm_summarises_episodes_and_extracts_facts(store_path, nursery) -> None:
    """With an LLM configured, episodes take its title and summary and facts its extraction;
    a reply that does not fit the schema falls back to the offline default."""
    summary = {"title": "Planning the Porto trip", "summary": "Ana booked a train to Porto.",
               "keywords": ["porto", "train"]}
    facts = {"facts": [{"category": "identity", "key": "hometown", "value": "Braga",
                        "fact": "Grew up in Braga", "confidence": 0.9, "importance": 0.7}]}
    seen: list[dict] = []
    replies = [_chat(json.dumps(facts)), _chat("not json at all"),
               _chat("```json\n" + json.dumps(summary) + "\n```")]
    url = await _server(nursery, replies, seen)
    async with open_engine(store_path, llm=OpenAICompatibleLLM(url, "m")) as mem:
        await mem.add_turn("ana", "s", "user", "I grew up near the sea, in the north.")
        await mem.flush()
        await mem.add_turn("ana", "s", "user", "I live in Lisbon now.")  # LLM fails: rules
        await mem.flush()
        assert await mem.close_session("ana", "s")
        (episode,) = await mem.episodes("ana")
        profile = {(f.key, f.value, f.origin) for f in await mem.profile("ana")}
    assert profile == {("hometown", "Braga", "llm"), ("location", "Lisbon", "rules")}
    assert (episode.title, episode.summary, episode.keywords) == (
        "Planning the Porto trip", "Ana booked a train to Porto.", ("porto", "train"))
    assert "extract" in seen[0]["messages"][0]["content"]
    assert seen[2]["messages"][1]["content"].startswith("user: I grew up")


async def test_a_non_llm_object_is_refused(store_path) -> None:
    with pytest.raises(InvalidInput, match=r"llm: expected an object with an async "
                                           r"complete\(system, prompt\) method, found str"):
        async with open_engine(store_path, llm="gpt"):
            pass


def test_tools_are_json_schema_function_definitions() -> None:
    """Seed 004's six tools first, then recall as Markdown and notes, each an OpenAI-style
    function with an object schema."""
    names = [t["function"]["name"] for t in TOOLS]
    assert names == ["search_memory", "remember_fact", "correct_fact", "confirm_fact",
                     "memory_stats", "get_entity_info", "retrieve_memory", "store_note",
                     "delete_note", "list_notes"]
    for tool in TOOLS:
        params = tool["function"]["parameters"]
        assert tool["type"] == "function" and params["type"] == "object"
        assert set(params["required"]) <= set(params["properties"])
        assert "user_id" in params["required"]
    json.dumps(TOOLS)


async def test_call_tool_runs_each_tool(mem) -> None:
    """A model's tool calls, arguments as JSON text or a dict, end to end."""
    await mem.add_turn("ana", "s", "user", "Maya Lindqvist is coming to Lisbon on Friday.")
    out = await mem.call_tool("remember_fact", json.dumps({
        "user_id": "ana", "category": "identity", "key": "location", "value": "Lisbon",
        "text": "Lives in Lisbon"}))
    assert out["fact"]["value"] == "Lisbon"
    out = await mem.call_tool("correct_fact", {"user_id": "ana", "category": "identity",
                                               "key": "location", "value": "Porto"})
    assert out["fact"]["value"] == "Porto" and out["fact"]["confidence"] == 1.0
    out = await mem.call_tool("correct_fact", {"user_id": "ana", "category": "identity",
                                               "key": "location", "value": "Faro",
                                               "valid_at": "2026-01-15T09:00:00Z"})
    assert out["fact"]["valid_at"] == "2026-01-15T09:00:00Z"
    out = await mem.call_tool("confirm_fact", {"user_id": "ana", "category": "identity",
                                               "key": "location"})
    assert out["fact"]["protected"] is True
    await mem.flush()
    found = await mem.call_tool("search_memory", {"user_id": "ana", "query": "Maya Friday"})
    assert found["results"][0]["text"].startswith("Maya Lindqvist is coming")
    stats = await mem.call_tool("memory_stats", {"user_id": "ana"})
    assert (stats["turns"], stats["facts"]) == (1, 1) and stats["entities"] >= 2
    info = await mem.call_tool("get_entity_info", {"user_id": "ana", "name": "maya"})
    assert info["entity"]["name"] == "Maya Lindqvist" and len(info["memories"]) == 1


@pytest.mark.parametrize(("name", "args", "message"), [
    ("delete_everything", {}, r"name: expected one of search_memory, .*found 'delete_everything'"),
    ("search_memory", {"user_id": "ana"}, r"arguments.query: expected it for tool"),
    ("search_memory", {"user_id": "ana", "query": 3}, r"arguments.query: expected a string, "
                                                      r"found int"),
    ("memory_stats", {"user_id": "ana", "x": 1}, r"arguments.x: expected one of user_id"),
    ("memory_stats", "{nope", r"arguments: expected a JSON object"),
])
async def test_call_tool_refuses_bad_calls(mem, name, args, message) -> None:
    """Unknown tools and arguments outside the schema are refused before anything runs."""
    with pytest.raises(InvalidInput, match=message):
        await mem.call_tool(name, args)


async def test_note_and_retrieve_tools(mem) -> None:
    """store_note, list_notes, retrieve_memory and delete_note run through call_tool like
    seed 004's."""
    note = (await mem.call_tool("store_note", {"user_id": "ana", "text": "Allergic to peanuts",
                                               "tags": ["health"]}))["note"]
    assert list(note["tags"]) == ["health"]
    await mem.call_tool("remember_fact", {"user_id": "ana", "category": "constraint",
                                          "key": "allergy:peanuts", "value": "peanuts",
                                          "text": "Allergic to peanuts"})
    await mem.flush()
    markdown = (await mem.call_tool("retrieve_memory", {"user_id": "ana",
                                                        "query": "peanuts allergy"}))["markdown"]
    assert "peanuts" in markdown
    listed = (await mem.call_tool("list_notes", {"user_id": "ana"}))["notes"]
    assert [(n["note_id"], n["text"]) for n in listed] == [(note["note_id"],
                                                            "Allergic to peanuts")]
    assert await mem.call_tool("delete_note", {"user_id": "ana", "note_id": note["note_id"]}) == {
        "deleted": True}
    assert (await mem.call_tool("list_notes", {"user_id": "ana"}))["notes"] == []


@pytest.mark.parametrize(("args", "message"), [
    ({"user_id": "ana", "query": "x", "limit": 51},
     r"arguments.limit: expected maximum 50, found 51"),
    ({"user_id": "ana", "query": "x", "limit": 0}, r"arguments.limit: expected minimum 1"),
    ({"user_id": "ana", "query": "x", "limit": True}, r"arguments.limit: expected an integer, found bool"),
    ({"user_id": "ana", "query": "x", "kinds": ["turn", "secret"]},
     r"arguments.kinds.1: expected enum \['turn', 'episode', 'fact', 'note'\], found 'secret'"),
    # The schema tells a model what recall refuses: no kinds at all is not "every kind".
    ({"user_id": "ana", "query": "x", "kinds": []}, r"arguments.kinds: expected minItems 1"),
])
async def test_call_tool_enforces_every_schema_constraint(mem, args, message) -> None:
    """Bounds and enums in a tool's JSON schema are enforced, not only its types."""
    with pytest.raises(InvalidInput, match=message):
        await mem.call_tool("search_memory", args)


async def test_a_tool_error_never_echoes_a_huge_argument_whole(mem) -> None:
    """An unknown tool name, an unknown argument's name and a bad as_of came back whole in
    the error (100 KB in, 100 KB of error back into a model's context); each is cut."""
    from engine import NotFound

    huge = "x" * 100_000
    with pytest.raises(NotFound) as unknown:
        await mem.call_tool(huge, {})
    with pytest.raises(InvalidInput) as extra:
        await mem.call_tool("search_memory", {"user_id": "ana", "query": "x", huge: 1})
    with pytest.raises(InvalidInput) as as_of:
        await mem.call_tool("search_memory", {"user_id": "ana", "query": "x", "as_of": huge})
    for caught in (unknown, extra, as_of):
        assert len(str(caught.value)) < 500, str(caught.value)[:200]


@pytest.mark.parametrize("value", ["2026-01-15T09:00:00", "9999-12-31T23:59:59+14:00",
                                   "2026-13-01T00:00:00Z"])
async def test_a_tool_names_a_bad_as_of_as_its_argument(mem, value) -> None:
    """A time without its zone, or out of the engine's range, was named ``as_of`` (the
    engine's own parameter) while an unparsable one was ``arguments.as_of``: a model, or a
    client over HTTP or MCP, sends ``arguments`` and needs one name for the one field."""
    with pytest.raises(InvalidInput) as info:
        await mem.call_tool("search_memory", {"user_id": "ana", "query": "x", "as_of": value})
    assert info.value.field == "arguments.as_of", (info.value.field, str(info.value))


async def test_a_tool_argument_nested_thousands_deep_is_refused(mem) -> None:
    """An in-process call_tool with a where nested 50,000 deep raised RecursionError inside
    the schema check (over HTTP and MCP the JSON parser stops it first)."""
    nested: list = []
    for _ in range(50_000):
        nested = [nested]
    with pytest.raises(InvalidInput) as info:
        await mem.call_tool("search_memory", {"user_id": "ana", "query": "x", "where": nested})
    assert info.value.field == "arguments.where" and len(str(info.value)) < 300
    # The same given as JSON text: the decoder's own recursion limit, as the engine's error.
    for text in ("[" * 5_000 + "]" * 5_000,
                 '{"user_id": "ana", "query": "x", "where": ' + '{"a": ' * 5_000 + "1"
                 + "}" * 5_000 + "}"):
        with pytest.raises(InvalidInput) as info:
            await mem.call_tool("search_memory", text)
        assert info.value.field == "arguments" and "nested" in str(info.value)
