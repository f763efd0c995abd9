"""The MCP face driven the way careless hosts and models drive it: odd numbers, unknown
arguments, lines the SDK cannot read, a byte order mark, a client that stops reading."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import trio
from mcp import Client

from engine._mcp import DRAIN_SECONDS, create_server

from .conftest import raw_databases

# Three process starts (each loads the real model) and a few calls; the guard is for hangs.
pytestmark = pytest.mark.timeout(90)

_INITIALIZE = {"jsonrpc": "2.0", "id": 0, "method": "initialize",
               "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                          "clientInfo": {"name": "hostile", "version": "1"}}}


class _Wire:
    """A bare JSON-RPC client over a real `engram-trio mcp` process: it can send lines that
    the SDK's client would never write."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self._buffer = b""

    async def send(self, message: dict | str) -> None:
        line = message if isinstance(message, str) else json.dumps(message)
        await self.process.stdin.send_all(line.encode() + b"\n")

    async def receive(self) -> dict:
        with trio.fail_after(30):  # an answer the server dropped would wait for ever
            while b"\n" not in self._buffer:
                chunk = await self.process.stdout.receive_some(1 << 16)
                assert chunk, "the server closed stdout"
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    async def call(self, id_: int | str, name: str, arguments: dict | str) -> dict:
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        await self.send('{"jsonrpc": "2.0", "id": %s, "method": "tools/call", "params": '
                        '{"name": %s, "arguments": %s}}' % (json.dumps(id_), json.dumps(name),
                                                             arguments))
        answer = await self.receive()
        assert answer["id"] == id_
        return answer


async def _open_wire(nursery: trio.Nursery, store, first: str = "") -> _Wire:
    process = await nursery.start(lambda task_status: trio.run_process(
        [sys.executable, "-m", "engine", "mcp", str(store)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=False, task_status=task_status))
    wire = _Wire(process)
    await wire.send(first + json.dumps(_INITIALIZE))
    assert (await wire.receive())["id"] == 0
    await wire.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
    return wire


async def _exit_code(wire: _Wire) -> tuple[int, str]:
    await wire.process.stdin.aclose()
    with trio.fail_after(60):
        code = await wire.process.wait()
    return code, (await wire.process.stderr.receive_some(1 << 20) or b"").decode()


async def test_a_request_the_sdk_cannot_read_is_answered_not_dropped(tmp_path, nursery) -> None:
    """A lone surrogate (a model's emoji cut in half, as a JavaScript host escapes it), JSON
    nested deeper than the SDK's parser goes, or a wrong envelope: the SDK drops such a line,
    so the host waited for its answer for ever; now it gets one, and the server goes on."""
    wire = await _open_wire(nursery, tmp_path / "store")
    answer = await wire.call(1, "store_note", r'{"user_id": "ana", "text": "Loves \ud83d"}')
    assert answer["result"]["isError"]
    assert "arguments.text: expected text encodable as UTF-8, found a lone surrogate" in \
        answer["result"]["content"][0]["text"]

    deep = '{"user_id": "ana", "query": "x", "where": {"a": %s}}' % ("[" * 300 + "]" * 300)
    answer = await wire.call(2, "search_memory", deep)
    assert answer["result"]["isError"]
    assert "recursion limit" in answer["result"]["content"][0]["text"]
    # Deeper than Python's own parser goes: the id is read from the line's top level.
    deeper = '{"user_id": "ana", "query": %s}' % ("[" * 5_000 + "]" * 5_000)
    answer = await wire.call("deep", "search_memory", deeper)
    assert answer["id"] == "deep" and answer["result"]["isError"]
    assert "nested deeper" in answer["result"]["content"][0]["text"]

    # Arguments that are no object, or no tool name: a tool error naming the field (the SDK
    # answered a bare "Invalid request parameters").
    answer = await wire.call(5, "search_memory", "[]")
    assert answer["result"]["isError"]
    assert "arguments: expected an object, found list" in answer["result"]["content"][0]["text"]
    await wire.send({"jsonrpc": "2.0", "id": 6, "method": "tools/call", "params": {}})
    answer = await wire.receive()
    assert answer["id"] == 6 and answer["result"]["isError"]
    assert "name: expected the name of a tool" in answer["result"]["content"][0]["text"]

    await wire.send({"jsonrpc": "1.0", "id": 3, "method": "ping"})
    answer = await wire.receive()
    assert answer["id"] == 3 and answer["error"]["code"] == -32600

    ok = await wire.call(4, "memory_stats", {"user_id": "ana"})
    assert ok["result"]["structuredContent"]["notes"] == 0
    code, stderr = await _exit_code(wire)
    assert code == 0, stderr


async def test_a_line_that_is_no_json_or_names_no_usable_id_is_answered_with_a_null_id(
        tmp_path, nursery) -> None:
    """A request id holding a lone surrogate was echoed into the answer, which could not be
    written: the server died (exit 1), every call in flight unanswered. A line that is not
    JSON (a raw tab in a string, a trailing comma) or holds an integer of more digits than
    Python reads got no answer at all, and the host waited for ever. JSON-RPC answers each
    with an error whose id is null; the server goes on."""
    wire = await _open_wire(nursery, tmp_path / "store")
    await wire.send(r'{"jsonrpc": "2.0", "id": "\ud83d", "method": "ping"}')
    answer = await wire.receive()
    assert answer["id"] is None and answer["error"]["code"] == -32600
    assert "id: expected" in answer["error"]["message"]
    for line in ('{"jsonrpc": "2.0", "id": 7, "method": "ping",}',
                 '{"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": '
                 '"memory_stats", "arguments": {"user_id": "a\tb"}}}'):
        await wire.send(line)
        answer = await wire.receive()
        assert answer["id"] is None and answer["error"]["code"] == -32700, answer
    # An integer of more digits than Python reads in a call whose id is readable: answered
    # to that id (the host waited for ever on a null id), never with Python's own advice.
    await wire.send('{"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": '
                    '"search_memory", "arguments": {"user_id": "ana", "query": "x", "limit": '
                    '%s}}}' % ("9" * 5000))
    answer = await wire.receive()
    assert answer["id"] == 7 and answer["result"]["isError"], answer
    message = answer["result"]["content"][0]["text"]
    assert "5000 digits" in message and "sys." not in message, answer
    # An id of more digits than Python reads is valid JSON: an Invalid Request naming the id.
    await wire.send('{"jsonrpc": "2.0", "id": %s, "method": "ping"}' % ("9" * 5000))
    answer = await wire.receive()
    assert answer["id"] is None and answer["error"]["code"] == -32600, answer
    assert answer["error"]["message"].startswith("id: expected a number or text, found an "
                                                 "integer of 5000 digits"), answer
    # A request whose id is no number or text (JSON-RPC's Invalid Request), or a batch (MCP
    # has none): no answer at all before.
    for line in ('{"jsonrpc": "2.0", "id": 1.5, "method": "ping"}',
                 '{"jsonrpc": "2.0", "id": null, "method": "ping"}',
                 '{"jsonrpc": "2.0", "id": {"a": 1}, "method": "ping"}',
                 '{"jsonrpc": "2.0", "id": NaN, "method": "ping"}',
                 '[{"jsonrpc": "2.0", "id": 5, "method": "ping"}]'):
        await wire.send(line)
        answer = await wire.receive()
        assert answer["id"] is None and answer["error"]["code"] == -32600, (line, answer)
    await wire.send('{"jsonrpc": "2.0", "method": "notifications/nonsense", "params": 5}')
    ok = await wire.call(4, "memory_stats", {"user_id": "ana"})  # a notification: no answer
    assert ok["result"]["structuredContent"]["notes"] == 0
    code, stderr = await _exit_code(wire)
    assert code == 0, stderr


async def test_a_call_cancelled_by_its_id_as_text_is_not_waited_for_at_exit(
        tmp_path, nursery) -> None:
    """The SDK takes "500" and 500 for one request id, so a cancel naming the id as text
    cancels the call (which is then never answered); the transport looked for the text in
    the calls it waits for at stdin's end, and the server exited only after its 10 s drain."""
    wire = await _open_wire(nursery, tmp_path / "store")
    await wire.send({"jsonrpc": "2.0", "id": 500, "method": "tools/call", "params": {
        "name": "search_memory", "arguments": {"user_id": "ana", "query": "note"}}})
    await wire.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                     "params": {"requestId": "500"}})
    await wire.process.stdin.aclose()
    with trio.fail_after(DRAIN_SECONDS * 0.7):
        assert await wire.process.wait() == 0


async def test_a_byte_order_mark_before_the_first_line_is_skipped(tmp_path, nursery) -> None:
    """A host that writes UTF-8 with a BOM (.NET's Encoding.UTF8 does) is served: the mark
    made its initialize unreadable, so the host waited for the handshake for ever."""
    wire = await _open_wire(nursery, tmp_path / "store", first="\ufeff")
    stats = await wire.call(1, "memory_stats", {"user_id": "ana"})
    assert stats["result"]["structuredContent"]["notes"] == 0
    code, stderr = await _exit_code(wire)
    assert code == 0, stderr


async def test_a_client_that_stops_reading_leaves_the_server_to_exit_cleanly(
        tmp_path, nursery) -> None:
    """A host that closes its end of stdout first: the answers it no longer reads are dropped
    (not an EngineBroken crash, exit 1), the server exits 0 when stdin closes, and what was
    acknowledged is in the store."""
    store = tmp_path / "store"
    wire = await _open_wire(nursery, store)
    saved = await wire.call(1, "store_note", {"user_id": "ana", "text": "Acknowledged note"})
    assert not saved["result"]["isError"]
    await wire.process.stdout.aclose()
    await wire.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
        "name": "store_note", "arguments": {"user_id": "ana", "text": "Unread answer"}}})
    await wire.send({"jsonrpc": "2.0", "id": 3, "method": "tools/list"})
    code, stderr = await _exit_code(wire)
    assert code == 0, stderr
    assert "Traceback" not in stderr and "EngineBroken" not in stderr
    notes = b"".join(value for _, value in raw_databases(store).get("notes", []))
    assert b"Acknowledged note" in notes


async def test_calls_in_flight_when_the_host_closes_stdin_are_finished_and_answered(
        tmp_path, nursery) -> None:
    """A host that writes its calls and closes stdin (a script piping a file of requests):
    each call is finished and answered before the server exits, instead of being cut off as
    "Connection closed", some of them after their note was stored."""
    store = tmp_path / "store"
    wire = await _open_wire(nursery, store)
    for n in range(1, 21):
        await wire.send({"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": {
            "name": "store_note", "arguments": {"user_id": "ana", "text": f"note {n}"}}})
    await wire.process.stdin.aclose()
    answers = [await wire.receive() for _ in range(20)]
    assert all("result" in a and not a["result"]["isError"] for a in answers), answers
    assert sorted(a["id"] for a in answers) == list(range(1, 21))
    with trio.fail_after(60):
        assert await wire.process.wait() == 0
    notes = b"".join(value for _, value in raw_databases(store).get("notes", []))
    assert all(f"note {n}".encode() in notes for n in range(1, 21))


async def test_an_integral_float_is_taken_for_an_integer_argument(mem) -> None:
    """JSON Schema's integer includes 5.0 (a Python host's float), so the tool takes it as 5
    instead of refusing a call its own schema admits."""
    await mem.call_tool("store_note", {"user_id": "ana", "text": "Has a dog, Pixel"})
    async with Client(create_server(mem)) as client:
        for name, arguments in [("search_memory", {"query": "dog", "limit": 5.0}),
                                ("retrieve_memory", {"query": "dog", "episodic_limit": 2.0}),
                                ("get_entity_info", {"name": "Pixel", "limit": 3.0})]:
            result = await client.call_tool(name, {"user_id": "ana", **arguments})
            assert not result.is_error, result.content[0].text
        bad = await client.call_tool("search_memory", {"user_id": "ana", "query": "dog",
                                                       "limit": 5.5})
        assert bad.is_error and "arguments.limit: expected an integer, found float" in \
            bad.content[0].text


async def test_with_a_fixed_user_errors_name_only_the_arguments_the_host_sees(mem) -> None:
    """`--user ana`: an unknown argument's error lists the tool's arguments without user_id
    (naming it sent the model to an argument the server then refuses)."""
    async with Client(create_server(mem, user="ana")) as client:
        result = await client.call_tool("store_note", {"text": "x", "userId": "bo"})
        text = result.content[0].text
        assert result.is_error and "arguments.userId: expected one of text, tags" in text
        assert "user_id" not in text


async def test_an_error_message_does_not_echo_a_huge_value(mem) -> None:
    """A wrong value of a megabyte comes back cut short, not twice over in the error text."""
    async with Client(create_server(mem)) as client:
        result = await client.call_tool("retrieve_memory", {"user_id": "ana", "query": "x",
                                                            "detail": "x" * 1_000_000})
        text = result.content[0].text
        assert result.is_error and text.startswith("InvalidInput: arguments.detail: expected enum")
        assert len(text) < 500


async def test_with_a_fixed_user_a_huge_user_id_is_not_echoed_back(mem) -> None:
    """`--user ana`: a model that sends a megabyte of user_id anyway is told so in a short
    error, not sent the megabyte back."""
    async with Client(create_server(mem, user="ana")) as client:
        result = await client.call_tool("list_notes", {"user_id": "b" * 1_000_000})
        text = result.content[0].text
        assert result.is_error and text.startswith("arguments.user_id: expected no user_id")
        assert len(text) < 500


async def test_an_overlong_list_argument_is_refused_before_its_items_are_read(mem) -> None:
    """A million tags held the server's one loop for 14 s while the schema check collected an
    error for every item; every other call waited. A list longer than its schema's maxItems
    is refused at once, naming the argument."""
    async with Client(create_server(mem)) as client:
        result = await client.call_tool("store_note", {"user_id": "ana", "text": "x",
                                                       "tags": [5] * 200_000})
        text = result.content[0].text
        assert result.is_error and "arguments.tags: expected at most 64 items, found 200000" \
            in text


async def test_with_a_fixed_user_a_tool_of_no_arguments_says_so(mem) -> None:
    """`--user ana`: memory_stats then takes no argument; one sent anyway was refused as
    "expected one of , found an unknown argument"."""
    async with Client(create_server(mem, user="ana")) as client:
        result = await client.call_tool("memory_stats", {"userId": "bo"})
        text = result.content[0].text
        assert result.is_error and "arguments.userId: expected no arguments for tool " \
            "'memory_stats', found one" in text


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory in bytes (VmHWM)."""
    with open(f"/proc/{pid}/status") as status:
        for row in status:
            if row.startswith("VmHWM:"):
                return int(row.split()[1]) * 1024
    raise AssertionError("no VmHWM")


async def test_a_line_over_the_limit_is_refused_unread(tmp_path, nursery) -> None:
    """A request line was read and parsed whole, into many times its size, whatever its
    length: a 100 MiB line took the server from 239 to 638 MB, and a host sending gigabytes
    took all of it. A line over MAX_LINE_CHARS (the HTTP server's body limit) is answered by
    the id its start holds, refused unread, and the server goes on."""
    wire = await _open_wire(nursery, tmp_path / "store")
    before = _peak_rss(wire.process.pid)
    query = "x" * (64 << 20)
    await wire.send('{"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": '
                    '"search_memory", "arguments": {"user_id": "ana", "query": "%s"}}}' % query)
    answer = await wire.receive()
    assert answer["id"] == 7 and answer["error"]["code"] == -32600, answer
    assert "expected a line of at most 8,388,608 characters" in answer["error"]["message"]
    assert _peak_rss(wire.process.pid) - before < 32 << 20  # not even the line itself
    await wire.send("[" * (9 << 20))  # no id to answer by
    answer = await wire.receive()
    assert answer["id"] is None and answer["error"]["code"] == -32600
    ok = await wire.call(8, "memory_stats", {"user_id": "ana"})
    assert ok["result"]["structuredContent"]["notes"] == 0
    code, stderr = await _exit_code(wire)
    assert code == 0, stderr
