"""verify and compact on paths that hold no store: the caller's mistake, said as one."""

from __future__ import annotations

import pytest

from engine import Engine, InvalidInput


async def test_verify_and_compact_refuse_a_path_that_holds_no_store_as_invalid_input(
        tmp_path) -> None:
    """A name too long, a NUL, a lone surrogate, a path through a file or a data.mdb that is a
    folder is InvalidInput naming the store (never an OSError), and nothing is made there."""
    (tmp_path / "a-file").write_text("not a directory")
    (tmp_path / "folder" / "data.mdb").mkdir(parents=True)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for store in (tmp_path / ("x" * 300), tmp_path / "nul\x00", tmp_path / "\ud800",
                  tmp_path / "a-file" / "store", tmp_path / "folder"):
        for call in (Engine.verify, Engine.compact):
            with pytest.raises(InvalidInput, match=r"^store: expected an Engram store") as refused:
                await call(store)
            assert refused.value.field == "store", (call, store)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
