"""The demo, the main job a newcomer runs, works end to end."""

from engine._demo import conversation_turns, load_conversation, run_demo
from engine.__main__ import main


async def test_demo_replays_the_conversation_and_reads_it_back(tmp_path) -> None:
    """Every bundled turn is stored, survives a reopen unchanged, and the forgotten user is gone."""
    lines: list[str] = []
    figures = await run_demo(tmp_path / "store", say=lines.append)
    assert figures["identical_after_reopen"] is True
    per_copy = len(conversation_turns(load_conversation()))
    assert figures["stats"]["turns"] == per_copy * 201 - 4  # tomas's 4 turns forgotten
    assert any("forget   user 'tomas': gone" in line for line in lines)


def test_cli_runs_the_demo(tmp_path, capsys) -> None:
    """`python -m engine demo --json` exits 0 and prints the figures."""
    assert main(["demo", "--store", str(tmp_path / "cli"), "--json"]) == 0
    assert '"identical_after_reopen": true' in capsys.readouterr().out
