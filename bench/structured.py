"""Constrained against unconstrained decoding: ours against llama-server, same model, same run. Prints JSON.

    python bench/structured.py [--levels 1,8] [--tokens 128] [--repeats 3] [--threads N] [--ctx 1024]
                               [--no-llama] [--llama-args=--no-repack] [--out FILE]

For each level N (1 and 8 by default), N streaming clients start together, each asking for one JSON
object that fills `--tokens` (a list of records, so the grammar never completes early), greedy:
- `plain`: `response_format` absent, the same prompt;
- `schema`: `response_format: {"type": "json_schema", ...}` with SCHEMA (for llama-server, its own
  `json_schema` field, which its server-task.cpp `params_from_json_cmpl` turns into a grammar).
Each pair is run `--repeats` times, alternating, and the medians are kept. Per level and mode:
aggregate tokens/s (completion tokens from the usage chunk over first-sent to last-done), and for
ours the grammar's host cost per token from GET /bankml/metrics (`grammar_ms` over `completion_tokens`
of the records the level added). `ratio` is schema over plain; the goal is >= 0.90 (issue 16).

Ours is one `bankml serve --native` with `[engine] max_seqs = max(levels)`; llama-server starts once with
`-np max(levels)` at its defaults otherwise, after ours has stopped, so the two never share the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from concurrency import LlamaServer, llama_binary, seqs_key, wait_compiled  # noqa: E402
from gateway_helpers import CliServer  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "city": {"type": "string"},
                    "role": {"type": "string", "enum": ["engineer", "teacher", "doctor", "artist"]},
                },
                "required": ["name", "age", "city", "role"],
            },
        },
    },
    "required": ["people"],
}


def prompt(k: int) -> list[dict]:
    return [{"role": "user", "content": f"Request {k}: list fifty people as JSON, each with a name, an age, "
                                        "a city and a role."}]


def body(k: int, tokens: int, mode: str, peer: bool) -> dict:
    b = {"messages": prompt(k), "stream": True, "temperature": 0, "max_tokens": tokens,
         "stream_options": {"include_usage": True}}
    if mode == "schema":
        if peer:
            b["json_schema"] = SCHEMA
        else:
            b["response_format"] = {"type": "json_schema",
                                    "json_schema": {"name": "people", "schema": SCHEMA, "strict": True}}
    return b


async def _stream(client, url: str, payload: dict, go: asyncio.Event) -> tuple[int, str | None]:
    await go.wait()
    tokens, chunks = None, 0
    async with client.stream("POST", url, json=payload) as r:
        if r.status_code != 200:
            return 0, f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            choices = event.get("choices") or []
            if choices and choices[0].get("delta", {}).get("content"):
                chunks += 1
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return (tokens if tokens is not None else chunks), None


async def _level(base: str, payloads: list[dict]) -> dict:
    import httpx

    go = asyncio.Event()
    limits = httpx.Limits(max_connections=len(payloads) + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        tasks = [asyncio.create_task(_stream(client, base + "/v1/chat/completions", p, go)) for p in payloads]
        await asyncio.sleep(0.05)  # every task is waiting on the event
        t0 = time.perf_counter()
        go.set()
        done = await asyncio.gather(*tasks)
        wall_s = time.perf_counter() - t0
    errors = [e for _, e in done if e]
    tokens = sum(t for t, _ in done)
    return {"tokens": tokens, "wall_s": wall_s, "tokens_per_s": tokens / wall_s if wall_s else None,
            "errors": errors}


def grammar_records(base: str) -> list[dict]:
    import httpx

    return httpx.get(base + "/bankml/metrics", timeout=30).json()["records"]


def measure(base: str, levels: list[int], tokens: int, repeats: int, peer: bool, who: str) -> dict:
    out, k = {}, 0
    for n in levels:
        runs: dict[str, list[float]] = {"plain": [], "schema": []}
        grammar_ms, grammar_tokens, errors = 0.0, 0, []
        asyncio.run(_level(base, [body(k + i, 8, "schema", peer) for i in range(n)]))  # warm: compiles, masks
        k += n
        for _ in range(repeats):
            for mode in ("plain", "schema"):
                before = None if peer else len(grammar_records(base))
                r = asyncio.run(_level(base, [body(k + i, tokens, mode, peer) for i in range(n)]))
                k += n
                errors += r["errors"]
                if r["tokens_per_s"]:
                    runs[mode].append(r["tokens_per_s"])
                if not peer and mode == "schema":
                    # the ring keeps 256; a level adds n records, read the newest n
                    added = grammar_records(base)[-n:] if before is not None else []
                    grammar_ms += sum(rec.get("grammar_ms") or 0.0 for rec in added)
                    grammar_tokens += sum(rec.get("completion_tokens") or 0 for rec in added)
        plain = statistics.median(runs["plain"]) if runs["plain"] else None
        schema = statistics.median(runs["schema"]) if runs["schema"] else None
        level = {"clients": n, "plain_tokens_per_s": _r(plain), "schema_tokens_per_s": _r(schema),
                 "ratio": _r(schema / plain, 3) if plain and schema else None,
                 "runs": {m: [_r(x) for x in v] for m, v in runs.items()}}
        if not peer:
            level["grammar_ms_per_token"] = _r(grammar_ms / grammar_tokens, 4) if grammar_tokens else None
        if errors:
            level["errors"] = errors[:5]
        out[str(n)] = level
        print(f"{who} {n} clients: plain {level['plain_tokens_per_s']} tok/s, schema {level['schema_tokens_per_s']} "
              f"tok/s, ratio {level['ratio']}", file=sys.stderr, flush=True)
    return out


def _r(x: float | None, digits: int = 2) -> float | None:
    return None if x is None else round(x, digits)


def run_ours(args, levels: list[int]) -> dict:
    from bankml import default_model

    model = Path(args.model or default_model.default_model_path())
    fork = Path(args.fork) if args.fork else default_model.shipped_fork_path()
    config_toml = f"[engine]\n{seqs_key(None)} = {max(levels)}\n"
    with tempfile.TemporaryDirectory(prefix="bankml-structured-") as tmp:
        config = Path(tmp) / "structured.toml"
        config.write_text(config_toml)
        server = CliServer(["bankml"], str(model), "--fork", str(fork), "--ctx", str(args.ctx), "--config", str(config),
                           timeout_s=args.start_timeout)
        try:
            compiled = wait_compiled(server, args.start_timeout)
            return {"config": config_toml, "background_compile": compiled,
                    "levels": measure(server.url(), levels, args.tokens, args.repeats, False, "ours")}
        except Exception:
            print(server.log()[-4000:], file=sys.stderr)
            raise
        finally:
            server.stop()


def run_peer(args, levels: list[int]) -> dict:
    from bankml.default_model import default_model_path

    model = Path(args.model or default_model_path())
    binary = llama_binary(args.llama_bin)
    extra = args.llama_args.split()
    crashed = None
    try:
        server = LlamaServer(binary, model, max(levels), args.ctx, args.threads, extra)
    except RuntimeError as e:
        if "--no-repack" in extra:
            raise
        # its repacked CPU kernels die on some machines (this one: SIGSEGV at start): say so, and run the
        # configuration that starts, the weights as they are in the file
        crashed = {"args": extra, "error": str(e)[-1500:]}
        print(f"llama-server at its defaults did not start ({str(e).splitlines()[0]}); again with --no-repack",
              file=sys.stderr, flush=True)
        extra = [*extra, "--no-repack"]
        server = LlamaServer(binary, model, max(levels), args.ctx, args.threads, extra)
    try:
        return {"binary": binary, "cmd": server.cmd, "defaults_crashed": crashed,
                "levels": measure(server.url(), levels, args.tokens, args.repeats, True, "llama-server")}
    finally:
        server.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--fork", help="the model's FORK.json (default: the shipped one, for the default model)")
    p.add_argument("--levels", default="1,8")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--start-timeout", type=float, default=1800)
    p.add_argument("--llama-bin")
    p.add_argument("--llama-args", default="")
    p.add_argument("--no-llama", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    result = {"bench": "structured", "machine": platform.machine(), "cpus": os.cpu_count(),
              "tokens": args.tokens, "repeats": args.repeats, "schema": SCHEMA, "goal_ratio": 0.9,
              "ours": run_ours(args, levels)}
    if not args.no_llama:
        result["llama_server"] = run_peer(args, levels)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
