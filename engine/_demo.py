"""The demo: replay the bundled conversation through the engine and show what it stored, and how
fast. ``python -m engine demo``."""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from importlib import resources
from pathlib import Path
from typing import Any

import trio

from actors.base.records import NewTurn

from ._engine import Engine

BULK_COPIES = 200  # copies of the conversation replayed under synthetic users for the bulk figure
QUESTIONS = (
    "What is my dog called?",
    "Where is my new job?",
    "Do I eat fish?",
    "When is the half marathon?",
)


def load_conversation() -> dict[str, Any]:
    """The bundled conversation (engine/demo_data/conversation.json)."""
    source = resources.files("engine") / "demo_data" / "conversation.json"
    return json.loads(source.read_text(encoding="utf-8"))


def conversation_turns(data: dict[str, Any], user_suffix: str = "") -> list[NewTurn]:
    """Every turn of the conversation as NewTurn values, in order, with their times."""
    step = timedelta(seconds=data["seconds_between_turns"])
    turns = []
    for user in data["users"]:
        for session in user["sessions"]:
            start = datetime.fromisoformat(session["started_at"])
            for i, (role, text) in enumerate(session["turns"]):
                turns.append(NewTurn(user_id=user["user_id"] + user_suffix,
                                     session_id=session["session_id"], role=role, text=text,
                                     at=start + i * step))
    return turns


def demo_turns() -> list[NewTurn]:
    """The conversation ``engram-trio demo`` replays, as turns ready for ``Engine.add_turns``:
    several users over several sessions, in order, with their times. For trying the engine and
    for benchmarks that want realistic chat text without a download.

    Returns:
        Every turn of the bundled conversation (engine/demo_data/conversation.json).
    """
    return conversation_turns(load_conversation())


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_demo(store: Path | None, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the demo against ``store`` (a temporary directory, removed afterwards, if None);
    return its figures. A store that already holds the conversation is not fed it again."""
    scratch = Path(tempfile.mkdtemp(prefix="engram-demo-"))
    try:
        return await _run_demo(store, scratch, say)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # not awaited: it must run when cancelled


async def _run_demo(store: Path | None, scratch: Path, say: Callable[[str], None]
                    ) -> dict[str, Any]:
    data = load_conversation()
    turns = conversation_turns(data)
    temporary = store is None
    if store is None:
        store = scratch / "store"
    users = {t.user_id for t in turns}
    sessions = {(t.user_id, t.session_id) for t in turns}
    say(f'Engram demo: replaying "{data["title"]}"')
    say(f"  {len(turns)} turns, {len(users)} users, {len(sessions)} sessions -> {store}\n")
    figures: dict[str, Any] = {"store": None if temporary else str(store)}

    async with Engine.open(store) as mem:
        latencies = []
        maya_turns = set()
        already = {info.session_id for info in await mem.list_sessions("maya")}
        figures["ingested"] = not already
        if already:
            say(f"ingest   skipped: {store} already holds the conversation (a second replay "
                "would store every turn twice)")
            maya_turns = {t.turn_id for s in already
                          for t in await mem.session_history("maya", s, limit=10_000)}
        for t in turns if not already else ():
            start = time.perf_counter()
            receipt = await mem.add_turn(t.user_id, t.session_id, t.role, t.text, at=t.at)
            latencies.append((time.perf_counter() - start) * 1e6)
            if t.user_id == "maya":
                maya_turns.add(receipt.turn_id)
        start = time.perf_counter()
        await mem.flush()
        flush_ms = (time.perf_counter() - start) * 1e3
        if latencies:
            figures["add_turn_us"] = {"p50": statistics.median(latencies),
                                      "p99": _percentile(latencies, 0.99)}
            figures["flush_ms"] = flush_ms
            say(f"ingest   {len(turns)} turns one by one: add_turn p50 "
                f"{figures['add_turn_us']['p50']:.1f} µs, "
                f"p99 {figures['add_turn_us']['p99']:.1f} µs")
            say(f"embed    all {len(turns)} turns embedded in the background and on disk "
                f"{flush_ms:.0f} ms after the last add_turn ({(await mem.stats()).model})")
        queries = [t.text.split(".")[0][:60] for t in turns if t.role == "user"][:20]
        cold, warm = [], []
        for sink in (cold, warm):
            for q in queries:
                start = time.perf_counter()
                await mem.embed_query("maya", q)
                sink.append((time.perf_counter() - start) * 1e3)
        figures["query_embed_ms"] = {"p50": statistics.median(cold),
                                     "cached_p50": statistics.median(warm)}
        say(f"query    embedding p50 {figures['query_embed_ms']['p50']:.2f} ms, "
            f"repeated (LRU cache) {figures['query_embed_ms']['cached_p50'] * 1e3:.0f} µs")

        say("\nrecall   (vector + BM25 fused by rank, query embedding included):")
        timings = []
        for question in QUESTIONS:
            start = time.perf_counter()
            hits = await mem.recall("maya", question, limit=2)
            timings.append((time.perf_counter() - start) * 1e3)
            say(f"  {question}  ({timings[-1]:.1f} ms)")
            for hit in hits:
                text = " ".join(hit.text.split())
                say(f"    {hit.score:.3f} {'+'.join(hit.via):<11} {hit.role or hit.kind}: "
                    f"{text[:80]}{'...' if len(text) > 80 else ''}")
        figures["recall_ms"] = {"p50": statistics.median(timings), "max": max(timings)}
        leaked = [h for h in await mem.recall("tomas", "Lisbon flat dog", limit=10)
                  if h.id in maya_turns]
        say(f"  tenancy: tomas asking about Lisbon, a flat and a dog sees "
            f"{'none' if not leaked else len(leaked)} of maya's turns")
        figures["tenancy_leaks"] = len(leaked)
        say("\nlong-term memory (built in the background from the turns above):")
        start = time.perf_counter()
        made = 0
        for info in await mem.list_sessions("maya"):
            made += await mem.close_session("maya", info.session_id)
        await mem.flush()
        episodes = await mem.episodes("maya")
        figures["episodes"] = len(episodes)
        say(f"  episodes  {len(episodes)} (sessions closed: {made} consolidated in "
            f"{(time.perf_counter() - start) * 1e3:.0f} ms, extractive summaries)")
        for episode in episodes[:3]:
            say(f"    [{episode.session_id}] {episode.title}  (surprise {episode.surprise:.2f})")
        profile = await mem.profile("maya")
        figures["facts"] = len(profile)
        say(f"  facts     {len(profile)} active, extracted by rules, most important first:")
        for fact in profile[:8]:
            say(f"    [{fact.category}] {fact.text}  (confidence {fact.confidence:.2f})")
        pixel = await mem.entity_info("maya", "pixel")
        if pixel is not None:
            say(f"  entity    {pixel.entity.name} ({pixel.entity.type}): mentioned "
                f"{pixel.entity.mentions} times, e.g. \"{pixel.memories[-1].text[:60]}...\"")

        say("\nretrieve_memory (Markdown for the prompt), facts and the top episode:")
        start = time.perf_counter()
        markdown = await mem.retrieve_memory("maya", "what am I allergic to", episodic_limit=1,
                                             semantic_limit=5, detail="high")
        figures["retrieve_memory_ms"] = (time.perf_counter() - start) * 1e3
        for line in markdown.strip().splitlines():
            say(f"  | {line[:96]}{'...' if len(line) > 96 else ''}")
        say(f"  ({figures['retrieve_memory_ms']:.1f} ms)")

        say("\nmaya's sessions, most recent first:")
        for info in await mem.list_sessions("maya"):
            say(f"  {info.session_id:<24} {info.turn_count:>3} turns  "
                f"{info.started_at:%d %b %H:%M} - {info.last_at:%H:%M} UTC")
        latest = (await mem.list_sessions("maya"))[0].session_id
        say(f"\nthe short-term window of {latest} (last 4 turns):")
        for turn in await mem.session_history("maya", latest, limit=4):
            text = turn.text.replace("\n", " ")
            say(f"  #{turn.seq:<2} {turn.role:<9} {text[:88]}{'...' if len(text) > 88 else ''}")
        before = [t.text for t in await mem.session_history("maya", latest, limit=100)]

    start = time.perf_counter()
    async with Engine.open(store) as mem:
        opened_ms = (time.perf_counter() - start) * 1e3
        after = [t.text for t in await mem.session_history("maya", latest, limit=100)]
        say(f"\nreopen   {opened_ms:.1f} ms; {latest} read back after reopen: "
            f"{len(after)} turns, {'identical' if after == before else 'DIFFERENT'}")

        await mem.forget_user("tomas")
        stats = await mem.stats()
        say("forget   user 'tomas': "
            f"{'gone' if not await mem.list_sessions('tomas') else 'STILL THERE'}")
        say(f"stats    users={stats.users} sessions={stats.sessions} turns={stats.turns} "
            f"log={stats.committed_lsn} store={stats.store_bytes / 1e6:.1f} MB")
        figures["stats"] = {"users": stats.users, "sessions": stats.sessions,
                            "turns": stats.turns}
    figures["identical_after_reopen"] = after == before

    # A bulk import leaves embedding to the serving process, which resumes from the watermark.
    copies = [t for i in range(BULK_COPIES) for t in conversation_turns(data, f"-copy{i:03}")]
    async with Engine.open(scratch / "bulk", config={"background_embedding": False}) as mem:
        start = time.perf_counter()
        await mem.add_turns(copies, durable=True)
        bulk_s = time.perf_counter() - start
    figures["bulk_turns_per_s"] = len(copies) / bulk_s
    say(f"bulk     {len(copies):,} turns ({BULK_COPIES} copies under other users) into a second "
        f"store with add_turns, durable: {bulk_s:.2f} s = {figures['bulk_turns_per_s']:,.0f} turns/s")
    return figures


def main(store: str | None, say: Callable[[str], None] = print) -> dict[str, Any]:
    return trio.run(run_demo, Path(store) if store else None, say)
