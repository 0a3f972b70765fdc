"""The gateway's own cost: GET /health requests per second and latency, and streamed tokens per second
through the gateway against the engine's own rate. Prints JSON.

    python bench/gateway.py [--model FILE --fork F] [--ctx 512] [--config cpu] [--tokens 64]
    python bench/gateway.py --fake      # the gateway over the tests' fake engine: its cost alone

It starts `bankml serve --native` (or the fake-engine server) on free ports, then:
- /health: `--requests` requests over raw sockets (one per connection, as the server closes each),
  sequentially and from `--clients` threads at once; requests/s and median/p90 latency in ms;
- a streamed greedy answer of `--tokens` tokens: tokens/s as the client sees them (first to last
  chunk), against the engine's own decode rate for that same answer (its /bankml/metrics record);
- unless --no-direct, the engine alone (model.engine.Engine in this process, after the server has
  stopped): the same prompt and length, no HTTP at all.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from gateway_helpers import CliServer, FakeServer, tiny_model  # noqa: E402
from http_probe import health_once  # noqa: E402

PROMPT = [{"role": "user", "content": "Count from 1 to 500, separated by commas."}]


def bench_health(port: int, n: int, clients: int) -> dict:
    for _ in range(20):
        health_once(port)  # warm
    t0 = time.perf_counter()
    seq = [health_once(port) for _ in range(n)]
    seq_s = time.perf_counter() - t0

    conc: list[float] = []
    lock = threading.Lock()

    def worker(k: int) -> None:
        mine = [health_once(port) for _ in range(k)]
        with lock:
            conc.extend(mine)

    per = max(1, n // clients)
    threads = [threading.Thread(target=worker, args=(per,)) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    conc_s = time.perf_counter() - t0

    def summary(lat: list[float], secs: float) -> dict:
        q = statistics.quantiles(lat, n=10)
        return {"requests": len(lat), "requests_per_s": round(len(lat) / secs, 1),
                "median_ms": round(statistics.median(lat), 3), "p90_ms": round(q[-1], 3)}

    return {"sequential": summary(seq, seq_s), f"concurrent_{clients}": summary(conc, conc_s)}


def bench_stream(port: int, tokens: int) -> dict:
    import httpx

    body = {"messages": PROMPT, "stream": True, "temperature": 0, "max_tokens": tokens}
    t0 = time.perf_counter()
    first = last = None
    usage = None
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=3600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
            usage = event.get("usage") or usage
    n = usage["completion_tokens"]
    record = httpx.get(f"http://127.0.0.1:{port}/bankml/metrics").json()["records"][-1]
    client_tps = (n - 1) / (last - first) if last and first and last > first else None
    out = {"completion_tokens": n, "ttft_ms": round((first - t0) * 1e3, 1) if first else None,
           "client_tokens_per_s": round(client_tps, 2) if client_tps else None,
           "engine_eval_tokens_per_s": record["eval_tps"]}
    if client_tps and record["eval_tps"]:
        out["gateway_cost_pct"] = round(100 * (1 - client_tps / record["eval_tps"]), 2)
    return out


def bench_direct(model: str, ctx: int, tokens: int) -> dict:
    from gateway.serving.native_model import NativeModel
    from model.engine import Engine
    from model.messages import SamplingParams

    engine = Engine.load(model, verified=True, n_ctx=ctx, warmup=True)
    prompt = NativeModel.of(engine, model).prompt(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    list(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4)))  # warm
    times, n = [], 0
    for out in engine.generate(prompt, params):
        times.append(time.perf_counter())
        n = out.completion_tokens
    return {"completion_tokens": n,
            "tokens_per_s": round((n - 1) / (times[-1] - times[0]), 2) if n > 1 else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--fork")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--config", default="cpu")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--fake", action="store_true", help="the fake engine (the gateway's cost alone)")
    ap.add_argument("--no-direct", action="store_true")
    args = ap.parse_args()

    if args.fake:
        import tempfile

        model, fork = tiny_model(Path(tempfile.mkdtemp()))
        server = FakeServer(model, fork, step_ms=0)
    else:
        from bankml import default_model

        model = args.model or str(default_model.default_model_path())
        fork = args.fork or str(default_model.shipped_fork_path())
        server = CliServer(["bankml"], model, "--fork", fork, "--ctx", str(args.ctx), "--config", args.config)
    try:
        result = {"model": Path(model).name, "engine": "fake" if args.fake else "native",
                  "health": bench_health(server.port, args.requests, args.clients),
                  "stream": bench_stream(server.port, args.tokens)}
    finally:
        server.stop()
    if not args.fake and not args.no_direct:
        result["engine_direct"] = bench_direct(model, args.ctx, args.tokens)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
