"""Embedding benchmark: the Embedder actor against bare onnxruntime, same inputs, same process.

    python bench/embed.py              # both model variants, ~1 minute on 2 cores
    python bench/embed.py --quick      # fewer rounds
    python bench/embed.py --quality    # ~3 minutes: recall@10 of each variant on LoCoMo (dev)
    python bench/embed.py --throughput # ~5 minutes: the follower's rate, vector lag at 3 rates

For each variant (fp32, q8, i8; a new store gets the one the model's build measured fastest):
  query   one text at a time (the recall path): bare = tokenize + session.run in the calling
          thread; actor = Embedder.embed([text]) through the inbox, the actor's model thread and
          the reply channel (the query cache is bypassed). p50 / p99, and the actor's overhead.
  batch   batches of 32 texts: bare loop vs the same batches through the actor. Sentences per
          second, and actor/bare ratio.

--quality: the LoCoMo dev split (../shared/quality/locomo-dev.json, or $ENGRAM_QUALITY_DIR),
ingested as its README says, one store per conversation and variant with the long-term layer
off; every question (category 5 out) through the engine's vector leg alone; evidence recall@10
micro-averaged (found evidence turns over all evidence turns) and per question.

--throughput: conversational turns (LoCoMo dev, else bench/convgen.py). Baseline, in the same
process: bare onnxruntime doing what the follower did before (fp32, one thread, windows of 256
sorted by characters, 16 texts a call). Against it: the engine's follower embedding the same
turns as a backlog (open to flush), per variant. Then buffered add_turn at each --lag-rates
rate for --lag-seconds with the default engine (long-term layer on, every text made unique),
stats().vector_lag_* sampled each second, and texts the model embedded per second meanwhile.

Each round runs every query bare, then every query through the actor (then the same for the
batches), so drift (host load on this VM, thermal) hits both alike. Alternating per call instead
would make the model hop between two threads on every call, a pattern production never has,
and charge both sides for cold per-core caches. Prints a table and writes JSON (--out, default
bench/results/embed.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np

import trio
from _report import percentiles, progress, write_results

from actors.embedder import Embedder
from engine import Engine, NewTurn, OnnxEmbedder, demo_turns

BATCH = 32


def corpus(seed: int) -> tuple[list[str], list[str]]:
    """Queries (short, like a user's question) and passages (whole turns) from the demo data."""
    turns = [t.text for t in demo_turns()]
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


def locomo_path() -> Path:
    """``$ENGRAM_QUALITY_DIR/locomo-dev.json``, else ``shared/quality/`` beside the checkout
    or beside its parent (the layout of ../shared/quality/ from a worktree)."""
    if os.environ.get("ENGRAM_QUALITY_DIR"):
        return Path(os.environ["ENGRAM_QUALITY_DIR"]) / "locomo-dev.json"
    root = Path(__file__).resolve().parents[1]
    for base in (root.parent, root.parent.parent):
        if (base / "shared" / "quality" / "locomo-dev.json").is_file():
            return base / "shared" / "quality" / "locomo-dev.json"
    return root.parent / "shared" / "quality" / "locomo-dev.json"


QUALITY_K = 10
_DIA = re.compile(r"D:?(\d+):0*(\d+)")


def locomo_conversations(path: Path) -> list[dict[str, Any]]:
    """The LoCoMo dev split as turns and questions, following ../shared/quality/README.md: one
    user per conversation, one session per LoCoMo session dated by its date_time, turn text
    ``"<speaker>: <text>"`` plus ``" [shares <blip_caption>]"``, category 5 left out, evidence
    ids split and normalised ("D8:6; D9:17", "D:11:26", "D30:05"), ids that name no turn
    dropped."""
    out = []
    for convo in json.loads(path.read_text()):
        c = convo["conversation"]
        turns = []
        for key in sorted((k for k in c if re.fullmatch(r"session_\d+", k)),
                          key=lambda k: int(k.split("_")[1])):
            begin = datetime.strptime(c[f"{key}_date_time"], "%I:%M %p on %d %B, %Y").replace(
                tzinfo=timezone.utc)
            for i, t in enumerate(c[key]):
                text = f"{t['speaker']}: {t['text']}"
                if t.get("blip_caption"):
                    text += f" [shares {t['blip_caption']}]"
                role = "user" if t["speaker"] == c["speaker_a"] else "assistant"
                turns.append((_dia(t["dia_id"]), key, role, text, begin + timedelta(seconds=30 * i)))
        known = {dia for dia, *_ in turns}
        questions = []
        for qa in convo["qa"]:
            if qa["category"] == 5:
                continue
            evidence = {_dia(m.group(0)) for e in qa.get("evidence", [])
                        for m in _DIA.finditer(e)} & known
            if evidence:
                questions.append((qa["question"], evidence))
        out.append({"id": convo["sample_id"], "turns": turns, "questions": questions})
    return out


def _dia(raw: str) -> str:
    m = _DIA.fullmatch(raw.strip())
    return f"D{int(m.group(1))}:{int(m.group(2))}" if m else raw.strip()


async def vector_recall(variant: str, conversations: list[dict[str, Any]], work: Path
                        ) -> dict[str, Any]:
    """Turns-only vector recall@10 with ``variant``: each conversation in its own store (long-
    term layer off, so turns are all there is), every question through the engine's vector leg
    alone."""
    found = total = 0
    per_question = []
    for convo in conversations:
        async with Engine.open(work / f"{variant}-{convo['id']}",
                               config={"model": variant, "long_term": False}) as mem:
            receipts = await mem.add_turns([
                NewTurn(user_id="u", session_id=session, role=role, text=text, at=at)
                for _, session, role, text, at in convo["turns"]])
            dia_of = {r.turn_id: dia for r, (dia, *_) in zip(receipts, convo["turns"],
                                                              strict=True)}
            await mem.flush()
            for question, evidence in convo["questions"]:
                hits = await mem.recall("u", question, limit=QUALITY_K, link_depth=0,
                                        legs=["vector"])
                got = {dia_of[t] for hit in hits for t in hit.turn_ids if t in dia_of}
                found += len(got & evidence)
                total += len(evidence)
                per_question.append(len(got & evidence) / len(evidence))
        progress(f"quality {variant}", conversations.index(convo) + 1, len(conversations))
    return {"recall@10_micro": found / total, "recall@10_mean": float(np.mean(per_question)),
            "questions": len(per_question), "evidence": total}


def quality(variants: list[str], path: Path) -> dict[str, Any]:
    if not path.exists():
        raise SystemExit(f"expected the LoCoMo dev split at {path}, found nothing; point "
                         "ENGRAM_QUALITY_DIR at a folder holding locomo-dev.json")
    conversations = locomo_conversations(path)
    work = Path(tempfile.mkdtemp(prefix="engram-bench-"))
    try:
        return {v: trio.run(vector_recall, v, conversations, work) for v in variants}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def conversational_turns(limit: int) -> tuple[list[str], str]:
    """Real chat turns: the LoCoMo dev split's when it is there (no text repeats, so the content
    cache does not flatter the figure), else the generated conversations of bench/convgen.py."""
    path = locomo_path()
    if path.exists():
        texts = [text for c in locomo_conversations(path) for _, _, _, text, _ in c["turns"]]
        source = "LoCoMo dev turns"
    else:
        from convgen import generate

        conversations, _ = generate(users=12, seed=5)
        texts = [text for c in conversations for _, _, body in c.sessions for _, text in body]
        source = "bench/convgen.py turns"
    random.Random(3).shuffle(texts)
    return texts[:limit], source


def former_follower(texts: list[str]) -> float:
    """The baseline: bare onnxruntime doing what the follower did before token batching, with
    the model it used (fp32, one thread): windows of 256 sorted by characters, 16 texts a call.
    Texts per second."""
    backend = OnnxEmbedder("minilm-l6-v2", threads=1)
    backend.load()
    backend.encode(texts[:16])
    start = time.perf_counter()
    for at in range(0, len(texts), 256):
        window = sorted(texts[at : at + 256], key=len)
        for b in range(0, len(window), 16):
            backend.encode(window[b : b + 16])
    return len(texts) / (time.perf_counter() - start)


async def follower_rate(variant: str, texts: list[str], work: Path) -> dict[str, Any]:
    """The engine's own follower: the texts imported with background embedding off, then an
    engine with it on embeds the backlog; texts per second from open to flush."""
    path = work / f"follow-{variant}"
    turns_only = {"model": variant, "long_term": False}
    async with Engine.open(path, config={**turns_only, "background_embedding": False}) as mem:
        await mem.add_turns([NewTurn(user_id=f"u{i % 10}", session_id="s", role="user", text=t)
                             for i, t in enumerate(texts)], durable=True)
    async with Engine.open(path, config=turns_only) as mem:
        start = time.perf_counter()
        await mem.flush()
        elapsed = time.perf_counter() - start
        stats = await mem.stats()
    return {"texts_per_s": len(texts) / elapsed, "embedded": stats.texts_embedded,
            "cache_hits": stats.embed_cache_hits}


async def lag_at(rate: float, seconds: float, texts: list[str], work: Path) -> dict[str, Any]:
    """Buffered add_turn at ``rate`` for ``seconds`` with the default engine (long-term layer
    on), the vector lag sampled every second, and the model's rate meanwhile.
    Every text is made unique, so the content cache answers nothing."""
    samples: list[tuple[float, int, float]] = []
    async with Engine.open(work / f"lag-{rate:g}") as mem:
        start = trio.current_time()
        n = int(rate * seconds)

        async def sample() -> None:
            while True:
                await trio.sleep(1.0)
                s = await mem.stats()
                samples.append((trio.current_time() - start, s.vector_lag_records,
                                s.vector_lag_seconds))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample)
            due = start
            for i in range(n):
                if trio.current_time() < due:
                    await trio.sleep_until(due)
                await mem.add_turn(f"user{i % 50}", f"s{(i // 50) % 20}", ("user", "assistant")[i % 2],
                                   f"{texts[i % len(texts)]} ({i})")
                due += 1 / rate
                if i % max(int(rate), 1) == 0:
                    progress(f"lag @{rate:g}/s", i, n)
            progress(f"lag @{rate:g}/s", n, n)
            ingest_s = trio.current_time() - start
            end = await mem.stats()
            nursery.cancel_scope.cancel()
    # No wait for the backlog: at rates the model cannot match it would take minutes; the
    # store drains at close and embedding resumes from the watermark on the next open.
    lags = [lag for t, _, lag in samples if t <= ingest_s] or [0.0]
    records = [r for t, r, _ in samples if t <= ingest_s] or [0]
    return {"rate": rate, "achieved_rate": n / ingest_s, "seconds": ingest_s,
            "max_lag_s": max(lags), "p50_lag_s": float(np.percentile(lags, 50)),
            "max_lag_records": max(records), "lag_at_end_s": end.vector_lag_seconds,
            "lag_at_end_records": end.vector_lag_records,
            "embedded_per_s": end.texts_embedded / ingest_s, "samples": samples}


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    texts, source = conversational_turns(args.turns)
    print(f"throughput: {len(texts)} {source}; baseline: bare onnxruntime, fp32, one thread, "
          "the former follower's batching")
    work = Path(tempfile.mkdtemp(prefix="engram-bench-"))
    results: dict[str, Any] = {"source": source, "turns": len(texts)}
    try:
        results["baseline_texts_per_s"] = former_follower(texts)
        for variant in args.variants:
            r = trio.run(follower_rate, variant, texts, work)
            r["ratio"] = r["texts_per_s"] / results["baseline_texts_per_s"]
            results[variant] = r
        if args.lag_rates:
            results["lag"] = [trio.run(lag_at, rate, args.lag_seconds, texts, work)
                              for rate in args.lag_rates]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nbaseline (bare, former batching, fp32): {results['baseline_texts_per_s']:.1f} texts/s")
    for variant in args.variants:
        r = results[variant]
        print(f"engine follower, {variant:<16}: {r['texts_per_s']:.1f} texts/s = "
              f"{r['ratio']:.2f}x the baseline ({r['cache_hits']} cache hits)")
    for r in results.get("lag", []):
        print(f"lag @{r['rate']:g}/s for {r['seconds']:.0f} s (achieved {r['achieved_rate']:.0f}/s): "
              f"max {r['max_lag_s']:.1f} s / {r['max_lag_records']:,} records behind, "
              f"median {r['p50_lag_s']:.1f} s; at the end {r['lag_at_end_s']:.1f} s / "
              f"{r['lag_at_end_records']:,}; model embedded {r['embedded_per_s']:.0f} texts/s")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--variants", nargs="+",
                        default=["minilm-l6-v2", "minilm-l6-v2-q8", "minilm-l6-v2-i8"])
    parser.add_argument("--out", default="bench/results/embed.json")
    parser.add_argument("--quality", action="store_true",
                        help="only: turns-only vector recall@10 per variant on the LoCoMo dev split")
    parser.add_argument("--throughput", action="store_true",
                        help="only: sustained background embedding against the former "
                             "follower, and the vector lag at fixed ingest rates")
    parser.add_argument("--turns", type=int, default=1024, help="texts for --throughput")
    parser.add_argument("--lag-rates", type=float, nargs="*", default=[100, 500, 2000])
    parser.add_argument("--lag-seconds", type=float, default=20)
    args = parser.parse_args()
    if args.throughput:
        write_results(args.out.replace(".json", "-throughput.json"), throughput(args),
                      "embed-throughput")
        return
    if args.quality:
        results = quality(args.variants, locomo_path())
        print(f"\n{'variant':<18}{'recall@10 (micro)':>19}{'per question':>14}{'questions':>11}")
        for variant, r in results.items():
            print(f"{variant:<18}{r['recall@10_micro']:>19.4f}{r['recall@10_mean']:>14.4f}"
                  f"{r['questions']:>11}")
        write_results(args.out.replace(".json", "-quality.json"), results, "embed-quality")
        return
    rounds = 2 if args.quick else args.rounds
    queries, passages = corpus(args.seed)
    print(f"seed {args.seed}; {os.cpu_count()} cores; onnxruntime {OnnxEmbedder().threads} "
          "intra-op threads (the default); "
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
    write_results(args.out, results, "embed")


if __name__ == "__main__":
    sys.exit(main())
