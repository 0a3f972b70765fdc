"""Load-time dequantization throughput, printed as JSON.

    python bench/dequant.py [--melems 16] [--model PATH ...] [--gguf-baseline]

Per type it prints Melem/s for both the numpy load path and the jitted JAX reference, each measured end to
end from raw bytes to a jax.Array on the default device (best of --repeats). For each --model it prints
the wall seconds to dequantize every tensor through kernels.dequant.dequantize. Two passes are timed,
because on a fresh VM the first touch of guest memory is slow. With --gguf-baseline it also times
gguf.quants.dequantize over the same tensors.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import gguf
import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.dequant import SUPPORTED_TYPES, dequant_path, dequantize  # noqa: E402
from kernels.dequant_ref import BLOCK_LAYOUT  # noqa: E402


def _best_s(repeats: int, *args, **kwargs) -> float:
    """Best wall seconds of `dequantize(*args, **kwargs)` into a ready jax.Array."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = dequantize(*args, **kwargs)
        jax.block_until_ready(out)
        best = min(best, time.perf_counter() - start)
        del out
    return best


def bench_types(n_elements: int, repeats: int) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(0)
    results = {}
    for ggml_type, name in SUPPORTED_TYPES.items():
        block_size, type_size = BLOCK_LAYOUT[ggml_type]
        ne0 = 4096
        rows = n_elements // ne0
        raw = rng.integers(0, 256, rows * ne0 // block_size * type_size, dtype=np.uint8)
        if ggml_type == 0:
            raw = rng.standard_normal(rows * ne0).astype(np.float32).view(np.uint8)
        row = {}
        with np.errstate(all="ignore"):
            for backend in ("cpu", "gpu"):
                label = dequant_path(backend)
                jax.block_until_ready(dequantize(raw, ggml_type, (ne0, rows), backend=backend))  # compile
                seconds = _best_s(repeats, raw, ggml_type, (ne0, rows), backend=backend)
                row[f"{label}_melem_per_s"] = round(rows * ne0 / seconds / 1e6, 1)
        results[name] = row
    return results


def bench_model(path: Path, gguf_baseline: bool) -> dict[str, object]:
    start = time.perf_counter()
    tensors = gguf.GGUFReader(path).tensors
    report: dict[str, object] = {
        "reader_s": round(time.perf_counter() - start, 2),
        "elements": int(sum(t.n_elements for t in tensors)),
        "path": dequant_path(),
    }
    for pass_no in (1, 2):
        start = time.perf_counter()
        slowest = (0.0, "")
        for t in tensors:
            t0 = time.perf_counter()
            jax.block_until_ready(dequantize(t.data, int(t.tensor_type), t.shape, name=t.name))
            slowest = max(slowest, (time.perf_counter() - t0, t.name))
        report[f"pass{pass_no}_s"] = round(time.perf_counter() - start, 2)
        report[f"pass{pass_no}_slowest"] = {"tensor": slowest[1], "s": round(slowest[0], 3)}
    if gguf_baseline:
        start = time.perf_counter()
        for t in tensors:
            gguf.quants.dequantize(t.data, t.tensor_type)
        report["gguf_py_s"] = round(time.perf_counter() - start, 2)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--melems", type=float, default=16, help="elements per type, in millions")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", type=Path, action="append", default=[])
    parser.add_argument("--gguf-baseline", action="store_true")
    parser.add_argument("--skip-types", action="store_true")
    args = parser.parse_args()
    out: dict[str, object] = {"backend": jax.default_backend()}
    if not args.skip_types:
        out["types"] = bench_types(int(args.melems * 1e6) // 4096 * 4096, args.repeats)
    out["models"] = {p.name: bench_model(p, args.gguf_baseline) for p in args.model}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
