"""The ``engram`` command (also ``python -m engine``)."""

from __future__ import annotations

import argparse
import json
import sys
import time

import trio

from ._config import Config
from ._engine import Engine
from .errors import EngineError

MODELS = ("minilm-l6-v2", "minilm-l6-v2-q8")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engram", description="Engram memory engine")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="replay the bundled conversation and show timings")
    demo.add_argument("--store", help="store directory (default: a fresh temporary one)")
    demo.add_argument("--json", action="store_true", help="print the figures as JSON at the end")
    reindex = commands.add_parser(
        "reindex", help="re-embed every record with a model (after a model change)")
    reindex.add_argument("store", help="store directory")
    reindex.add_argument("--model", choices=MODELS, default=MODELS[0],
                         help="the model to embed with (default: %(default)s)")
    reindex.add_argument("--json", action="store_true", help="print the figures as JSON")
    return parser


async def reindex(store: str, model: str, progress=print) -> dict:
    """Adopt ``model`` for ``store`` and wait until every record has its vector again."""
    start = time.perf_counter()
    async with Engine.open(store, config=Config(model=model), reembed=True) as mem:

        async def report() -> None:
            while True:
                stats = await mem.stats()
                progress(f"\rre-embedding: {stats.embedded_lsn:,} / {stats.committed_lsn:,} "
                         "log positions", end="")
                await trio.sleep(0.5)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(report)
            await mem.flush()
            nursery.cancel_scope.cancel()
        stats = await mem.stats()
    progress(f"\rre-embedded {stats.turns:,} turns with {stats.model} "
             f"in {time.perf_counter() - start:.1f} s")
    return {"model": stats.model, "turns": stats.turns, "embedded_lsn": stats.embedded_lsn}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            from ._demo import main as demo

            figures = demo(args.store)
        else:
            figures = trio.run(reindex, args.store, args.model)
        if args.json:
            print(json.dumps(figures, indent=2))
    except EngineError as exc:
        print(f"engram: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
