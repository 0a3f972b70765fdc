"""Tensor parallelism on simulated CPU devices: what splitting a model N ways costs a decode step, what
it saves each device in bytes, and which collectives the step runs. Prints JSON.

    python bench/parallel.py [--tp 1,2,4] [--batches 1,4] [--layers 2] [--window-pages 4] [--page-size 16]
                             [--steps 3] [--rounds 5] [--warmup 2] [--layout packed[,device]]
                             [--model-dir DIR] [--out FILE]

The model is bench/synth_gguf.py's llama3-8b (random weights in Q4_K_M's mix, the 8B's widths and
128256-token vocabulary) cut to --layers layers (2: 0.99 GB, most of it the embeddings and output
matrix). It is written to --model-dir (default: a temporary folder, removed at the end), or taken from
there when a finished file (with its FORK.json) is already there, and passes the gate (bankml.verify)
before it is loaded.

The N devices are XLA's simulated host devices: the script sets
XLA_FLAGS=--xla_force_host_platform_device_count=max(4, largest N) before JAX is imported, unless
XLA_FLAGS is already set (then it is used as it is, and an N beyond its devices is reported refused).

For each layout (packed, the CPU default; device with --layout device, slow on a CPU) and each N:
N = 1 is the engine's unsplit path (`tensor_parallel` 1: no mesh); N > 1 is `parallel.make(config, N)`
and `parallel.shard_weights`, as `bankml serve --tensor-parallel N` loads it.
- weight_bytes_per_device: `parallel.per_device_bytes` of the weights, by device;
- for each batch B, one decode step (one new token a row, `forward` with the pool donated, each row
  attending to its own --window-pages pages of --page-size cells, the new token at the window's last
  cell): kv_pool_bytes_per_device (`init_pool(config, B * window pages, page size, "f16", plan)`),
  step_ms (the median of --rounds x --steps timed steps after --warmup, each ended by
  `jax.block_until_ready`; every sample is kept; every cell of the layout is compiled first, then the
  cells take turns, --steps each, --rounds times, so a shared machine's drift falls on all alike),
  busy_cores (the process's CPU time over the wall time of those steps: how many cores the step kept
  busy; load_avg_1m_by_round says what else ran), and the collectives of that compiled program, read from its HLO as
  tests/parallel_probe.py reads them: all_reduces / all_gathers, the ops in the HLO text (the packed
  layout's layers run under one lax.scan: its body's ops are written once), and *_per_step, the ops
  run per step (a while loop's body counted its known trip count times);
- ratios against N = 1: step_ms(N)/step_ms(1) per batch, with the median over batches, and
  weight / KV bytes of the fullest device (N) over the one device's (1).

What this does not show: simulated devices are threads of one process sharing this machine's cores and
memory, so step_ms(N)/step_ms(1) is not the speed-up of N GPUs. It is splitting's overhead (collectives,
smaller matmuls, shard_map) against whatever the CPU backend gains from running N shares on their own
threads. On 2 vCPUs (bench/results/2026-12-06-cpu-parallel.json) the split steps came out faster: the
unsplit packed step keeps about 1.5 cores busy, the split ones about 1.9, and the CPU time of a step fell
as well (batch 1: 535 core-ms unsplit, 302 split 4 ways), so on this backend each share's smaller
matrices also cost less per weight byte; none of that carries over to GPUs. The goal (a TP = 2 decode
step at least 1.6x faster than TP = 1 for an 8B Q4_K_M) needs a machine with several GPUs; it is not
measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

SHAPE = "llama3-8b"
NOTE = ("The N devices are XLA's simulated host devices (xla_force_host_platform_device_count): threads of "
        "one process sharing the same {cpus} cores and the same memory, so step time here does not show a "
        "real multi-GPU speed-up. step_ms(N)/step_ms(1) is what splitting does on this CPU: its overhead "
        "(collectives, shard_map, smaller matmuls) against the cores one device's step leaves idle "
        "(busy_cores) -- a ratio below 1 here is the CPU backend's, not N devices' bandwidth. The goal, a "
        "TP=2 decode step at least 1.6x faster than TP=1 for an 8B Q4_K_M, needs a machine with several "
        "GPUs and is not measured here. Bytes per device and collective counts are what a GPU mesh would "
        "hold and run.")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def set_devices(n: int) -> str:
    """XLA_FLAGS for `n` simulated CPU devices, unless the caller set XLA_FLAGS; before JAX is imported."""
    if "jax" in sys.modules:
        raise RuntimeError("bench/parallel.py must set XLA_FLAGS before JAX is imported")
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={n}")
    return os.environ["XLA_FLAGS"]


def model_file(model_dir: Path, layers: int) -> tuple[Path, dict]:
    """The synthetic model in `model_dir`: reused when a finished one is there, else written."""
    import synth_gguf

    path = model_dir / f"{SHAPE}-{layers}l.gguf"
    fork = path.with_name(path.name + ".FORK.json")
    reused = path.exists() and fork.exists()  # write() makes both whole or neither
    t0 = time.perf_counter()
    if not reused:
        synth_gguf.write(path, SHAPE, layers=layers)
    return path, {"path": str(path), "bytes": path.stat().st_size, "shape": SHAPE, "layers": layers,
                  "reused": reused, "write_s": None if reused else round(time.perf_counter() - t0, 2)}


def collectives(hlo: str, op: str) -> tuple[int, int]:
    """(ops in the HLO text, ops run per step): an op inside a while loop's body counts its known trip
    count times (the scanned layers), elsewhere once."""
    pattern = re.compile(rf"= \S+ {op}(?:-start)?\(")
    per_computation: dict[str, int] = {}
    name = None
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            name = head.group(1)
        elif name is not None and pattern.search(line):
            per_computation[name] = per_computation.get(name, 0) + 1
    trips = {}
    for m in re.finditer(r"while\(.*?body=%?([\w.\-]+).*?known_trip_count\":\{\"n\":\"(\d+)\"", hlo):
        trips[m.group(1)] = int(m.group(2))
    text = sum(per_computation.values())
    return text, sum(c * trips.get(comp, 1) for comp, c in per_computation.items())


@dataclass
class Cell:
    """One (N, batch) decode step, compiled, with its inputs and pool, and its timings so far."""

    n: int
    batch: int
    weights: object
    step: object  # the compiled `forward`: its pool is donated and replaced after each call
    pool: object
    inputs: tuple
    result: dict
    times_s: list[float] = field(default_factory=list)
    cpu_s: float = 0.0


def prepare(weights, config, plan, n: int, batch: int, args) -> Cell:
    """One batch's decode step on `weights` (split by `plan`, or whole): its pool, its compiled program,
    the collectives in that program, then --warmup untimed steps."""
    import jax
    import numpy as np

    from model import parallel
    from model.forward import forward
    from model.kvcache import init_pool

    w, page = args.window_pages, args.page_size
    pool = init_pool(config, batch * w, page, "f16", plan)
    tokens = np.full((batch, 1), 1000, np.int32)  # [B, 1]
    table = np.arange(batch * w, dtype=np.int32).reshape(batch, w)  # [B, Wp]: row b's own pages
    starts = np.full(batch, w * page - 1, np.int32)  # the new token at the window's last cell
    n_new = np.ones(batch, np.int32)
    inputs = tuple(jax.device_put(a) for a in (tokens, table, starts, n_new))

    t0 = time.perf_counter()
    step = forward.lower(weights, pool, *inputs, config=config, window_pages=w).compile()
    compile_s = time.perf_counter() - t0
    hlo = step.as_text()
    reduces, reduces_run = collectives(hlo, "all-reduce")
    gathers, gathers_run = collectives(hlo, "all-gather")
    result = {"batch": batch, "compile_s": round(compile_s, 2),
              "kv_pool_bytes_per_device": parallel.per_device_bytes(pool),
              "all_reduces": reduces, "all_reduces_per_step": reduces_run,
              "all_gathers": gathers, "all_gathers_per_step": gathers_run}
    cell = Cell(n, batch, weights, step, pool, inputs, result)
    for _ in range(args.warmup):
        run_steps(cell, 1, timed=False)
    return cell


def run_steps(cell: Cell, k: int, timed: bool = True) -> None:
    import jax

    for _ in range(k):
        t0, c0 = time.perf_counter(), time.process_time()
        logits, cell.pool = cell.step(cell.weights, cell.pool, *cell.inputs)
        jax.block_until_ready(logits)
        if timed:
            cell.times_s.append(time.perf_counter() - t0)
            cell.cpu_s += time.process_time() - c0
    cell.result["logits_finite"] = bool(jax.numpy.isfinite(logits).all())


def finish(cell: Cell) -> dict:
    times = cell.times_s
    return {**cell.result, "step_ms": round(statistics.median(times) * 1e3, 2),
            "step_ms_samples": [round(t * 1e3, 2) for t in times], "busy_cores": round(cell.cpu_s / sum(times), 2)}


def one_n(whole, config, n: int, args) -> tuple[dict, list[Cell]]:
    """Split `whole` `n` ways (n = 1: the unsplit path) and prepare each batch's step."""
    import jax

    from model import parallel

    devices = jax.devices()
    if why := parallel.refusal(config, n, len(devices), devices[0].platform):
        return {"tp": n, "refused": why}, []
    t0 = time.perf_counter()
    plan = None if n == 1 else parallel.make(config, n)
    weights = whole if plan is None else parallel.shard_weights(whole, config, plan)
    jax.block_until_ready(weights)
    out: dict = {"tp": n, "shard_s": round(time.perf_counter() - t0, 2),
                 "mesh": None if plan is None else plan.describe(),
                 "weight_bytes_per_device": parallel.per_device_bytes(weights), "batches": []}
    return out, [prepare(weights, config, plan, n, b, args) for b in args.batches]


def ratios(runs: list[dict]) -> dict:
    """Each N against N = 1: step time per batch (and the median over batches), bytes of the fullest device."""
    base = next((r for r in runs if r["tp"] == 1 and "refused" not in r), None)
    if base is None:
        return {"skipped": "no tp 1 run to compare with"}
    out = {}
    for r in runs:
        if r["tp"] == 1 or "refused" in r:
            continue
        pairs = list(zip(r["batches"], base["batches"], strict=True))  # the same batches, in order
        steps = {str(c["batch"]): round(c["step_ms"] / b["step_ms"], 3) for c, b in pairs}
        kv = {str(c["batch"]): round(max(c["kv_pool_bytes_per_device"].values())
                                     / max(b["kv_pool_bytes_per_device"].values()), 4) for c, b in pairs}
        out[str(r["tp"])] = {
            "step_ms_ratio_by_batch": steps, "step_ms_ratio_median": round(statistics.median(steps.values()), 3),
            "weight_bytes_ratio": round(max(r["weight_bytes_per_device"].values())
                                        / max(base["weight_bytes_per_device"].values()), 4),
            "kv_pool_bytes_ratio_by_batch": kv}
    return out


def machine() -> dict:
    import jax

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpus": os.cpu_count(), "cpu": cpu, "load_avg_1m": os.getloadavg()[0],
            "python": platform.python_version(), "jax": jax.__version__, "platform": jax.default_backend(),
            "devices": len(jax.devices()), "xla_flags": os.environ.get("XLA_FLAGS", "")}


def run_layout(path: Path, layout: str, args) -> dict:
    from model.weights import load_weights

    t0 = time.perf_counter()
    config, whole = load_weights(path, verified=True, layout=layout)
    out: dict = {"load_s": round(time.perf_counter() - t0, 2),
                 "config": {"n_layer": config.n_layer, "n_embd": config.n_embd, "n_ff": config.n_ff,
                            "n_head": config.n_head, "n_head_kv": config.n_head_kv, "n_vocab": config.n_vocab},
                 "runs": []}
    cells: list[Cell] = []
    for n in args.tp:
        run, prepared = one_n(whole, config, n, args)
        out["runs"].append(run)
        cells += prepared
    # every cell in turn, --rounds times: a drift of a shared machine's speed falls on all of them alike
    out["load_avg_1m_by_round"] = []  # other work on the machine: the simulated devices' cores are its cores
    for r in range(args.rounds):
        out["load_avg_1m_by_round"].append(round(os.getloadavg()[0], 2))
        for cell in cells:
            run_steps(cell, args.steps)
        print(f"parallel: {layout} round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    by_n = {run["tp"]: run for run in out["runs"]}
    for cell in cells:
        got = finish(cell)
        by_n[cell.n]["batches"].append(got)
        print(f"parallel: {layout} tp {cell.n} batch {cell.batch}: {got['step_ms']} ms a step "
              f"({got['busy_cores']} cores busy), all-reduce {got['all_reduces']} ({got['all_reduces_per_step']} "
              f"run), all-gather {got['all_gathers']}", file=sys.stderr, flush=True)
    out["ratios"] = ratios(out["runs"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", default="1,2,4", help="device counts, comma-separated (default 1,2,4)")
    ap.add_argument("--batches", default="1,4", help="decode batch sizes, comma-separated (default 1,4)")
    ap.add_argument("--layers", type=int, default=2, help="layers of the synthetic llama3-8b (default 2)")
    ap.add_argument("--window-pages", type=int, default=4, help="pages each row attends to (default 4)")
    ap.add_argument("--page-size", type=int, default=16, help="cells a page (default 16, the engine's)")
    ap.add_argument("--steps", type=int, default=3, help="timed decode steps per cell and round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds over every cell (the median of all its steps "
                                                          "is reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed decode steps before them")
    ap.add_argument("--layout", default="packed", help="packed (the CPU default), device, or both: packed,device")
    ap.add_argument("--model-dir", type=Path, help="where the synthetic model is written or found "
                                                   "(default: a temporary folder, removed at the end)")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    args.tp, args.batches = _ints(args.tp), _ints(args.batches)
    layouts = [x.strip() for x in args.layout.split(",") if x.strip()]
    if not args.tp or min(args.tp) < 1 or not args.batches or min(args.batches) < 1:
        ap.error("--tp and --batches: positive integers, comma-separated")
    if not set(layouts) <= {"packed", "device"} or not layouts:
        ap.error("--layout: packed, device, or packed,device")
    if args.window_pages < 1 or args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        ap.error("--window-pages, --steps and --rounds must be at least 1, --warmup at least 0")
    set_devices(max(4, *args.tp))

    from bankml.verify import verify

    with tempfile.TemporaryDirectory(prefix="bankml-parallel-") as tmp:
        model_dir = args.model_dir or Path(tmp)
        model_dir.mkdir(parents=True, exist_ok=True)
        path, model = model_file(model_dir, args.layers)
        t0 = time.perf_counter()
        verify(path, path.with_name(path.name + ".FORK.json").read_text())
        model["verify_s"] = round(time.perf_counter() - t0, 2)
        result: dict = {"machine": machine(), "model": model,
                        "decode": {"tokens_per_row": 1, "window_pages": args.window_pages, "page_size": args.page_size,
                                   "kv_cache": "f16", "steps": args.steps, "rounds": args.rounds,
                                   "warmup": args.warmup},
                        "tp": args.tp, "batches": args.batches, "layouts": {}}
        result["note"] = NOTE.format(cpus=result["machine"]["cpus"])
        for layout in layouts:
            result["layouts"][layout] = run_layout(path, layout, args)
    result["machine"]["load_avg_1m_end"] = os.getloadavg()[0]
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
