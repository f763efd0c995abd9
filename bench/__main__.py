"""``python -m bench report``: redraw the benches' pictures from their JSON, running no bench.

    python -m bench report                    # docs/bench/*.json -> docs/bench/*.svg
    python -m bench report bench/results      # a local run's JSON, pictures beside them

The pictures the README shows live in docs/bench/ with the JSON they are drawn from; to
publish a new run, copy its JSON from bench/results/ into docs/bench/ and run this.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT = HERE.parent / "docs" / "bench"
# The benches are scripts that import their helpers as top-level modules (`from _report
# import ...`); the same module objects serve here.
sys.path.insert(0, str(HERE))


def report(folders: list[Path]) -> list[Path]:
    """Draw every bench JSON in ``folders``; return the pictures written.

    Raises:
        SystemExit: a folder is missing or holds no bench JSON.
    """
    from _plots import draw

    written = []
    for folder in folders:
        if not folder.is_dir():
            raise SystemExit(f"report: expected a folder of bench JSON files, found no folder "
                             f"at {folder}")
        sources = sorted(folder.glob("*.json"))
        if not sources:
            raise SystemExit(f"report: expected bench JSON files in {folder}, found none; run "
                             f"a bench (python bench/ingest.py --quick) or pass its --out folder")
        for source in sources:
            written.append(draw(source))
            print(f"{source} -> {written[-1]}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    draw = commands.add_parser("report", help="redraw every picture from the benches' JSON",
                               description="Redraw every picture from the benches' JSON files "
                                           "(one SVG beside each), running no bench.")
    draw.add_argument("folders", nargs="*", type=Path, default=[DEFAULT],
                      help=f"folders of bench JSON (default: {DEFAULT.relative_to(HERE.parent)})")
    args = parser.parse_args(argv)
    report(args.folders)
    return 0


if __name__ == "__main__":
    sys.exit(main())
