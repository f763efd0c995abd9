"""Embedding benchmark: the Embedder actor against bare onnxruntime, same inputs, same process.

    python bench/embed.py              # both model variants, ~1 minute on 2 cores
    python bench/embed.py --quick      # fewer rounds

For each variant (fp32 default, q8 opt-in):
  query   one text at a time (the recall path): bare = tokenize + session.run in the calling
          thread; actor = Embedder.embed([text]) through the inbox, the actor's model thread and
          the reply channel (the query cache is bypassed). p50 / p99, and the actor's overhead.
  batch   batches of 32 texts: bare loop vs the same batches through the actor. Sentences per
          second, and actor/bare ratio.

Each round runs every query bare, then every query through the actor (then the same for the
batches), so drift (host load on this VM, thermal) hits both alike. Alternating per call instead
would make the model hop between two threads on every call, a pattern production never has,
and charge both sides for cold per-core caches. Prints a table and writes JSON (--out, default
bench/results/embed.json).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Any

import trio
from _report import percentiles, progress, write_results

from actors.embedder import Embedder, OnnxEmbedder
from engine._demo import conversation_turns, load_conversation

BATCH = 32


def corpus(seed: int) -> tuple[list[str], list[str]]:
    """Queries (short, like a user's question) and passages (whole turns) from the demo data."""
    turns = [t.text for t in conversation_turns(load_conversation())]
    rng = random.Random(seed)
    queries = [" ".join(t.split()[: rng.randint(4, 12)]) for t in turns]
    passages = [rng.choice(turns) for _ in range(BATCH * 16)]
    return queries, passages


def pct(ms: list[float]) -> dict[str, float]:
    return percentiles(ms, 1.0, "ms")


async def measure(variant: str, rounds: int, queries: list[str], passages: list[str]) -> dict[str, Any]:
    backend = OnnxEmbedder(variant)
    actor = Embedder(backend, query_cache=1)
    batches = [passages[i : i + BATCH] for i in range(0, len(passages), BATCH)]
    bare_q, actor_q = [], []
    bare_b = actor_b = 0.0
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        for text in queries[:5]:  # warm both paths
            backend.encode([text])
            await actor.embed([text])
        for round_ in range(rounds):
            progress(variant, round_, rounds)
            for text in queries:
                start = time.perf_counter()
                backend.encode([text])
                bare_q.append((time.perf_counter() - start) * 1e3)
            for text in queries:
                start = time.perf_counter()
                await actor.embed([text])
                actor_q.append((time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            for batch in batches:
                backend.encode(batch)
            bare_b += time.perf_counter() - start
            start = time.perf_counter()
            for batch in batches:
                await actor.embed(batch)
            actor_b += time.perf_counter() - start
        progress(variant, rounds, rounds)
        actor.close()
    sentences = rounds * len(passages)
    result = {
        "model": backend.model_id,
        "query_bare": pct(bare_q),
        "query_actor": pct(actor_q),
        "batch_bare_per_s": sentences / bare_b,
        "batch_actor_per_s": sentences / actor_b,
    }
    result["query_overhead"] = result["query_actor"]["p50_ms"] / result["query_bare"]["p50_ms"] - 1
    result["batch_ratio"] = result["batch_actor_per_s"] / result["batch_bare_per_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--variants", nargs="+", default=["minilm-l6-v2", "minilm-l6-v2-q8"])
    parser.add_argument("--out", default="bench/results/embed.json")
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds
    queries, passages = corpus(args.seed)
    print(f"seed {args.seed}; {os.cpu_count()} cores; onnxruntime 1 intra-op thread; "
          f"{len(queries)} queries x {rounds} rounds; {len(passages)} passages in batches of {BATCH}")
    results: dict[str, Any] = {"cores": os.cpu_count(), "seed": args.seed, "rounds": rounds}
    for variant in args.variants:
        results[variant] = trio.run(measure, variant, rounds, queries, passages)

    print(f"\n{'variant':<18}{'query bare p50/p99':>22}{'actor p50/p99':>18}{'overhead':>10}"
          f"{'batch bare/s':>14}{'actor/s':>10}{'ratio':>8}")
    for variant in args.variants:
        r = results[variant]
        qb, qa = r["query_bare"], r["query_actor"]
        print(f"{variant:<18}{qb['p50_ms']:>11.2f} /{qb['p99_ms']:>6.2f} ms"
              f"{qa['p50_ms']:>8.2f} /{qa['p99_ms']:>6.2f} ms{r['query_overhead']:>+9.1%}"
              f"{r['batch_bare_per_s']:>14.0f}{r['batch_actor_per_s']:>10.0f}{r['batch_ratio']:>8.2f}")
    write_results(args.out, results)


if __name__ == "__main__":
    sys.exit(main())
