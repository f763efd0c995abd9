"""The MCP face: the agent tools (:data:`TOOLS`) over MCP stdio, with the official ``mcp`` SDK.

``engram-trio mcp STORE [--user ID]``. The SDK runs on anyio, so the server shares the engine's
trio loop. Tool schemas are the ``parameters`` of the same definitions the engine validates
calls against, so what the host sees is what the engine enforces. With ``--user`` the server
acts for that one user: ``user_id`` leaves every schema and is filled in on each call (an
agent host cannot reach another user's memories by naming one).
"""

from __future__ import annotations

import codecs
import copy
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import mcp_types as types
import msgspec
import trio
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

from actors.base.errors import EngineError

from ._engine import Engine
from ._tools import TOOLS

__all__ = ["create_server", "run_stdio"]


def _schemas(user: str | None) -> dict[str, tuple[str, dict[str, Any]]]:
    """Tool name -> (description, input schema), without ``user_id`` when a user is fixed."""
    out = {}
    for tool in TOOLS:
        function = tool["function"]
        schema = copy.deepcopy(function["parameters"])
        if user is not None:
            schema["properties"].pop("user_id")
            schema["required"] = [f for f in schema["required"] if f != "user_id"]
        out[function["name"]] = (function["description"], schema)
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
        if user is not None:
            if "user_id" in arguments:
                return _failure(f"arguments.user_id: expected no user_id (this server acts "
                                f"for {user!r} only), found {arguments['user_id']!r}")
            arguments["user_id"] = user
        try:
            result = await engine.call_tool(params.name, arguments)
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
        async with _stdio() as (stdin, stdout), \
                stdio_server(stdin, stdout) as (read, write):  # type: ignore[arg-type]
            await server.run(read, write, server.create_initialization_options())


@asynccontextmanager
async def _stdio() -> AsyncIterator[tuple[_Lines, _Out]]:
    """The process's stdin and stdout for the SDK, over copies of fds 0 and 1.

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


class _Lines:
    """Lines of UTF-8 text read from ``fd``, newline kept, as the SDK iterates a file."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def __aiter__(self) -> AsyncIterator[str]:
        return self._lines()

    async def _lines(self) -> AsyncIterator[str]:
        decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        parts: list[str] = []  # the line so far, in pieces (a long line is not re-joined)
        while chunk := await trio.to_thread.run_sync(os.read, self._fd, 1 << 16,
                                                      abandon_on_cancel=True):
            text = decode(chunk)
            while (end := text.find("\n")) >= 0:
                parts.append(text[: end + 1])
                yield "".join(parts)
                parts, text = [], text[end + 1:]
            parts.append(text)
        if tail := "".join(parts) + decode(b"", final=True):
            yield tail


class _Out:
    """UTF-8 text written to ``fd`` whole, as the SDK writes a file (in a worker thread:
    a client slow to read blocks it, not the loop)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    async def write(self, text: str) -> None:
        await trio.to_thread.run_sync(_write_all, self._fd, text.encode())

    async def flush(self) -> None:
        await trio.lowlevel.checkpoint()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
