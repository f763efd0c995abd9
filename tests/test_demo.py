"""The demo, the main job a newcomer runs, works end to end."""

import json

import pytest

from engine._demo import conversation_turns, load_conversation, run_demo
from engine.__main__ import main


async def test_demo_replays_the_conversation_and_reads_it_back(tmp_path) -> None:
    """Every bundled turn is stored, survives a reopen unchanged, and the forgotten user is gone."""
    lines: list[str] = []
    figures = await run_demo(tmp_path / "store", say=lines.append)
    assert figures["identical_after_reopen"] is True
    per_copy = len(conversation_turns(load_conversation()))
    assert figures["stats"]["turns"] == per_copy - 4  # tomas's 4 turns forgotten
    assert figures["bulk_turns_per_s"] > 0 and figures["query_embed_ms"]["p50"] > 0
    assert figures["tenancy_leaks"] == 0 and figures["recall_ms"]["p50"] > 0
    assert any("Pixel" in line for line in lines)  # "What is my dog called?" finds the dog
    # A hit without a speaker (a fact, an episode) is labelled by its kind, not "None".
    assert not any(" None: " in line for line in lines)
    assert any("forget   user 'tomas': gone" in line for line in lines)


def test_cli_runs_the_demo(tmp_path, capsys, monkeypatch) -> None:
    """`python -m engine demo --json` exits 0 and prints the figures as one JSON document
    (the narrative goes to stderr); it leaves no temporary directory behind; run again on
    the same store it does not ingest the conversation a second time."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert main(["demo", "--store", str(tmp_path / "cli"), "--json"]) == 0
    out, err = capsys.readouterr()
    first = json.loads(out)
    assert first["identical_after_reopen"] is True and first["ingested"] is True
    assert "Engram demo: replaying" in err
    assert list((tmp_path / "tmp").iterdir()) == []
    assert main(["demo", "--store", str(tmp_path / "cli"), "--json"]) == 0
    out, err = capsys.readouterr()
    second = json.loads(out)
    assert second["ingested"] is False and "ingest   skipped" in err
    assert second["stats"]["turns"] == first["stats"]["turns"]
    assert list((tmp_path / "tmp").iterdir()) == []


def test_cli_reindex_adopts_another_model(tmp_path, capsys) -> None:
    """`engram-trio reindex STORE --model minilm-l6-v2` re-embeds a store built with q8, and is
    a no-op run again; the default config then opens it with fp32, its recorded model, and
    naming q8 explicitly is refused."""
    import trio

    from engine import Engine, ModelMismatch

    async def build() -> None:
        async with Engine.open(tmp_path / "s", config={"model": "minilm-l6-v2-q8"}) as mem:
            await mem.add_turn("ana", "s", "user", "I live in Lisbon")
            await mem.flush()
            assert (await mem.stats()).model.endswith("@q8-block16")

    trio.run(build)
    assert main(["reindex", str(tmp_path / "s"), "--model", "minilm-l6-v2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "sentence-transformers/all-MiniLM-L6-v2"
    # The turn and the fact extracted from it.
    assert report["fulltext_rebuilt"] and report["indexed_lsn"] == report["embedded_lsn"] == 2
    assert report["previous_model"] == "sentence-transformers/all-MiniLM-L6-v2@q8-block16"
    assert main(["reindex", str(tmp_path / "s"), "--model", "minilm-l6-v2"]) == 0
    assert capsys.readouterr().out.startswith("nothing to do: every record of ")

    async def reopen(config=None) -> str:
        async with Engine.open(tmp_path / "s", config=config) as mem:
            return (await mem.stats()).model

    assert trio.run(reopen) == "sentence-transformers/all-MiniLM-L6-v2"
    with pytest.raises(ModelMismatch, match=r"vectors from sentence-transformers/all-MiniLM-L6-v2 "
                                            r"\(dimension 384\) and this engine runs .*@q8-block16"):
        trio.run(reopen, {"model": "minilm-l6-v2-q8"})
