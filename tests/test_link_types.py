"""Links carry several types per pair; derived links never overwrite provenance; expansion can
follow chosen types only."""

from __future__ import annotations

import io

import lmdb
import pytest

from actors.base.messages import PutState
from actors.store import MAX_DBS
from actors.store.integrity import seal, unseal
from actors.store.layout import legacy_link_keys, link_keys
from engine import InvalidInput

from .conftest import open_engine, raw_databases


async def test_a_fact_keeps_its_provenance_beside_the_entity_link(mem) -> None:
    """A fact derived from a turn that names the same entity: the entity follower's
    shares_entity link between the two must not replace the derived_from link."""
    turn = await mem.add_turn("maya", "s1", "user", "My dog Pixel loves the beach.")
    await mem.flush()
    (fact,) = [f for f in await mem.profile("maya") if f.key == "dog:pixel"]
    types = {(link.from_id, link.to_id, link.type) for link in await mem.links("maya",
                                                                               fact.fact_id)}
    assert (fact.fact_id, turn.turn_id, "derived_from") in types
    assert (fact.fact_id, turn.turn_id, "shares_entity") in types


async def test_one_pair_holds_several_types_each_once(mem) -> None:
    """link() with a second type adds a link; the same type again replaces itself."""
    a = await mem.add_turn("maya", "s1", "user", "We booked the flat.")
    b = await mem.add_turn("maya", "s1", "user", "We paid the deposit.")
    await mem.flush()
    await mem.link("maya", a.turn_id, b.turn_id, "relates_to")
    await mem.link("maya", a.turn_id, b.turn_id, "follows")
    await mem.link("maya", a.turn_id, b.turn_id, "follows")
    found = sorted((l.from_id, l.to_id, l.type) for l in await mem.links("maya", a.turn_id))
    assert found == [(a.turn_id, b.turn_id, "follows"), (a.turn_id, b.turn_id, "relates_to")]
    assert sorted(l.type for l in await mem.links("maya", b.turn_id)) == ["follows",
                                                                         "relates_to"]
    await mem.forget_session("maya", "s1")
    assert await mem.links("maya", a.turn_id) == []


async def test_a_link_the_other_way_of_a_type_the_pair_holds_is_refused(mem) -> None:
    """The pair's key is the same both ways, so link(b, a, T) used to replace link(a, b, T):
    an episode's ``summarises`` link turned into the turn summarising the episode. It is
    refused, and the link the pair holds keeps its direction and time."""
    a = await mem.add_turn("maya", "s1", "user", "We booked the flat.")
    b = await mem.add_turn("maya", "s1", "user", "We paid the deposit.")
    await mem.flush()
    first = await mem.link("maya", a.turn_id, b.turn_id, "derived_from")
    with pytest.raises(InvalidInput, match="to_id.*'derived_from' link the other way"):
        await mem.link("maya", b.turn_id, a.turn_id, "derived_from")
    await mem.link("maya", b.turn_id, a.turn_id, "follows")  # another type: its own link
    await mem.link("maya", a.turn_id, b.turn_id, "derived_from")  # the same way: replaced
    found = {(l.from_id, l.to_id, l.type) for l in await mem.links("maya", b.turn_id)}
    assert found == {(a.turn_id, b.turn_id, "derived_from"), (b.turn_id, a.turn_id, "follows")}
    for i in range(6):
        await mem.add_turn("maya", "s2", "user", f"packing box {i} for the move")
    await mem.close_session("maya", "s2")
    await mem.flush()
    [episode] = await mem.episodes("maya", "s2")
    [summarises] = [l for l in await mem.links("maya", episode.episode_id)
                    if l.type == "summarises"][:1]
    with pytest.raises(InvalidInput, match="the other way"):
        await mem.link("maya", summarises.to_id, episode.episode_id, "summarises")
    assert summarises in await mem.links("maya", episode.episode_id)
    assert first.from_id == a.turn_id


async def test_expansion_follows_only_the_types_asked_for(mem) -> None:
    """recall(link_types=[...]) walks links of those types only."""
    a = await mem.add_turn("maya", "s1", "user", "zebra crossing near the school")
    b = await mem.add_turn("maya", "s2", "user", "the school bus schedule changed")
    c = await mem.add_turn("maya", "s3", "user", "groceries for the weekend")
    await mem.flush()
    await mem.link("maya", a.turn_id, b.turn_id, "relates_to")
    await mem.link("maya", a.turn_id, c.turn_id, "mentions")
    everything = {h.id for h in await mem.recall("maya", "zebra", limit=1, link_depth=1)}
    assert everything >= {a.turn_id, b.turn_id, c.turn_id}
    only = {h.id for h in await mem.recall("maya", "zebra", limit=1, link_depth=1,
                                           link_types=["mentions"])}
    assert c.turn_id in only and b.turn_id not in only
    with pytest.raises(InvalidInput, match="link_types"):
        await mem.recall("maya", "zebra", link_types=[""])


async def test_links_stored_before_they_carried_their_type_are_read_and_forgotten(
        store_path, clock) -> None:
    """A store written when a pair held one link (keys without the type): its links are
    found once, a new link of the same type does not double them, and a forget removes
    both key forms."""
    async with open_engine(store_path, clock=clock) as mem:
        a = await mem.add_turn("maya", "s1", "user", "We booked the flat.")
        b = await mem.add_turn("maya", "s1", "user", "We paid the deposit.")
        await mem.flush()
        link = await mem.link("maya", a.turn_id, b.turn_id, "relates_to")
    env = lmdb.open(str(store_path), max_dbs=MAX_DBS)
    try:
        with env.begin(write=True) as txn:
            db = env.open_db(b"links", txn=txn)
            key = link_keys("maya", link)[0]
            value = seal(unseal(txn.get(key, db=db), b"links", key))  # as sealed back then
            for key in link_keys("maya", link):
                assert txn.delete(key, db=db)
            for key in legacy_link_keys("maya", link):
                txn.put(key, value, db=db)
    finally:
        env.close()
    async with open_engine(store_path, clock=clock) as mem:
        assert await mem.links("maya", a.turn_id) == [link]
        await mem.link("maya", a.turn_id, b.turn_id, "relates_to", at=link.at)
        assert await mem.links("maya", b.turn_id) == [link]
        await mem.forget_session("maya", "s1")
        await mem.flush()
    assert raw_databases(store_path).get("links", []) == []


async def test_a_link_held_in_the_untyped_key_form_is_not_turned_around(store_path) -> None:
    """A store from before typed link keys holds a link under the pair alone: link(b, a, T)
    did not see it, so the pair held T both ways, and the store's own export was refused by
    import as a link given twice. Refused as for a typed one; the export imports."""
    async with open_engine(store_path) as mem:
        a = await mem.add_turn("maya", "s1", "user", "We booked the flat.")
        b = await mem.add_turn("maya", "s1", "user", "We paid the deposit.")
        await mem.flush()
        await mem.link("maya", a.turn_id, b.turn_id, "derived_from")
    env = lmdb.open(str(store_path), max_dbs=MAX_DBS)
    with env.begin(write=True) as txn:
        links = env.open_db(b"links", txn=txn)
        for key, value in list(txn.cursor(links)):
            txn.delete(key, db=links)
            # The untyped form, sealed as values were before checksums took in the key.
            txn.put(key.rsplit(b"\x00", 1)[0], seal(unseal(value, b"links", key)), db=links)
    env.close()
    async with open_engine(store_path) as mem:
        with pytest.raises(InvalidInput, match="the other way"):
            await mem.link("maya", b.turn_id, a.turn_id, "derived_from")
        assert [(l.from_id, l.to_id) for l in await mem.links("maya", a.turn_id)] == [
            (a.turn_id, b.turn_id)]
        out = io.BytesIO()
        await mem.export_user("maya", out)
    async with open_engine(store_path.parent / "b") as mem:
        assert (await mem.import_user(out.getvalue()))["links"] == 1


async def test_a_link_made_the_other_way_while_an_import_writes_its_links_stays(
        store_path, monkeypatch) -> None:
    """The import looks at the links a pair holds, then writes its own in a later
    transaction: a link() the other way in between was turned around by the import's. The
    write itself now keeps a link of its type the pair holds the other way."""
    async with open_engine(store_path / "a") as mem:
        a = await mem.add_turn("maya", "s1", "user", "We booked the flat.")
        b = await mem.add_turn("maya", "s1", "user", "We paid the deposit.")
        await mem.flush()
        await mem.link("maya", a.turn_id, b.turn_id, "about")
        export = io.BytesIO()
        await mem.export_user("maya", export)
    async with open_engine(store_path / "b") as mem:
        store = mem._parts.store
        original = store.write_unlogged

        async def bot_links_first(*ops):
            if any(isinstance(op, PutState) and op.links for op in ops):
                store.write_unlogged = original
                await mem.link("maya", b.turn_id, a.turn_id, "about")
            return await original(*ops)

        monkeypatch.setattr(store, "write_unlogged", bot_links_first)
        done = await mem.import_user(export.getvalue())
        assert [(l.from_id, l.to_id) for l in await mem.links("maya", a.turn_id)] == [
            (b.turn_id, a.turn_id)]
        assert done.get("links", 0) == 0  # counted from what the write wrote
