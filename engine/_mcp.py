"""The MCP face: the agent tools (:data:`TOOLS`) over MCP stdio, with the official ``mcp`` SDK.

``engram-trio mcp STORE [--user ID]``. The SDK runs on anyio, so the server shares the engine's
trio loop. Tool schemas are the ``parameters`` of the same definitions the engine validates
calls against, so what the host sees is what the engine enforces. With ``--user`` the server
acts for that one user: ``user_id`` leaves every schema and is filled in on each call (an
agent host cannot reach another user's memories by naming one).
"""

from __future__ import annotations

import codecs
import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import mcp_types as types
import msgspec
import pydantic
import trio
from mcp.server.lowlevel import Server
from mcp.shared.dispatcher import as_request_id, coerce_request_id
from mcp.shared.message import SessionMessage

from actors.base.errors import EngineError
from actors.base.validate import encodable, found

from ._engine import Engine
from ._tools import MAX_REQUEST_BYTES, TOOLS, call_tool as _call_tool, parameters

__all__ = ["create_server", "run_stdio"]

# How long the calls in flight when the host closes stdin have to finish before the server
# stops (and the SDK answers what is left "Connection closed").
DRAIN_SECONDS = 10.0
# The longest request line read, in characters (each at least a byte: no line that HTTP would
# take as a body is refused). A longer one is refused unread (its start kept, where a request's
# id is, to answer it): a line is parsed whole, into tens of times its size, and a host that
# sent gigabytes took the server's memory with it.
MAX_LINE_CHARS = MAX_REQUEST_BYTES
KEPT_OF_A_LONG_LINE = 1 << 16


def _schemas(user: str | None) -> dict[str, tuple[str, dict[str, Any]]]:
    """Tool name -> (description, input schema), without ``user_id`` when a user is fixed."""
    out = {}
    for tool in TOOLS:
        name = tool["function"]["name"]
        out[name] = (tool["function"]["description"], parameters(name, one_user=user is not None))
    return out


def create_server(engine: Engine, user: str | None = None) -> Server:
    """An MCP server over an open engine.

    Args:
        engine: an open :class:`Engine`.
        user: act for this user only (tools take no ``user_id``); None: tools take one.

    Returns:
        An ``mcp`` low-level :class:`Server`; run it on any MCP transport.
    """
    from ._version import __version__

    schemas = _schemas(user)

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[
            types.Tool(name=name, description=description, input_schema=schema)
            for name, (description, schema) in schemas.items()])

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        arguments = dict(params.arguments or {})
        if user is not None and "user_id" in arguments:
            found = repr(arguments["user_id"])
            if len(found) > 60:  # a model may send a megabyte where an id goes
                found = found[:57] + "..."
            return _failure(f"arguments.user_id: expected no user_id (this server acts for "
                            f"{user!r} only), found {found}")
        try:
            result = await _call_tool(engine, params.name, arguments, user=user)
        except EngineError as exc:  # the model sees the message and can correct its call
            return _failure(f"{type(exc).__name__}: {exc}")
        if params.name == "retrieve_memory":
            text = result["markdown"]
        else:
            text = msgspec.json.encode(result).decode()
        return types.CallToolResult(content=[types.TextContent(text=text)],
                                    structured_content=msgspec.to_builtins(result))

    return Server("engram-trio", version=__version__,
                  instructions="Long-term memory of the user: search it before answering, "
                               "save facts the user states, correct or confirm them.",
                  on_list_tools=list_tools, on_call_tool=call_tool)


def _failure(message: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=message)], is_error=True)


async def run_stdio(store: str | Path, user: str | None = None, config: Any = None) -> None:
    """Open the store and serve MCP on stdin/stdout until the client closes stdin.

    Raises:
        InvalidInput: a bad config or user id.
    """
    if user is not None:
        from actors.base import validate as _validate

        _validate.check_id("user", user, 256)
    async with Engine.open(store, config=config) as mem:
        server = create_server(mem, user)
        async with _stdio() as (lines, out), _wire(lines, out) as (read, write):
            await server.run(read, write, server.create_initialization_options())


@asynccontextmanager
async def _wire(lines: _Lines, out: _Out) -> AsyncIterator[tuple[Any, Any]]:
    """JSON-RPC messages over the lines and back, as the SDK's ``stdio_server`` makes them,
    except that a request it cannot read is answered: the SDK drops such a line (a lone
    surrogate escape, a model's emoji cut in two; nesting deeper than its parser goes; a
    wrong envelope), and the host waited for that answer for ever."""
    to_server, from_wire = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    to_wire, from_server = anyio.create_memory_object_stream[SessionMessage](0)
    # The ids of the host's requests handed to the server and not answered yet: when stdin
    # ends, the server is told so only once they are (the SDK cuts off what is in flight,
    # answering "Connection closed" to calls that may have stored what they were asked to).
    pending: set[Any] = set()
    answered = trio.Event()  # set by each answer written; read makes a new one to wait on

    async def read(answers: anyio.abc.ObjectSendStream[SessionMessage]) -> None:
        nonlocal answered
        async with to_server, answers:
            async for line in lines:
                if isinstance(line, _LongLine):
                    await answers.send(SessionMessage(_answer_long(line)))
                    continue
                try:
                    message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                except pydantic.ValidationError as exc:
                    if (answer := _answer_unreadable(line, exc)) is not None:
                        await answers.send(SessionMessage(answer))
                    continue
                if (isinstance(message, types.JSONRPCNotification) and '"id"' in line
                        and (answer := _misread_request(line)) is not None):
                    await answers.send(SessionMessage(answer))
                    continue
                if isinstance(message, types.JSONRPCRequest):
                    if (refused := _call_refused(message)) is not None:
                        await answers.send(SessionMessage(types.JSONRPCResponse(
                            jsonrpc="2.0", id=message.id, result=refused.model_dump(
                                by_alias=True, mode="json", exclude_none=True))))
                        continue
                    pending.add(coerce_request_id(message.id))
                elif (isinstance(message, types.JSONRPCNotification)
                      and message.method == "notifications/cancelled"):
                    # A request the host cancelled is never answered (the spec says so); the
                    # SDK takes "7" and 7 for one id, and so must this.
                    cancelled = as_request_id((message.params or {}).get("requestId"))
                    if cancelled is not None:
                        pending.discard(coerce_request_id(cancelled))
                await to_server.send(SessionMessage(message))
            with trio.move_on_after(DRAIN_SECONDS):
                while pending:
                    answered = trio.Event()
                    await answered.wait()

    async def write() -> None:
        async with from_server:
            async for message in from_server:
                await out.write(message.message.model_dump_json(by_alias=True,
                                                                exclude_unset=True) + "\n")
                if isinstance(message.message, types.JSONRPCResponse | types.JSONRPCError):
                    pending.discard(coerce_request_id(message.message.id))
                    answered.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read, to_wire.clone())
        nursery.start_soon(write)
        yield from_wire, to_wire


def _call_refused(request: types.JSONRPCRequest) -> types.CallToolResult | None:
    """A tool error for a tools/call whose name or arguments the SDK would refuse with a bare
    "Invalid request parameters" (arguments that are not an object, no tool name), naming
    the field instead; None for any other request."""
    if request.method != "tools/call":
        return None
    params = request.params if isinstance(request.params, dict) else {}
    name, arguments = params.get("name"), params.get("arguments")
    if not isinstance(name, str):
        return _failure(f"name: expected the name of a tool, found {found(name)}")
    if arguments is not None and not isinstance(arguments, dict):
        return _failure(f"arguments: expected an object, found {found(arguments)}")
    return None


def _answer_unreadable(line: str, error: pydantic.ValidationError) -> types.JSONRPCMessage | None:
    """The answer to a request on a line the SDK could not read: a tool error for a tool
    call, a JSON-RPC error otherwise; None when the line holds no request id to answer."""
    deep = False
    huge: list[_Digits] = []  # integers of more digits than Python reads

    def integer(text: str) -> int | _Digits:
        try:
            return int(text)
        except ValueError:
            huge.append(_Digits(text))
            return huge[-1]

    try:
        # Python's parser takes lone surrogates and deep nesting.
        message = json.loads(line, parse_int=integer)
    except ValueError as exc:  # not JSON
        return types.JSONRPCError(jsonrpc="2.0", id=None, error=types.ErrorData(
            code=types.PARSE_ERROR, message=f"expected a line of JSON, found one that is not: "
                                            f"{str(exc)[:200]}"))
    except RecursionError:  # deeper than Python's parser goes: its top level read alone
        message, deep = _top_level(line), True
    if huge:
        id_ = message.get("id") if isinstance(message, dict) else None
        if isinstance(id_, _Digits):
            return _no_id(f"id: expected a number or text, found an integer of "
                          f"{len(id_.lstrip('-'))} digits")
        detail = (f"expected numbers of at most {sys.get_int_max_str_digits()} digits, found "
                  f"an integer of {len(huge[0].lstrip('-'))} digits")
        if isinstance(id_, bool) or not isinstance(id_, int | str) or "method" not in message:
            return types.JSONRPCError(jsonrpc="2.0", id=None, error=types.ErrorData(
                code=types.PARSE_ERROR, message=f"expected a line of JSON the server can "
                                                f"read: {detail}"))
        if message["method"] == "tools/call":  # the host matches the answer to its call
            return types.JSONRPCResponse(jsonrpc="2.0", id=id_, result=_failure(
                f"arguments: {detail}").model_dump(by_alias=True, mode="json",
                                                   exclude_none=True))
        return types.JSONRPCError(jsonrpc="2.0", id=id_, error=types.ErrorData(
            code=types.INVALID_REQUEST, message=detail))
    if isinstance(message, list):
        return _no_id("expected one JSON-RPC message a line, found a batch (MCP has none)")
    if not isinstance(message, dict) or "method" not in message or "id" not in message:
        return None  # a notification, or a response: nothing to answer
    id_ = message["id"]
    # An id that cannot be echoed back: the answer's id is null, as JSON-RPC's is for a
    # request whose id cannot be told.
    if not _echoable(id_):
        return _no_id("id: expected a number or text encodable as UTF-8, found a lone "
                      "surrogate" if isinstance(id_, str)
                      else f"id: expected a number or text, found {found(id_)}")
    where = None if deep else _unencodable(message.get("params"), "params")
    if deep:
        detail = ("expected a JSON-RPC 2.0 request the server can read, found one nested "
                  "deeper than the parser descends")
    elif where is not None:
        detail = (f"{where}: expected text encodable as UTF-8, found a lone surrogate (half "
                  "of a UTF-16 pair, e.g. an emoji cut in two); send whole characters")
    else:
        first = error.errors()[0]
        at = ".".join(str(p) for p in first["loc"])
        detail = ("expected a JSON-RPC 2.0 request the server can read, found one it cannot: "
                  + first["msg"] + (f" ({at})" if at else ""))
    if message["method"] == "tools/call":
        result = _failure(detail.removeprefix("params."))
        return types.JSONRPCResponse(jsonrpc="2.0", id=id_, result=result.model_dump(
            by_alias=True, mode="json", exclude_none=True))
    return types.JSONRPCError(jsonrpc="2.0", id=id_, error=types.ErrorData(
        code=types.INVALID_REQUEST, message=detail))


class _Digits(str):
    """An integer on a line of JSON with more digits than Python reads into an int."""


def _misread_request(line: str) -> types.JSONRPCError | None:
    """The answer to a request the SDK read as a notification because its id is no number
    or text (1.5, null, an object): it drops the id and the host waits for ever. None when
    the line holds no id member (a notification naming "id" elsewhere)."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(message, dict) or "id" not in message:
        return None
    return _no_id(f"id: expected a number or text, found {found(message['id'])}")


def _answer_long(line: _LongLine) -> types.JSONRPCError:
    """The answer to a line over :data:`MAX_LINE_CHARS`, by the id its start holds (a null
    id when it holds none the host could match)."""
    id_ = _top_level(line.start, partial=True).get("id")
    detail = (f"expected a line of at most {MAX_LINE_CHARS:,} characters, found one of "
              f"{line.size:,}: refused unread")
    if not _echoable(id_):
        return _no_id(detail)
    return types.JSONRPCError(jsonrpc="2.0", id=id_, error=types.ErrorData(
        code=types.INVALID_REQUEST, message=detail))


def _echoable(id_: Any) -> bool:
    """Whether an answer can carry ``id_`` back: a number or text that UTF-8 can write."""
    return (not isinstance(id_, bool) and isinstance(id_, int | str)
            and (not isinstance(id_, str) or encodable(id_)))


def _no_id(detail: str) -> types.JSONRPCError:
    """An Invalid Request answered with a null id."""
    return types.JSONRPCError(jsonrpc="2.0", id=None, error=types.ErrorData(
        code=types.INVALID_REQUEST, message=detail))


def _top_level(line: str, partial: bool = False) -> dict[str, Any]:
    """The members of the JSON object on ``line`` whose values are strings, numbers, booleans
    or null, read without descending into the others (which may nest past any parser's
    depth): enough to answer the request by its id. Empty if the line is no such object;
    with ``partial`` (the start of a line), those read before the line stops being one."""
    found: dict[str, Any] = {}
    depth, key, at, n = 0, None, 0, len(line)
    decoder = json.JSONDecoder()
    while at < n:
        c = line[at]
        if c == '"':
            try:
                text, end = decoder.raw_decode(line, at)
            except ValueError:
                return found if partial else {}
            if depth == 1:
                rest = line[end:].lstrip()
                if key is None and rest.startswith(":"):
                    key = text
                elif key is not None:
                    found[key], key = text, None
            at = end
            continue
        if c in "[{":
            depth += 1
            key = None if depth > 2 else key
        elif c in "]}":
            depth -= 1
            if depth == 1:
                key = None
        elif depth == 1 and key is not None and c not in " \t\r\n:,":
            try:
                value, end = decoder.raw_decode(line, at)
            except ValueError:
                return found if partial else {}
            found[key], key, at = value, None, end
            continue
        elif c == "," and depth == 1:
            key = None
        at += 1
    return found


def _unencodable(value: Any, path: str) -> str | None:
    """Where in a parsed JSON value a string (or a key) UTF-8 cannot encode is, or None."""
    stack = [(path, value)]
    while stack:  # not recursive: the value may be nested deeper than Python recurses
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                if not encodable(key):
                    return path
                stack.append((f"{path}.{key}", item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}", item) for i, item in enumerate(value))
        elif isinstance(value, str) and not encodable(value):
            return path
    return None


@asynccontextmanager
async def _stdio() -> AsyncIterator[tuple[_Lines, _Out]]:
    """The process's stdin and stdout for :func:`_wire`, over copies of fds 0 and 1.

    The SDK's own stdin reads in a worker thread that no cancellation reaches, so Ctrl-C
    waited for the client's next line (or for ever). Here a read is a worker thread's
    ``os.read`` that a cancellation abandons (left blocked in the kernel, which an exiting
    interpreter does not mind), so Ctrl-C ends the server at once; the descriptors stay in
    blocking mode (on a terminal, stdin, stdout and stderr share one open file, so making
    one non-blocking would make stderr so). As the SDK does with its own, fd 0 reads the null
    device and fd 1 writes to stderr while serving (stray reads and prints stay off the
    wire); both come back on the way out."""
    sys.stdout.flush()
    saved = os.dup(0), os.dup(1)
    streams = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    try:
        yield _Lines(streams[0]), _Out(streams[1])
    finally:
        for fd, copy_ in enumerate(saved):
            os.dup2(copy_, fd)
            os.close(copy_)
        # The read copy stays open: an abandoned read may still be blocked on it, and a
        # closed number the kernel hands out again would have that read take another
        # file's bytes. The process ends after serving (engram-trio mcp).
        os.close(streams[1])


class _LongLine(NamedTuple):
    """A line over :data:`MAX_LINE_CHARS`: its first :data:`KEPT_OF_A_LONG_LINE` characters
    and its length, the rest dropped as it was read."""

    start: str
    size: int


class _Lines:
    """Lines of UTF-8 text read from ``fd``, newline kept: bytes UTF-8 cannot decode read as
    U+FFFD, and a byte order mark opening the stream (.NET's UTF-8 writes one) is dropped. A
    line over :data:`MAX_LINE_CHARS` comes as a :class:`_LongLine`."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def __aiter__(self) -> AsyncIterator[str | _LongLine]:
        return self._lines()

    async def _lines(self) -> AsyncIterator[str | _LongLine]:
        decode = codecs.getincrementaldecoder("utf-8-sig")(errors="replace").decode
        parts: list[str] = []  # the line so far, in pieces (a long line is not re-joined)
        size = 0  # its characters so far
        long: str | None = None  # the start of a line over the limit, whose rest is dropped
        while chunk := await trio.to_thread.run_sync(os.read, self._fd, 1 << 16,
                                                      abandon_on_cancel=True):
            text = decode(chunk)
            while (end := text.find("\n")) >= 0:
                if long is None:
                    parts.append(text[: end + 1])
                    yield "".join(parts)
                else:
                    yield _LongLine(long, size + end + 1)
                parts, size, long, text = [], 0, None, text[end + 1:]
            size += len(text)
            if long is None:
                parts.append(text)
                if size > MAX_LINE_CHARS:
                    long, parts = "".join(parts)[:KEPT_OF_A_LONG_LINE], []
        tail = "".join(parts) + decode(b"", final=True)
        if long is not None:
            yield _LongLine(long, size + len(tail))
        elif tail:
            yield tail


class _Out:
    """UTF-8 text written to ``fd`` whole (in a worker thread: a client slow to read blocks
    it, not the loop)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._gone = False  # the client closed its end: what is left to write goes nowhere

    async def write(self, text: str) -> None:
        if self._gone:
            return
        try:
            await trio.to_thread.run_sync(_write_all, self._fd, text.encode())
        except BrokenPipeError:
            # A host that stops reading before it closes stdin is going away, not breaking
            # the engine: serve on (writes still land) until stdin closes, and exit 0.
            self._gone = True


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
