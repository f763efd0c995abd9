"""A discord.py-style asyncio bot that remembers its users, with engine.aio.

discord.py, aiogram and python-telegram-bot all have this shape: an asyncio client that calls
an ``on_message`` coroutine per incoming message and lets it reply. Here the client is a small
stand-in fed from a list, so the example runs without a network or a bot token; swap
``ScriptedClient`` for ``discord.Client`` and the handler stays the same.

    python examples/discord_style_bot.py [STORE]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.aio import Engine


@dataclass
class Message:
    """What a chat library hands the bot: who wrote what, where."""

    author_id: str
    channel_id: str
    content: str


class ScriptedClient:
    """A discord.Client look-alike: runs ``on_message`` for each scripted message in turn."""

    def __init__(self, script: list[Message]) -> None:
        self.script = script
        self.on_message: Callable[[Message], Awaitable[str]] | None = None

    def event(self, handler: Callable[[Message], Awaitable[str]]) -> Callable:
        self.on_message = handler
        return handler

    async def run(self) -> list[str]:
        return [await self.on_message(message) for message in self.script]


def reply_from(memory: str, message: Message) -> str:
    """Where a real bot calls its language model with ``memory`` in the prompt."""
    first = next((line for line in memory.splitlines() if line.startswith("- ")), None)
    return f"(remembering: {first[2:]})" if first else "Tell me more!"


def make_bot(mem: Engine, client: ScriptedClient) -> None:
    @client.event
    async def on_message(message: Message) -> str:
        user, session = message.author_id, message.channel_id
        # The hot path: in the session's window at once, on disk within a group commit.
        mem.add_turn_nowait(user, session, "user", message.content)
        memory = await mem.retrieve_memory(user, message.content, conversation_id=session,
                                           episodic_limit=3)
        reply = reply_from(memory, message)
        mem.add_turn_nowait(user, session, "assistant", reply)
        return reply


SCRIPT = [
    Message("maya", "dm-maya", "Hi! I'm Maya and I live in Lisbon."),
    Message("maya", "dm-maya", "I'm allergic to peanuts, by the way."),
    Message("tomas", "dm-tomas", "Hello, I'm Tomas from Porto."),
    Message("maya", "dm-maya", "Can you suggest a snack for my hike?"),
]


async def main(store: str | Path, **engine_options: Any) -> list[str]:
    async with Engine.open(store, **engine_options) as mem:
        client = ScriptedClient(SCRIPT)
        make_bot(mem, client)
        replies = await client.run()
        await mem.flush()
        return replies


if __name__ == "__main__":
    where = sys.argv[1] if len(sys.argv) > 1 else Path(tempfile.mkdtemp()) / "store"
    for message, reply in zip(SCRIPT, asyncio.run(main(where))):
        print(f"{message.author_id}: {message.content}\n  bot: {reply}")
