"""Bounded memory under load: the server's resident memory over 1,000 requests of mixed lengths, some
abandoned mid-stream, several at once. Prints JSON.

    python bench/soak.py [--requests 1000] [--clients 4] [--config FILE] [--model FILE --fork F]

It starts `bankml serve --native` (the default model unless --model) on free ports and sends
`--requests` streamed chat requests from `--clients` concurrent clients: prompts of about 10 to 350 tokens
(a shared system prompt for half of them, so the prefix cache fills and evicts), max_tokens 1 to 48,
and every fifth request dropped by its client after a few chunks (the engine must free its
sequence). The server process's RSS (psutil) is sampled after each request; the JSON reports it after
the first 50 and at the end, their ratio (the issue's bound: within 5%), the peak, and the engine's
own counts (`GET /slots`, Prometheus /metrics) at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from gateway_helpers import CliServer  # noqa: E402

WORDS = ("river stone lantern orbit violet harbor ember quartz meadow signal copper thistle glacier "
         "falcon saffron tundra beacon marble cinder willow").split()
SYSTEM = "You are a careful assistant. " + " ".join(WORDS * 6)


def request_body(rng: random.Random) -> dict:
    user = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120)))
    messages = [{"role": "user", "content": f"Write about: {user}"}]
    if rng.random() < 0.5:
        messages.insert(0, {"role": "system", "content": SYSTEM})
    return {"model": "m", "messages": messages, "stream": True, "temperature": rng.choice([0.0, 0.8]),
            "seed": rng.randint(0, 2**31), "max_tokens": rng.randint(1, 48)}


async def one(client: httpx.AsyncClient, url: str, body: dict, abandon_after: int | None) -> str:
    chunks = 0
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            return f"http {r.status_code}"
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                chunks += 1
                if abandon_after is not None and chunks >= abandon_after:
                    return "abandoned"  # leaving the block closes the connection mid-stream
    return "done"


async def soak(url: str, pid: int, n: int, clients: int, seed: int) -> dict:
    rng = random.Random(seed)
    proc = psutil.Process(pid)
    rss: list[int] = []
    outcomes: dict[str, int] = {}
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(n):
        queue.put_nowait((i, request_body(rng), rng.randint(2, 6) if i % 5 == 4 else None))

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            _, body, abandon = queue.get_nowait()
            how = await one(client, url, body, abandon)
            outcomes[how] = outcomes.get(how, 0) + 1
            rss.append(proc.memory_info().rss)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    return {"requests": n, "clients": clients, "seconds": round(time.perf_counter() - t0, 1), "outcomes": outcomes,
            "rss_mib_after_50": round(rss[min(49, len(rss) - 1)] / 2**20, 1),
            "rss_mib_end": round(rss[-1] / 2**20, 1), "rss_mib_peak": round(max(rss) / 2**20, 1),
            "end_over_50": round(rss[-1] / rss[min(49, len(rss) - 1)], 4),
            "rss_mib_every_100": [round(rss[i] / 2**20, 1) for i in range(0, len(rss), 100)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--max-seqs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model")
    ap.add_argument("--fork")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "soak.toml"
        config.write_text(f"[serve]\nctx = {args.ctx}\n\n[engine]\nmax_seqs = {args.max_seqs}\n")
        model = [args.model, "--fork", args.fork] if args.model else []
        print("bench/soak: starting the server (compiling takes a minute)", file=sys.stderr, flush=True)
        server = CliServer(["bankml"], *model, "--config", str(config), timeout_s=900)
        try:
            out = asyncio.run(soak(server.url("/v1/chat/completions"), server.proc.pid, args.requests, args.clients,
                                   args.seed))
            slots = httpx.get(server.url("/slots"), timeout=30)
            metrics = httpx.get(server.url("/metrics"), timeout=30).text
            out["slots_busy_at_end"] = (sum(s.get("is_processing", False) for s in slots.json())
                                        if slots.status_code == 200 else f"http {slots.status_code}")
            out["prometheus"] = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                                 if line.startswith(("bankml_requests_", "bankml_kv_cache", "bankml_prefix_cache",
                                                     "bankml_num_preemptions"))}
        finally:
            server.stop()
    out["config"] = {"ctx": args.ctx, "max_seqs": args.max_seqs}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
