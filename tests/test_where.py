"""recall's ``where``: mem0-shaped metadata filters with operators, applied inside every leg."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
import tantivy

from actors.base.where import attributes, parse
from engine import InvalidInput

from .conftest import T0, open_engine

QUERY = "trip to lisbon"


async def _old_and_new(mem) -> None:
    """300 recent turns that match QUERY well (channel web), then 3 old ones that match it
    weakly (channel sms): unfiltered, the old ones rank far below any leg's candidate depth."""
    for i in range(3):
        await mem.add_turn("ana", "s0", "user", f"an older note that mentions a trip, number {i}",
                           at=T0 + timedelta(seconds=i),
                           meta={"channel": "sms", "priority": 9, "title": f"Old Trip {i}"})
    for i in range(300):
        await mem.add_turn("ana", "s1", "user", f"our trip to lisbon, the lisbon trip plan {i}",
                           at=T0 + timedelta(days=30, seconds=i),
                           meta={"channel": "web", "priority": i % 5, "lang": ["en", "pt"][i % 2]})
    await mem.flush()


async def test_a_filter_on_old_low_ranked_memories_still_returns_them_at_limit_5(
        store_path) -> None:
    """The filter runs inside each leg, not after it: three old turns ranked far below the
    legs' candidate depth come back at limit=5, from the BM25 leg and the vector leg alone
    too; unfiltered, none of them is among the first 100."""
    async with open_engine(store_path) as mem:
        await _old_and_new(mem)
        unfiltered = await mem.recall("ana", QUERY, limit=100, kinds=["turn"])
        assert not any("older note" in h.text for h in unfiltered)
        old = {f"an older note that mentions a trip, number {i}" for i in range(3)}
        for legs in (None, ["bm25"], ["vector"]):
            hits = await mem.recall("ana", QUERY, limit=5, where={"channel": "sms"}, legs=legs)
            assert {h.text for h in hits} == old, legs
        hits = await mem.recall("ana", QUERY, limit=5,
                                where={"priority": {"gt": 8}, "title": {"contains": "Trip 1"}})
        assert [h.text for h in hits] == ["an older note that mentions a trip, number 1"]


async def test_every_operator_and_the_logical_nesting(store_path) -> None:
    """eq ne gt gte lt lte in nin contains, AND / OR / NOT, and a field a turn lacks."""
    async with open_engine(store_path) as mem:
        await _old_and_new(mem)

        async def count(where) -> int:
            return len(await mem.recall("ana", QUERY, limit=400, where=where))

        assert await count({"channel": "web"}) == 300
        assert await count({"channel": {"eq": "sms"}}) == 3
        assert await count({"channel": {"ne": "web"}}) == 3
        assert await count({"priority": {"gte": 3}}) == 120 + 3
        assert await count({"priority": {"gt": 3}}) == 60 + 3
        assert await count({"priority": {"lt": 1}}) == 60
        assert await count({"priority": {"lte": 1, "gte": 1}}) == 60
        assert await count({"priority": 2.0}) == 60  # numbers by value
        assert await count({"priority": "2"}) == 0  # never a string
        assert await count({"lang": {"in": ["pt", "de"]}}) == 150
        assert await count({"lang": {"nin": ["pt"]}}) == 150 + 3  # the old turns have none
        assert await count({"title": {"contains": "Trip"}}) == 3
        assert await count({"title": {"contains": "trip"}}) == 0  # case-sensitive
        assert await count({"OR": [{"channel": "sms"}, {"priority": 4}]}) == 63
        assert await count({"AND": [{"channel": "web"}, {"NOT": {"priority": {"in": [0, 1]}}}]}
                           ) == 180
        assert await count({"NOT": [{"channel": "web"}, {"lang": "en"}]}) == 150 + 3
        assert await count({"kind": "turn", "role": "user", "session_id": "s0"}) == 3
        assert await count({"missing": {"ne": 1}}) == 303
        assert await count({"missing": 1}) == 0


async def test_notes_and_facts_are_filtered_by_their_own_fields(store_path) -> None:
    """A fact's category, key, value, importance and origin, a note's tags; a meta filter
    admits no note or fact."""
    async with open_engine(store_path, config={"long_term": False}) as mem:
        await mem.remember_fact("ana", "identity", "location", "Lisbon",
                                text="lives in Lisbon", importance=0.9)
        await mem.remember_fact("ana", "preference", "likes:trips", "city trips",
                                text="likes city trips to Lisbon", importance=0.4)
        await mem.store_note("ana", "plan the Lisbon trip in spring", tags=["travel"])
        await mem.add_turn("ana", "s", "user", "Lisbon again", meta={"channel": "web"})
        await mem.flush()

        async def texts(where) -> set[str]:
            return {h.text for h in await mem.recall("ana", "Lisbon", limit=20, where=where)}

        assert await texts({"category": "identity"}) == {"lives in Lisbon"}
        assert await texts({"importance": {"gte": 0.6}}) == {"lives in Lisbon"}
        assert await texts({"kind": "fact", "value": {"contains": "trips"}}) == {
            "likes city trips to Lisbon"}
        assert await texts({"origin": "api", "key": {"in": ["location"]}}) == {"lives in Lisbon"}
        assert await texts({"tags": "travel"}) == {"plan the Lisbon trip in spring"}
        assert await texts({"channel": "web"}) == {"Lisbon again"}
        assert await texts({"kind": {"in": ["note", "turn"]}}) == {
            "plan the Lisbon trip in spring", "Lisbon again"}


async def test_a_turn_not_yet_indexed_is_filtered_too(store_path) -> None:
    """Read-your-writes: the window leg applies the filter to turns the indexes lack."""
    async with open_engine(store_path, config={"background_embedding": False}) as mem:
        await mem.add_turn("ana", "s", "user", "passport ends in 4411", meta={"channel": "sms"})
        await mem.add_turn("ana", "s", "user", "passport renewal form", meta={"channel": "web"})
        hits = await mem.recall("ana", "passport", where={"channel": "sms"})
        assert [h.text for h in hits] == ["passport ends in 4411"]


async def test_linked_memories_pass_the_filter_too(store_path) -> None:
    """Link expansion does not bring back what the filter keeps out."""
    async with open_engine(store_path, config={"long_term": False}) as mem:
        a = await mem.add_turn("ana", "s", "user", "booked the hotel in Porto",
                               meta={"channel": "web"}, durable=True)
        b = await mem.add_turn("ana", "s", "user", "unrelated words entirely",
                               meta={"channel": "sms"}, durable=True)
        await mem.link("ana", a.turn_id, b.turn_id, "relates_to")
        await mem.flush()
        hits = await mem.recall("ana", "hotel in Porto", link_depth=1)
        assert "unrelated words entirely" in {h.text for h in hits}
        hits = await mem.recall("ana", "hotel in Porto", link_depth=1, where={"channel": "web"})
        assert [h.text for h in hits] == ["booked the hotel in Porto"]


@pytest.mark.parametrize(("where", "field", "message"), [
    ({"channel": {"like": "web"}}, "where.channel.like", "expected an operator among eq, ne"),
    ({"priority": {"gte": "2"}}, "where.priority.gte", "expected a finite number, found str"),
    ({"importance": "high"}, "where.importance.eq", "expected a number (importance is a number)"),
    ({"category": 3}, "where.category.eq", "expected a string (category is text)"),
    ({"lang": ["en", "pt"]}, "where.lang", 'for any of several values use {"in": [...]}'),
    ({"lang": {"in": []}}, "where.lang.in", "expected a non-empty list of values"),
    ({"lang": {"in": ["en", None]}}, "where.lang.in[1]", "expected a string, a number or a "
                                                         "boolean, found NoneType"),
    ({"title": {"contains": 3}}, "where.title.contains", "expected a non-empty string"),
    ({"bad name!": 1}, "where.bad name!", "expected a field name of letters, digits"),
    ({"OR": []}, "where.OR", "expected a non-empty list of filters"),
    ({"and": [{"a": 1}]}, "where.and", "use AND, OR or NOT (upper case)"),
    ({}, "where", "expected at least one condition, found an empty filter"),
    ("channel=web", "where", "expected a filter object"),
    ({"x": {"gt": float("nan")}}, "where.x.gt", "expected a finite number"),
    # Numbers and text no stored value can equal, which the index cannot take either.
    ({"n": 2**63}, "where.n.eq", "expected an integer from -2**63 to 2**63-1, found 9223"),
    ({"n": {"in": [1, -10**30]}}, "where.n.in[1]", "expected an integer from -2**63"),
    ({"n": {"gt": 10**400}}, "where.n.gt", "expected an integer from -2**63"),
    ({"n": {"lt": -10**5000}}, "where.n.lt", "found one of 16610 bits"),
    ({"lang": "e\ud800n"}, "where.lang.eq", "expected text encodable as UTF-8"),
    ({"la\udc00ng": "en"}, "where", "expected text encodable as UTF-8"),
])
async def test_a_bad_filter_is_refused_with_what_was_expected(mem, where, field, message) -> None:
    with pytest.raises(InvalidInput) as err:
        await mem.recall("ana", "anything", where=where)
    assert err.value.field == field
    assert message in str(err.value)


async def test_too_deep_a_filter_is_refused(mem) -> None:
    where = {"channel": "web"}
    for _ in range(7):
        where = {"NOT": where}
    with pytest.raises(InvalidInput, match="nested at most 6 levels deep"):
        await mem.recall("ana", "anything", where=where)
    with pytest.raises(InvalidInput, match="at most 64 comparisons"):
        await mem.recall("ana", "x", where={"OR": [{"a": i} for i in range(65)]})


async def test_the_text_index_and_the_records_agree_on_random_filters(store_path) -> None:
    """The tantivy query a filter compiles to admits exactly the turns the filter admits when
    judged on the records themselves, over random meta and random filters (seeded)."""
    seed = 1515
    rng = random.Random(seed)
    values = ["web", "sms", "Trip", "a trip", 0, 1, 2.5, -3, True, False]
    roles = ["user", "assistant", "system"]  # a role filter takes these only

    def meta() -> dict:
        out = {}
        for key in ("a", "b", "c"):
            roll = rng.random()
            if roll < 0.3:
                continue
            out[key] = ([rng.choice(values) for _ in range(rng.randint(1, 3))] if roll < 0.45
                        else rng.choice(values))
        if rng.random() < 0.3:
            out["n"] = {"x": rng.choice(values)}
        return out

    def condition() -> dict:
        field = rng.choice(["a", "b", "c", "n.x", "role"])
        op = rng.choice(["eq", "ne", "gt", "gte", "lt", "lte", "in", "nin", "contains"])
        if op in ("gt", "gte", "lt", "lte"):
            operand = rng.choice([0, 1, 2.5, -3])
        elif op in ("in", "nin"):
            operand = rng.sample(roles if field == "role" else values, 2)
        elif op == "contains":
            operand = rng.choice(["rip", "we", "a ", "s"])
        else:
            operand = rng.choice(roles if field == "role" else values)
        if field == "role" and op in ("gt", "gte", "lt", "lte"):
            op, operand = "eq", "user"
        return {field: {op: operand}}

    def tree(depth: int = 0) -> dict:
        roll = rng.random()
        if depth < 2 and roll < 0.2:
            return {"OR": [tree(depth + 1), tree(depth + 1)]}
        if depth < 2 and roll < 0.3:
            return {"NOT": tree(depth + 1)}
        if depth < 2 and roll < 0.4:
            return {"AND": [tree(depth + 1), tree(depth + 1)]}
        return condition()

    async with open_engine(store_path, config={"long_term": False}) as mem:
        turns = []
        for i in range(120):
            r = await mem.add_turn("ana", "s", rng.choice(["user", "assistant"]), f"turn {i}",
                                   meta=meta(), durable=True)
            turns.append(await mem.get_turn("ana", r.turn_id))
        await mem.flush()
        for case in range(150):
            where = tree()
            node = parse(where)
            expected = sorted(t.lsn for t in turns if node.matches(attributes(t)))
            found = sorted(await mem._fulltext.tagged("ana", None, 1000, node))
            assert found == expected, (seed, case, where)


async def test_an_index_written_without_the_filter_fields_is_rebuilt(store_path) -> None:
    """A text index of an older engine (no ``attrs``) is rebuilt at open, and filters work."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s", "user", "hello Lisbon", meta={"channel": "web"})
        await mem.flush()
    path = store_path / "fulltext"
    for file in path.iterdir():
        file.unlink()
    builder = tantivy.SchemaBuilder()
    builder.add_unsigned_field("lsn", stored=False, indexed=True, fast=True)
    builder.add_text_field("text", stored=False)
    writer = tantivy.Index(builder.build(), path=str(path)).writer(15_000_000, 1)
    writer.commit()
    writer.wait_merging_threads()
    del writer
    async with open_engine(store_path) as mem:
        assert "an older engine's index" in mem._fulltext.damage
        await mem.flush()
        hits = await mem.recall("ana", "Lisbon", where={"channel": "web"}, legs=["bm25"])
        assert [h.text for h in hits] == ["hello Lisbon"]


async def test_the_http_api_and_the_agent_tool_take_the_filter(store_path) -> None:
    """POST /recall and the search_memory tool (which MCP serves with the same schema) filter;
    a bad filter is a 422 naming its place, and a tool error."""
    import httpx

    from engine._server import create_app

    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s", "user", "the Lisbon flat", meta={"channel": "web"})
        await mem.add_turn("ana", "s", "user", "the Lisbon office", meta={"channel": "sms"})
        await mem.flush()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(mem)),
                                     base_url="http://127.0.0.1") as http:
            found = await http.post("/v1/users/ana/recall", json={
                "query": "Lisbon", "where": {"channel": {"in": ["sms"]}}})
            assert [h["text"] for h in found.json()["hits"]] == ["the Lisbon office"]
            bad = await http.post("/v1/users/ana/recall", json={
                "query": "Lisbon", "where": {"channel": {"like": "sms"}}})
            assert bad.status_code == 422 and bad.json()["field"] == "where.channel.like"
            tool = await http.post("/v1/tools/search_memory", json={
                "user_id": "ana", "query": "Lisbon", "where": {"NOT": {"channel": "sms"}}})
            assert [h["text"] for h in tool.json()["results"]] == ["the Lisbon flat"]
        with pytest.raises(InvalidInput, match="arguments.where: expected an object"):
            await mem.call_tool("search_memory", {"user_id": "ana", "query": "x", "where": 3})
        with pytest.raises(InvalidInput, match="where.channel.like"):
            await mem.call_tool("search_memory", {"user_id": "ana", "query": "x",
                                                  "where": {"channel": {"like": 1}}})
