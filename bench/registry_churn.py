"""Does memory come back when models are evicted? Loads pins in turn past `max_loaded`, round after round.

Builds a registry of `--pins` models (tiny random GGUFs, or copies of SmolLM2 under other names) and a
Residency with the real native loader, as `bankml serve --native --registry DIR` runs it, then for each
round leases every pin in turn (each lease over the max_loaded resident evicts the least recently used
one) and answers `--tokens` greedy tokens on it. After every round it prints the process's RSS: with
every evicted engine given back, RSS levels off after the first round (the programs JAX keeps per
shape are shared by same-shaped models); a leak grows it by about the same amount every round.

Prints one JSON object: `rss_mb` per round (round 0: before any load but the startup model's), the
growth per load over the rounds after the first, and what stayed resident.

    python3 bench/registry_churn.py [--model tiny|smollm2] [--pins 4] [--max-loaded 3] [--rounds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from bankml.config import EngineConfig  # noqa: E402
from bankml.pin import fork_record  # noqa: E402
from bankml.verify import gate_model  # noqa: E402
from gateway.app import native_estimate, native_loader  # noqa: E402
from gateway.serving.registry import Registry  # noqa: E402
from gateway.serving.residency import Residency  # noqa: E402
from model.messages import GenerateRequest, SamplingParams  # noqa: E402


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def write_pins(directory: Path, model: str, n: int) -> list[Path]:
    """`n` pinned GGUFs (plus the startup model, first) in `directory`, each with its FORK.json."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    if model == "tiny":
        from tiny_gguf import write_tiny_gguf

        for i in range(n + 1):
            paths.append(write_tiny_gguf(directory / f"Churn-{i}.Q8_0.gguf", seed=i))
    else:
        from bankml import default_model

        source = Path(default_model.default_model_path())
        for i in range(n + 1):
            dest = directory / f"Churn-{i}.{source.name}"
            try:
                os.link(source, dest)
            except OSError:
                shutil.copyfile(source, dest)
            paths.append(dest)
    for path in paths:
        Path(str(path) + ".FORK.json").write_text(json.dumps(fork_record(path)))
    return paths


async def answer(loaded, tokens: int) -> None:
    request = GenerateRequest(list(b"Hello"), SamplingParams(temperature=0.0, max_tokens=tokens),
                              request_id="churn")
    async with loaded.client.generate(request) as generation:
        async for _ in generation:
            pass


async def churn(res: Residency, names: list[str], rounds: int, tokens: int) -> list[dict]:
    out = [{"round": 0, "rss_mb": round(rss_mb(), 1), "resident": [r.name for r in res.resident()]}]
    for r in range(1, rounds + 1):
        t0 = time.perf_counter()
        for name in names:
            async with res.lease(res.registry.pin(name)) as held:
                if tokens:
                    await answer(held.loaded, tokens)
        await asyncio.gather(*list(res._tasks))  # drops stopping in the background
        out.append({"round": r, "rss_mb": round(rss_mb(), 1), "seconds": round(time.perf_counter() - t0, 1),
                    "resident": [x.name for x in res.resident()]})
        print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    ap.add_argument("--pins", type=int, default=4, help="pins loaded in turn (besides the startup model)")
    ap.add_argument("--max-loaded", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=4, help="greedy tokens answered on each load (0: none)")
    ap.add_argument("--compile-cache-dir", default="", help="JAX's persistent compile cache ('' = off)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    with tempfile.TemporaryDirectory(prefix="bankml-churn-") as tmp:
        paths = write_pins(Path(tmp), args.model, args.pins)
        startup, pins = paths[0], paths[1:]
        gated = gate_model(str(startup), Path(str(startup) + ".FORK.json").read_text())
        registry = Registry(gated, tmp)
        engine = EngineConfig(max_seqs=2, compile_cache_dir=args.compile_cache_dir)
        # the startup model counts against max_loaded as it does in `bankml serve`
        res = Residency(registry, gated, native_loader(args.ctx, engine, whole_contexts=True),
                        max_loaded=args.max_loaded, ctx=args.ctx, estimate=native_estimate(args.ctx, engine),
                        max_seqs=engine.max_seqs)
        res.load_startup()
        names = [registry.pin(p.name.lower().removesuffix(".gguf")).name for p in pins]
        try:
            rounds = asyncio.run(churn(res, names, args.rounds, args.tokens))
        finally:
            res.stop_all()
        for t in threading.enumerate():  # a compile still running as the interpreter exits aborts it
            if t.name in ("bankml-compile", "lltokenizer"):
                t.join()
        gc.collect()
        later = [r["rss_mb"] for r in rounds[1:]]
        per_load = (later[-1] - later[0]) / ((len(later) - 1) * len(names)) if len(later) > 1 else None
        print(json.dumps({
            "bench": "registry_churn", "model": args.model, "pins": len(names), "max_loaded": args.max_loaded,
            "rounds": args.rounds, "ctx": args.ctx, "tokens_per_load": args.tokens,
            "rss_mb": [r["rss_mb"] for r in rounds],
            "growth_per_load_mb_after_round_1": None if per_load is None else round(per_load, 2),
            "resident_at_end": rounds[-1]["resident"], "rss_mb_after_stop_all": round(rss_mb(), 1),
        }))


if __name__ == "__main__":
    main()
