"""The ``engram`` command (also ``python -m engine``)."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import EngineError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engram", description="Engram memory engine")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="replay the bundled conversation and show timings")
    demo.add_argument("--store", help="store directory (default: a fresh temporary one)")
    demo.add_argument("--json", action="store_true", help="print the figures as JSON at the end")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            from ._demo import main as demo

            figures = demo(args.store)
            if args.json:
                print(json.dumps(figures, indent=2))
    except EngineError as exc:
        print(f"engram: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
