"""The examples run as shipped (asyncio, no network services), with the fake embedder."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import httpx

from engine import HashEmbedder

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


def test_discord_style_bot_remembers_each_user(tmp_path) -> None:
    """The bot stores every message and answers from the user's own memory only."""
    bot = _load("discord_style_bot")
    replies = asyncio.run(bot.main(tmp_path / "store", embedder=HashEmbedder()))
    assert len(replies) == len(bot.SCRIPT)
    assert "peanuts" in replies[-1] or "Lisbon" in replies[-1]
    assert "Porto" not in replies[-1]


def test_fastapi_app_embeds_the_engine(tmp_path) -> None:
    """The app opens the engine in its lifespan and answers /chat and /profile."""
    example = _load("fastapi_app")
    app = example.create_app(str(tmp_path / "store"), embedder=HashEmbedder())

    async def main() -> None:
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
            first = await http.post("/chat", json={"user_id": "maya", "session_id": "s1",
                                                   "text": "I live in Lisbon"})
            assert first.status_code == 200
            # Indexed and extracted before the next message, so what recall can rank is the
            # same on every run (under load the followers could be anywhere behind).
            await app.state.mem.flush()
            second = (await http.post("/chat", json={"user_id": "maya", "session_id": "s1",
                                                     "text": "Lisbon is sunny"})).json()
            # The first message comes back as the turn itself or as the fact drawn from it.
            assert {"I live in Lisbon", "Lives in Lisbon"} & set(second["memories"])
            assert (await http.post("/chat", json={"user_id": "maya", "session_id": "s1",
                                                   "text": ""})).status_code == 422
            await app.state.mem.flush()
            profile = (await http.get("/profile/maya")).json()
            assert {"category": "identity", "key": "location", "value": "Lisbon"} in profile

    asyncio.run(main())
