"""recall's filters under hostile input: every bad filter is the engine's InvalidInput, and a
filter admits in every leg exactly what the filter means, judged by a plain-Python reference."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import InvalidInput

from .conftest import T0, open_engine


async def _texts(mem, where, **kwargs) -> set[str]:
    return {h.text for h in await mem.recall("ana", "turn", limit=1000, where=where, **kwargs)}


def _deep(levels: int) -> list:
    value: list = []
    for _ in range(levels):
        value = [value]
    return value


async def test_a_range_bound_python_writes_with_an_exponent_is_searched(store_path) -> None:
    """-1e-05 is written with an exponent by repr, which the text index's query grammar took for a
    syntax error: the bound is handed over in positional notation."""
    async with open_engine(store_path, config={"long_term": False}) as mem:
        for i, n in enumerate([-1.0, -0.00002, 0.0, 0.5]):
            await mem.add_turn("ana", "s", "user", f"turn {i}", meta={"n": n})
        await mem.flush()
        for legs in (None, ["bm25"], ["vector"]):
            assert await _texts(mem, {"n": {"gt": -1e-05}}, legs=legs) == {"turn 2", "turn 3"}
            assert await _texts(mem, {"n": {"lte": -1e-05}}, legs=legs) == {"turn 0", "turn 1"}


async def test_a_range_bound_past_2_to_the_53_is_refused(store_path) -> None:
    """The text index compares numbers in a range as 64-bit floats, so past 2**53 it could not
    tell 2**63-1 from 2**63-2: such a bound is refused rather than answered wrongly."""
    async with open_engine(store_path, config={"long_term": False}) as mem:
        await mem.add_turn("ana", "s", "user", "turn big", meta={"n": 2**63 - 1})
        await mem.add_turn("ana", "s", "user", "turn small", meta={"n": 2**53 - 1})
        await mem.flush()
        for where, place in [({"n": {"gt": 2**63 - 2}}, "where.n.gt"),
                             ({"n": {"lte": -(2**53)}}, "where.n.lte"),
                             ({"n": {"gte": 1e19}}, "where.n.gte")]:
            with pytest.raises(InvalidInput) as err:
                await _texts(mem, where)
            assert err.value.field == place
            assert "expected a number between -2**53 and 2**53" in str(err.value)
        assert await _texts(mem, {"n": {"gt": 2**53 - 2}}) == {"turn big", "turn small"}
        assert await _texts(mem, {"n": {"gte": 2**53 - 1}}) == {"turn big", "turn small"}
        assert await _texts(mem, {"n": {"lt": 2**53 - 1}}) == set()
        # Equality is exact at any size: it compares terms, not floats.
        assert await _texts(mem, {"n": 2**63 - 1}) == {"turn big"}


async def test_negative_zero_in_meta_compares_as_zero(store_path) -> None:
    """-0.0 == 0 in Python and in JSON; the text index sorts -0.0 below 0.0, so a stored -0.0
    failed gte 0 and passed lt 0 in the search legs but not in the window legs."""
    async with open_engine(store_path, config={"long_term": False}) as mem:
        await mem.add_turn("ana", "s", "user", "turn zero", meta={"n": -0.0})
        await mem.add_turn("ana", "s", "user", "turn minus", meta={"n": -1})
        await mem.flush()
        for legs in (None, ["bm25"], ["vector"]):
            assert await _texts(mem, {"n": {"gte": 0}}, legs=legs) == {"turn zero"}
            assert await _texts(mem, {"n": {"lt": 0}}, legs=legs) == {"turn minus"}
            assert await _texts(mem, {"n": {"lte": -0.0}}, legs=legs) == {"turn zero",
                                                                         "turn minus"}
            assert await _texts(mem, {"n": {"gt": -0.0}}, legs=legs) == set()


async def test_meta_keys_no_filter_can_name_are_not_found_under_another_name(
        store_path) -> None:
    """A key holding the text index's path separator (\\x01) or its path/value separator
    (\\x00) read as a nested path or as a longer value: {"a.b": 5} found {"a\\x01b": 5}, and
    contains "val" under "a" found {"a\\x00b": "val"}."""
    async with open_engine(store_path, config={"long_term": False}) as mem:
        await mem.add_turn("ana", "s", "user", "turn sep", meta={"a\x01b": 5, "a\x00b": "val"})
        await mem.add_turn("ana", "s", "user", "turn nested", meta={"a": {"b": 5}})
        await mem.flush()
        for legs in (None, ["bm25"], ["vector"]):
            assert await _texts(mem, {"a.b": 5}, legs=legs) == {"turn nested"}
            assert await _texts(mem, {"a": {"contains": "val"}}, legs=legs) == set()
        assert await _texts(mem, {"a.b": {"ne": 5}}) == {"turn sep"}


async def test_a_long_contains_is_refused_before_the_index_sees_it(mem) -> None:
    """tantivy's regular expressions stop at 1,000 states: a contains of a few hundred
    characters was a raw ValueError out of recall; it is refused naming its place, and one at
    the limit works under the longest field name a filter may use."""
    await mem.add_turn("ana", "s", "user", "turn one", meta={"t": "x" * 300})
    await mem.flush()
    for value in ["x" * 1000, "\U0001f600" * 60]:
        with pytest.raises(InvalidInput) as err:
            await _texts(mem, {"t": {"contains": value}})
        assert err.value.field == "where.t.contains"
        assert "expected at most 200 bytes of UTF-8" in str(err.value)
    assert await _texts(mem, {"t": {"contains": "x" * 200}}) == {"turn one"}
    longest = ".".join(["k" * 64] * 8)
    assert await _texts(mem, {longest: {"contains": "\U0001f600" * 50}}) == set()
    assert await _texts(mem, {"tags": {"contains": "\u00e9" * 100}}) == set()


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"where": {"a": _deep(50_000)}}, "where.a"),
    ({"where": {"a": {"in": _deep(50_000)}}}, "where.a.in[0]"),
    ({"where": _deep(50_000)}, "where"),
    ({"where": {"a": {"eq": {"x": _deep(50_000)}}}}, "where.a.eq"),
    ({"tags": [_deep(50_000)]}, "tags[0]"),
    ({"kinds": [_deep(50_000)]}, "kinds"),
    ({"roles": _deep(50_000)}, "roles"),
    ({"link_types": [_deep(50_000)]}, "link_types[0]"),
    ({"legs": [_deep(50_000)]}, "legs"),
    ({"emotion": [_deep(50_000)]}, "emotion"),
    ({"emotion": _deep(50_000)}, "emotion"),
    ({"category": [_deep(50_000)]}, "category"),
    ({"category": {"x": _deep(50_000)}}, "category"),
])
async def test_a_deeply_nested_value_is_refused_not_a_recursion_error(mem, kwargs, field) -> None:
    """An error message shows what it found; showing a list nested 50,000 deep raised
    RecursionError instead of the engine's own error."""
    with pytest.raises(InvalidInput) as err:
        await mem.recall("ana", "anything", **kwargs)
    assert err.value.field == field
    assert len(str(err.value)) < 400


# -- the same filter in every leg, against a plain-Python reference --------------------------

VALUES = ["web", "Web", "\u00e9", "e\u0301", "a b", 0, 1, -1, 0.0, -0.0, 2.5, 1e-05, -1e-05,
          True, False, 2**60, 2**53 + 1]
BOUNDS = [0, -0.0, 1, -1, 2.5, 1e-05, -1e-05, 2**53 - 1, -(2**53 - 1)]
NEEDLES = ["e", "W", "\u00e9", " ", "\u0301", "web"]
META_FIELDS = ["a", "b", "o.x", "meta.tags", "missing"]
TEXT_FIELDS = {"role": ["user", "assistant"], "session_id": ["s1", "s2"],
               "tags": ["red", "blue", "web"], "kind": ["turn", "note"]}

_meta_value = st.one_of(st.sampled_from(VALUES), st.none(),
                        st.lists(st.sampled_from(VALUES), max_size=3))
META = st.fixed_dictionaries({}, optional={
    "a": _meta_value, "b": _meta_value,
    "o": st.one_of(st.fixed_dictionaries({"x": _meta_value}),
                   st.lists(st.fixed_dictionaries({"x": _meta_value}), max_size=2)),
    "tags": st.lists(st.sampled_from(["red", "blue", "web"]), max_size=2, unique=True),
    "a\x01b": st.just(5), "o\x00x": st.just("web")})


@st.composite
def _conditions(draw) -> dict:
    field = draw(st.sampled_from(META_FIELDS + list(TEXT_FIELDS)))
    if field in TEXT_FIELDS:
        op = draw(st.sampled_from(["eq", "ne", "in", "nin", "contains"]))
        pool = TEXT_FIELDS[field]
        if op == "contains":
            return {field: {op: draw(st.sampled_from(["e", "s", "r", "ur"]))}}
    else:
        op = draw(st.sampled_from(["eq", "ne", "in", "nin", "contains", "gt", "gte", "lt",
                                   "lte"]))
        pool = VALUES
        if op == "contains":
            return {field: {op: draw(st.sampled_from(NEEDLES))}}
        if op in ("gt", "gte", "lt", "lte"):
            return {field: {op: draw(st.sampled_from(BOUNDS))}}
    if op in ("in", "nin"):
        return {field: {op: draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3))}}
    value = draw(st.sampled_from(pool))
    return {field: value} if op == "eq" and draw(st.booleans()) else {field: {op: value}}


FILTERS = st.recursive(
    _conditions(),
    lambda inner: st.one_of(
        st.fixed_dictionaries({"AND": st.lists(inner, min_size=1, max_size=3)}),
        st.fixed_dictionaries({"OR": st.lists(inner, min_size=1, max_size=3)}),
        st.fixed_dictionaries({"NOT": inner})),
    max_leaves=6)


def _leaves(value: Any, path: list[str]) -> list[Any]:
    if isinstance(value, list):
        return [leaf for item in value for leaf in _leaves(item, path)]
    if not path:
        return [] if value is None or isinstance(value, dict) else [value]
    if isinstance(value, dict) and path[0] in value:
        return _leaves(value[path[0]], path[1:])
    return []


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool | str) or isinstance(b, bool | str):
        return type(a) is type(b) and a == b
    return a == b


def _admits(where: dict, turn: dict) -> bool:
    """The filter as the README states it, over what was stored: the reference."""
    for name, value in where.items():
        if name in ("AND", "OR"):
            results = [_admits(w, turn) for w in value]
            if not (all(results) if name == "AND" else any(results)):
                return False
            continue
        if name == "NOT":
            if _admits(value, turn):
                return False
            continue
        if name in TEXT_FIELDS:
            tags = turn["meta"].get("tags", [])
            leaves = {"kind": ["turn"], "role": [turn["role"]], "session_id": [turn["session"]],
                      "tags": tags}[name]
        else:
            leaves = _leaves(turn["meta"], name.removeprefix("meta.").split("."))
        op, operand = next(iter(value.items())) if isinstance(value, dict) else ("eq", value)
        if op == "eq":
            ok = any(_same(leaf, operand) for leaf in leaves)
        elif op == "ne":
            ok = not any(_same(leaf, operand) for leaf in leaves)
        elif op == "in":
            ok = any(_same(leaf, v) for leaf in leaves for v in operand)
        elif op == "nin":
            ok = not any(_same(leaf, v) for leaf in leaves for v in operand)
        elif op == "contains":
            ok = any(isinstance(leaf, str) and operand in leaf for leaf in leaves)
        else:
            numbers = [x for x in leaves if isinstance(x, int | float) and not isinstance(x, bool)]
            ok = any(x > operand if op == "gt" else x >= operand if op == "gte"
                     else x < operand if op == "lt" else x <= operand for x in numbers)
        if not ok:
            return False
    return True


TURNS = st.lists(st.tuples(st.sampled_from(["user", "assistant"]), st.sampled_from(["s1", "s2"]),
                           META), min_size=1, max_size=12)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(turns=TURNS, where=FILTERS, indexed=st.integers(0, 12),
       tags=st.one_of(st.none(), st.lists(st.sampled_from(["red", "blue"]), min_size=1,
                                          max_size=2)),
       roles=st.one_of(st.none(), st.just(["user"])),
       session_id=st.sampled_from([None, "s1"]), until=st.one_of(st.none(), st.integers(0, 12)))
async def test_every_leg_admits_what_the_filter_means(tmp_path_factory, turns, where, indexed,
                                                      tags, roles, session_id, until) -> None:
    """Random meta and random filters (with tags, roles, a session and a time range beside
    them): recall, its BM25 leg and its vector leg admit exactly the turns a plain-Python
    reading of the filter admits, turns written before the last flush and after it alike."""
    path = tmp_path_factory.mktemp("where") / "store"
    stored = []
    others = {"tags": tags, "roles": roles, "session_id": session_id,
              "until": None if until is None else T0 + timedelta(minutes=until)}
    async with open_engine(path, config={"long_term": False}) as mem:
        for i, (role, session, meta) in enumerate(turns):
            if i == indexed:
                await mem.flush()
            await mem.add_turn("ana", session, role, f"turn {i}", meta=meta,
                               at=T0 + timedelta(minutes=i))
            stored.append({"text": f"turn {i}", "role": role, "session": session, "meta": meta,
                           "minute": i})
        expected = {t["text"] for t in stored if _admits(where, t)
                    and (tags is None or set(tags) & set(t["meta"].get("tags", [])))
                    and (roles is None or t["role"] in roles)
                    and (session_id is None or t["session"] == session_id)
                    and (until is None or t["minute"] <= until)}
        assert await _texts(mem, where, **others) == expected
        await mem.flush()
        for legs in (None, ["bm25"], ["vector"]):
            assert await _texts(mem, where, legs=legs, **others) == expected, legs


@pytest.mark.parametrize("field", ["tags", "kinds", "roles", "legs", "link_types"])
async def test_a_dict_for_a_list_filter_is_refused_not_read_as_its_keys(mem, field) -> None:
    """tags={"in": ["red"]} (where's shape in the wrong argument) was read as the one tag "in"
    and silently matched nothing; kinds={"turn": 1} as the kind "turn"."""
    await mem.add_turn("ana", "s", "user", "turn red", meta={"tags": ["red"]})
    value = {"in": ["red"]} if field == "tags" else {"turn": 1}
    with pytest.raises(InvalidInput) as err:
        await mem.recall("ana", "turn", **{field: value})
    assert err.value.field == field
    assert "found dict" in str(err.value)


async def test_more_than_4_contains_in_one_filter_are_refused(mem) -> None:
    """Each contains scans every distinct string attribute of the whole index (0.3-0.5 s per
    200,000 here), and a recall searches three times: 64 of them made one call take minutes."""
    where = {"OR": [{"title": {"contains": f"trip {i}"}} for i in range(5)]}
    with pytest.raises(InvalidInput) as err:
        await mem.recall("ana", "anything", where=where)
    assert err.value.field == "where.OR[4]"
    assert "expected at most 4 contains in one filter, found more" in str(err.value)
    where = {"OR": [{"title": {"contains": f"trip {i}"}} for i in range(4)]}
    assert await mem.recall("ana", "anything", where=where) == []


@pytest.mark.parametrize(("where", "field", "found"), [
    ({"kind": "turns"}, "where.kind.eq", "'turns'"),
    ({"kind": {"ne": "Note"}}, "where.kind.ne", "'Note'"),
    ({"role": {"in": ["user", "bot"]}}, "where.role.in[1]", "'bot'"),
    ({"NOT": {"role": {"nin": ["User"]}}}, "where.NOT[0].role.nin[0]", "'User'"),
])
async def test_a_kind_or_role_no_memory_has_is_refused(mem, where, field, found) -> None:
    """kind and role take a few known values, as kinds= and roles= do: {"kind": "turns"}
    matched nothing and {"kind": {"ne": "Note"}} everything, silently."""
    await mem.add_turn("ana", "s", "user", "turn one")
    with pytest.raises(InvalidInput) as err:
        await mem.recall("ana", "turn", where=where)
    assert err.value.field == field
    assert "expected one of" in str(err.value) and found in str(err.value)


async def test_a_huge_field_name_is_cut_in_the_error(mem) -> None:
    """A field name of a million characters was quoted whole, twice, in the error (its place
    and its message): a 2 MB reply to a bad filter."""
    with pytest.raises(InvalidInput) as err:
        await mem.recall("ana", "turn", where={"x" * 1_000_000: 1})
    assert err.value.field.startswith("where.xxx") and len(str(err.value)) < 400
    assert "expected a field name of letters, digits" in str(err.value)
