"""The MCP face, driven by the official SDK's client over a real `engram-trio mcp` process."""

from __future__ import annotations

import json
import sys

import pytest
import trio
from mcp import ClientSession, StdioServerParameters, stdio_client

from engine import TOOLS

# A process start, the real model's load and a few tool calls; the guard is for hangs only.
pytestmark = pytest.mark.timeout(90)


def _server(store, *extra: str) -> StdioServerParameters:
    return StdioServerParameters(command=sys.executable,
                                 args=["-m", "engine", "mcp", str(store), *extra])


async def test_an_mcp_client_lists_and_calls_the_tools(tmp_path) -> None:
    """The tools' schemas are TOOLS' own; remember, search, retrieve and notes work over stdio,
    and a schema violation comes back as a tool error the model can read."""
    async with stdio_client(_server(tmp_path / "store")) as (read, write), \
            ClientSession(read, write) as session:
        await session.initialize()
        listed = {t.name: t for t in (await session.list_tools()).tools}
        assert set(listed) == {t["function"]["name"] for t in TOOLS}
        assert listed["search_memory"].input_schema == TOOLS[0]["function"]["parameters"]

        saved = await session.call_tool("remember_fact", {
            "user_id": "ana", "category": "identity", "key": "location", "value": "Lisbon",
            "text": "Lives in Lisbon"})
        assert not saved.is_error and saved.structured_content["fact"]["value"] == "Lisbon"
        await session.call_tool("store_note", {"user_id": "ana", "text": "Has a dog, Pixel"})
        # A fact is searchable once the server's indexes have taken it, in the background: a
        # loaded machine can take longer than the calls above, so ask again for a while.
        for _ in range(200):
            found = await session.call_tool("search_memory", {"user_id": "ana", "query": "Lisbon"})
            results = json.loads(found.content[0].text)["results"]
            if results:
                break
            await trio.sleep(0.05)
        assert results[0]["text"] == "Lives in Lisbon"
        markdown = await session.call_tool("retrieve_memory", {"user_id": "ana",
                                                               "query": "where do I live"})
        assert "Lisbon" in markdown.content[0].text
        stats = await session.call_tool("memory_stats", {"user_id": "ana"})
        assert stats.structured_content["notes"] == 1

        bad = await session.call_tool("search_memory", {"user_id": "ana", "query": "x",
                                                        "limit": 51})
        assert bad.is_error and "arguments.limit: expected maximum 50" in bad.content[0].text


async def test_with_a_fixed_user_tools_take_no_user_id(tmp_path) -> None:
    """`--user ana`: user_id leaves the schemas, is filled in, and naming another is refused."""
    async with stdio_client(_server(tmp_path / "store", "--user", "ana")) as (read, write), \
            ClientSession(read, write) as session:
        await session.initialize()
        tools = (await session.list_tools()).tools
        assert all("user_id" not in t.input_schema["properties"] for t in tools)
        await session.call_tool("store_note", {"text": "Prefers mornings"})
        stats = await session.call_tool("memory_stats", {})
        assert stats.structured_content["notes"] == 1
        other = await session.call_tool("memory_stats", {"user_id": "bo"})
        assert other.is_error and "acts for 'ana' only" in other.content[0].text
