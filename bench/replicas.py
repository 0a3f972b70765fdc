"""Replicas on Ray Serve (bankml/ray_app.py) through Ray's HTTP proxy. Prints JSON.

    python bench/replicas.py [--model FILE --fork FORK.json] [--clients 8,16] [--rounds 2]
                             [--max-tokens 8] [--latency-n 40] [--out FILE]

A local Ray node with two CPUs (started by this script, stopped at its end); each replica's
`bankml serve --native` child is pinned to one core of its own (every thread, sched_setaffinity), so
"each replica one CPU" holds for the engine, not only for Ray's bookkeeping. Three deployments in turn:
one replica; two with prefix-cache affinity (routing=affinity); two with Ray's power of two choices
(routing=pow2). For each, at each client count, two prompt sets:
- shared: one ~140-token system prompt for every client, a user message of each client's own;
- distinct: a system prompt of each client's own (they differ from their first characters).
Every client sends --rounds streamed greedy chats one after the other (round 2 repeats its system
prompt with another question: what a cache on the right replica saves). Per run: aggregate completion
tokens/s (usage chunks over the wall time), TTFT p50/p95 (request sent -> first text chunk), each
replica's share of the requests, the share of each client's later rounds that landed on the replica
of its first (`later_rounds_on_first_replica`), and each replica's prefix-cache hit rate over the run
(each child's own GET /metrics, bankml_prefix_cache_hits_total over bankml_prefix_cache_queries_total,
read before and after). No run reuses another's prompts (a tag of the run leads every system prompt).
The system prompt is longer than the affinity key (`prefix_chars`, 512 characters), so the key is the
system prompt alone: with affinity, a shared one goes to one replica until that replica has
`affinity_bound` (4, the children's max_seqs) answers under way; then the overflow goes to the other.

The proxy's added latency: small requests (GET /health, and a 1-token chat), alternating through Ray's
proxy and straight to the one replica's own child (a bare `bankml serve --native`, the same process),
medians and the difference; and what Ray's own hops cost with none of ours (`ray_alone`: a deployment
that answers "ok", and one that streams a second deployment's answer, as the ingress does a replica's).
The clients share the two cores with everything else.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from bankml.default_model import default_model_path, shipped_fork_path  # noqa: E402
from bankml.replica import free_port  # noqa: E402

SYSTEM = ("You are a careful assistant for a small public library. Answer questions about opening hours, "
          "borrowing rules, late fees, room bookings, printing, interlibrary loans and children's events. "
          "Be brief and friendly, never invent a policy, and when you are unsure, say that the front desk "
          "can help. Opening hours are nine to six on weekdays and ten to four on Saturdays; the library is "
          "closed on Sundays and public holidays. Books are lent for three weeks and may be renewed twice. "
          "Late fees are ten cents a day, capped at five dollars; children's books carry no late fee. ")
QUESTIONS = ["Can I renew a book online?", "When do you open on Saturday?", "How much is a late fee?",
             "Can I book a study room?", "Do you print in colour?", "Is there a story time for kids?",
             "Can I borrow a laptop?", "How do interlibrary loans work?"]
METRIC = re.compile(r"^(bankml_prefix_cache_(?:hits|queries)_total) ([0-9.e+]+)$", re.M)


# --- one run -----------------------------------------------------------------------------------------


def chat(system: str, question: str, max_tokens: int) -> dict:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}


async def one_client(http: httpx.AsyncClient, url: str, bodies: list[dict]) -> list[dict]:
    out = []
    for body in bodies:
        t0 = time.perf_counter()
        ttft_ms, tokens, replica = None, 0, None
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            replica = r.headers.get("x-bankml-replica")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if ttft_ms is None and any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                    ttft_ms = (time.perf_counter() - t0) * 1000
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        out.append({"ttft_ms": ttft_ms, "tokens": tokens, "replica": replica, "status": r.status_code})
    return out


def kept(results: list[list[dict]]) -> float | None:
    """The share of a client's later requests that landed on the replica of its first (affinity's aim)."""
    later = [x["replica"] == per[0]["replica"] for per in results for x in per[1:]]
    return round(sum(later) / len(later), 3) if later else None


async def run_load(url: str, clients: int, rounds: int, max_tokens: int, tag: str, shared: bool) -> dict:
    def system(c: int) -> str:
        return f"[{tag}] {SYSTEM}" if shared else f"[{tag} desk {c}] {SYSTEM}"

    plans = [[chat(system(c), f"{QUESTIONS[(c + r) % len(QUESTIONS)]} (visitor {c}, visit {r})", max_tokens)
              for r in range(rounds)] for c in range(clients)]
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_client(http, url, p) for p in plans))
        wall_s = time.perf_counter() - t0
    flat = [x for per in results for x in per]
    ttfts = sorted(x["ttft_ms"] for x in flat if x["ttft_ms"] is not None)
    shares: dict[str, int] = {}
    for x in flat:
        shares[x["replica"]] = shares.get(x["replica"], 0) + 1
    return {"requests": len(flat), "errors": sum(x["status"] != 200 or x["ttft_ms"] is None for x in flat),
            "wall_s": round(wall_s, 2), "aggregate_tokens_per_s": round(sum(x["tokens"] for x in flat) / wall_s, 2),
            "ttft_ms_p50": round(statistics.median(ttfts), 1), "ttft_ms_p95": round(percentile(ttfts, 95), 1),
            "requests_by_replica": shares, "later_rounds_on_first_replica": kept(results)}


def percentile(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return float("nan")
    k = (len(sorted_values) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def prefix_counts(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    return {name: float(value) for name, value in METRIC.findall(text)}


def hit_rates(children: dict[str, dict], before: dict[str, dict]) -> dict[str, dict]:
    out = {}
    for rid, child in children.items():
        after = prefix_counts(child["port"])
        hits = after.get("bankml_prefix_cache_hits_total", 0) - before[rid].get("bankml_prefix_cache_hits_total", 0)
        queries = after.get("bankml_prefix_cache_queries_total", 0) - before[rid].get(
            "bankml_prefix_cache_queries_total", 0)
        out[rid] = {"hit_tokens": int(hits), "query_tokens": int(queries),
                    "hit_rate": round(hits / queries, 3) if queries else None}
    return out


# --- the deployments ---------------------------------------------------------------------------------


def deploy(serve, build, url: str, model: str, fork: str, replicas: int, routing: str) -> dict[str, dict]:
    """Deploy (or replace) the bench app; {replica id: {child_pid, port, core}}, each child pinned."""
    serve.run(build({"model": model, "fork": fork, "replicas": str(replicas), "routing": routing,
                     "flags": "--config cpu --ctx 1024"}), name="bench", route_prefix="/")
    handle = serve.get_deployment_handle("Replica", "bench")
    children: dict[str, dict] = {}
    for _ in range(200):
        identity = handle.identity.remote().result(timeout_s=60)
        children[identity["replica"]] = identity
        if len(children) == replicas:
            break
    for core, (_rid, child) in enumerate(sorted(children.items())):
        child["core"] = core
        pin_threads(child["child_pid"], core)
    # the ingress's router learns of new replicas a little after serve.run returns: until it has them
    # all, a key's requests go to the replicas it knows, and then move (a first run's numbers, skewed)
    seen: set[str] = set()
    for _ in range(400):
        seen.add(httpx.get(url + "/health", timeout=30).headers.get("x-bankml-replica", ""))
        if seen >= set(children):
            break
    return children


def pin_threads(pid: int, core: int) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:
            pass  # a thread that ended meanwhile


def warm(url: str, children: dict[str, dict], max_tokens: int) -> None:
    for child in children.values():  # every bucket a run will use, on every replica, straight to its child
        for n in (1, 4, 4, 8):
            async def burst(port=child["port"], n=n):
                async with httpx.AsyncClient(timeout=600) as http:
                    await asyncio.gather(*(one_client(http, f"http://127.0.0.1:{port}",
                                                      [chat(f"warm {port} {n} {i} {SYSTEM}", QUESTIONS[i % 8],
                                                            max_tokens)])
                                           for i in range(n)))
            asyncio.run(burst())


def latency(url: str, child_port: int, n: int) -> dict:
    """Small requests alternating through the proxy and straight to the child: medians, in ms."""
    direct = f"http://127.0.0.1:{child_port}"
    out: dict[str, dict] = {}
    with httpx.Client(timeout=60) as http:
        for name, send in (("get_health", lambda base: http.get(base + "/health")),
                           ("chat_1_token", lambda base: http.post(base + "/v1/chat/completions", json={
                               "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                               "temperature": 0}))):
            times: dict[str, list[float]] = {"proxy": [], "direct": []}
            for i in range(n + 2):
                for where, base in (("proxy", url), ("direct", direct)):
                    t0 = time.perf_counter()
                    assert send(base).status_code == 200
                    if i >= 2:  # the first two pairs warm the connections
                        times[where].append((time.perf_counter() - t0) * 1000)
            p, d = statistics.median(times["proxy"]), statistics.median(times["direct"])
            out[name] = {"proxy_ms_p50": round(p, 2), "direct_ms_p50": round(d, 2), "added_ms_p50": round(p - d, 2),
                         "n": n}
    return out


def ray_floor(serve, url: str, child_port: int, n: int) -> dict:
    """What Ray's own hops cost with none of ours: GET through the proxy to a deployment that answers
    "ok" (one hop), and to one that asks a second deployment for its answer as a stream, as the ingress
    asks a replica (two hops); medians against the same child's GET /health straight, in ms."""
    from starlette.responses import PlainTextResponse

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Leaf:
        async def stream(self):
            yield b"ok"

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Front:
        def __init__(self, leaf=None):
            self.leaf = leaf.options(stream=True) if leaf is not None else None

        async def __call__(self, request):
            if self.leaf is None:
                return PlainTextResponse("ok")
            return PlainTextResponse(b"".join([c async for c in self.leaf.stream.remote()]))

    serve.run(Front.bind(), name="floor1", route_prefix="/floor1")
    serve.run(Front.options(name="Front2").bind(Leaf.bind()), name="floor2", route_prefix="/floor2")
    direct = f"http://127.0.0.1:{child_port}/health"
    times: dict[str, list[float]] = {"one_hop": [], "two_hops_streamed": [], "direct": []}
    try:
        with httpx.Client(timeout=60) as http:
            for i in range(n + 2):
                for where, target in (("one_hop", url + "/floor1"), ("two_hops_streamed", url + "/floor2"),
                                      ("direct", direct)):
                    t0 = time.perf_counter()
                    assert http.get(target).status_code == 200
                    if i >= 2:
                        times[where].append((time.perf_counter() - t0) * 1000)
    finally:
        serve.delete("floor1")
        serve.delete("floor2")
    d = statistics.median(times["direct"])
    return {name: {"ms_p50": round(statistics.median(v), 2), "added_ms_p50": round(statistics.median(v) - d, 2)}
            for name, v in times.items() if name != "direct"} | {"direct_ms_p50": round(d, 2), "n": n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--fork", default=None)
    ap.add_argument("--clients", default="8,16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--latency-n", type=int, default=40)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "2026-12-06-cpu-replicas.json"))
    a = ap.parse_args()
    assert len(SYSTEM) > 512, "the system prompt must outrun the affinity key"
    model = a.model or str(default_model_path(fetch=True))
    fork = a.fork or str(shipped_fork_path())
    levels = [int(x) for x in a.clients.split(",")]

    import ray
    from ray import serve

    from bankml.ray_app import app as build

    started, load_at_start = time.time(), list(os.getloadavg())
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    runs, proxy_latency = [], None
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        for replicas, routing in ((1, "affinity"), (2, "affinity"), (2, "pow2")):
            t0 = time.perf_counter()
            children = deploy(serve, build, url, model, fork, replicas, routing)
            deploy_s = time.perf_counter() - t0
            warm(url, children, a.max_tokens)
            if replicas == 1:
                proxy_latency = latency(url, next(iter(children.values()))["port"], a.latency_n)
                proxy_latency["ray_alone"] = ray_floor(serve, url, next(iter(children.values()))["port"],
                                                       a.latency_n)
            for clients in levels:
                for shared in (True, False):
                    tag = f"r{replicas}-{routing}-c{clients}-{'shared' if shared else 'distinct'}"
                    before = {rid: prefix_counts(c["port"]) for rid, c in children.items()}
                    result = asyncio.run(run_load(url, clients, a.rounds, a.max_tokens, tag, shared))
                    result["prefix_cache"] = hit_rates(children, before)
                    runs.append({"replicas": replicas, "routing": routing if replicas > 1 else "n/a (one replica)",
                                 "clients": clients, "prompts": "shared" if shared else "distinct",
                                 "deploy_s": round(deploy_s, 1), **result})
                    print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    report = {
        "bench": "bench/replicas.py", "date": time.strftime("%Y-%m-%d"), "ray": ray.__version__,
        "machine": {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_average_at_start": load_at_start, "load_average_at_end": list(os.getloadavg())},
        "model": os.path.basename(model), "setup": {
            "nodes": "one local Ray node, num_cpus=2", "replica": "num_cpus=1, its bankml serve child pinned to one "
            "core", "serve_flags": "--config cpu --ctx 1024", "rounds_per_client": a.rounds,
            "max_tokens": a.max_tokens, "stream": True, "temperature": 0},
        "proxy_latency": proxy_latency, "runs": runs, "total_s": round(time.time() - started, 1),
    }
    text = json.dumps(report, indent=1)
    print(text)
    Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
