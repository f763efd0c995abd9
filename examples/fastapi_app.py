"""A FastAPI app of your own (asyncio, e.g. under uvicorn) that embeds the engine with
engine.aio: opened in the lifespan, one engine for every request.

    uvicorn examples.fastapi_app:app            # ENGRAM_STORE=... picks the store directory
    curl -s localhost:8000/chat -H 'content-type: application/json' \\
         -d '{"user_id": "maya", "session_id": "s1", "text": "I live in Lisbon"}'

(``engram-trio serve`` is the engine's own HTTP API on trio; this is for an app that already
runs on asyncio and wants memory inside it.)
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel

from engine import InvalidInput
from engine.aio import Engine


class ChatIn(BaseModel):
    user_id: str
    session_id: str
    text: str


def create_app(store: str, **engine_options: Any) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with Engine.open(store, **engine_options) as mem:
            app.state.mem = mem
            yield

    app = FastAPI(lifespan=lifespan)

    @app.post("/chat")
    async def chat(body: ChatIn, request: Request) -> dict[str, Any]:
        mem: Engine = request.app.state.mem
        try:
            mem.add_turn_nowait(body.user_id, body.session_id, "user", body.text)
        except InvalidInput as exc:
            raise HTTPException(422, str(exc)) from None
        hits = await mem.recall(body.user_id, body.text, limit=3)
        reply = f"I remember {len(hits)} related things."  # your model call goes here
        mem.add_turn_nowait(body.user_id, body.session_id, "assistant", reply)
        return {"reply": reply, "memories": [h.text for h in hits]}

    @app.get("/profile/{user_id}")
    async def profile(user_id: str, request: Request) -> list[dict[str, Any]]:
        facts = await request.app.state.mem.profile(user_id)
        return [{"category": f.category, "key": f.key, "value": f.value} for f in facts]

    return app


app = create_app(os.environ.get("ENGRAM_STORE", "engram-example-store"))
