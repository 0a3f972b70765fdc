"""Where a Triton attention kernel and its twin disagree on a device, and which of the two is off.

    python bench/gpu_attention_diag.py OUT.json

The first GPU run (bench/results/2026-12-04-h200-run1-first-contact) found the decode and prefill kernels
within 1e-6 of their twins on most shapes but 2.5e-4 to 3.8e-4 off on a few (tests/test_gpu_kernels.py's
inputs; the same inputs agree to 1e-7 under Triton's interpreter on a CPU). This step showed why (run 2):
the side that was off, the kernel's wrapper or the twin on the device, had skipped the f16 rounding of the
new token's K/V, which XLA's GPU compiler drops as excess precision (fixed: kernels/kvquant.py
`round_f16`). It stays in the run: a regression shows at once which side moved. For those shapes it
compares three results: the kernel on the device, the twin on the device, and the twin on the CPU (plain
f32 arithmetic at HIGHEST precision, the reference); the element that differs most (row, head, dim) and
that row's start. And it probes whether the device flushes f16 subnormals when a kernel splits an f32
into hi + lo (`_split_f16`: the lo of a small value is an f16 subnormal). Rewritten after every case.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
sys.path.append(str(ROOT / "tests"))
sys.path.append(str(ROOT / "bench"))

# (op, H, Hkv, Dh, cache type): the cases that failed on the H200, and one that passed, for contrast
CASES = [("decode", 9, 3, 64, "q8_0"), ("decode", 32, 8, 128, "q8_0"), ("decode", 4, 1, 256, "f16"),
         ("prefill", 4, 1, 256, "f16"), ("decode", 32, 8, 128, "f16")]


def _where(diff: np.ndarray) -> dict:
    i = np.unravel_index(int(np.argmax(diff)), diff.shape)
    return {"index": [int(x) for x in i], "abs": float(diff[i])}


def compare(op: str, h: int, hkv: int, dh: int, cache_type: str) -> dict:
    import jax
    import test_gpu_kernels as t

    t.ON_GPU = True  # the GPU's shapes (16 pages a row) wherever this runs
    cpu = jax.devices("cpu")[0]
    if op == "decode":
        args, scales, scale = t._attention_inputs(h, hkv, dh, None, cache_type)
        kernel, twin, extra = t.kern.decode_attention, t.twin.decode_attention, ()
    else:
        args, scales, scale = t._attention_inputs(h, hkv, dh, 32, cache_type)
        n_new = jax.numpy.asarray(np.array([32, 17, 1, 0], np.int32))
        kernel, twin, extra = t.kern.prefill_attention, t.twin.prefill_attention, (n_new,)
    kw = dict(window=0, scale=scale, **scales)
    got = np.asarray(jax.jit(kernel, static_argnames=("window", "scale"))(*args, *extra, **kw), np.float64)
    twin_dev = np.asarray(twin(*args, *extra, **kw), np.float64)
    on_cpu = jax.device_put((args, extra, scales), cpu)
    with jax.default_device(cpu):
        ref = np.asarray(twin(*on_cpu[0], *on_cpu[1], window=0, scale=scale, **on_cpu[2]), np.float64)
    if op == "prefill":  # padding rows may hold anything finite
        valid = np.arange(32)[None, :] < np.array([32, 17, 1, 0])[:, None]
        got, twin_dev, ref = got[valid], twin_dev[valid], ref[valid]
    top = max(np.abs(ref).max(), 1e-30)
    out = {"case": f"{op} H={h} Hkv={hkv} Dh={dh} {cache_type}",
           "starts": [int(x) for x in np.asarray(args[7])]}
    for name, a, b in (("kernel_vs_cpu_twin", got, ref), ("device_twin_vs_cpu_twin", twin_dev, ref),
                       ("kernel_vs_device_twin", got, twin_dev)):
        d = np.abs(a - b)
        out[name] = {"max_rel_err": float(d.max() / top), **_where(d)}
    return out


def ftz_probe() -> dict:
    """Does an f32 -> f16 conversion in a compiled kernel keep f16 subnormals (numpy's answer) or flush them?"""
    import jax
    import jax.numpy as jnp
    import triton
    import triton.language as tl

    from kernels.triton.call import triton_call

    @triton.jit
    def split_lo(x_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        x = tl.load(x_ptr + i)
        hi = x.to(tl.float16)
        tl.store(out_ptr + i, (x - hi.to(tl.float32)).to(tl.float16).to(tl.float32))

    x = np.array([1 + 2.0**-20, 0.01 * (1 + 2.0**-19), 1e-3 * (1 + 2.0**-18), 0.3 * (1 + 2.0**-21)] * 4, np.float32)
    got = np.asarray(triton_call(jnp.asarray(x), kernel=split_lo, out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32),
                                 grid=(1,), N=16))
    hi = x.astype(np.float16)
    want = (x - hi.astype(np.float32)).astype(np.float16).astype(np.float32)
    return {"x": x[:4].tolist(), "lo_device": got[:4].tolist(), "lo_numpy": want[:4].tolist(),
            "subnormals_kept": bool(np.array_equal(got, want))}


def gemv_bandwidth() -> dict:
    """Llama 3 8B's FFN matrices in Q4_K at M = 1 (the decode GEMV): the Triton kernel and the jnp twin,
    each the median of 20 back-to-back calls, as bytes of weight read per second."""
    import jax
    import jax.numpy as jnp

    from kernels.qlayout import qmatmul_ref, random_raw, to_qweight
    from kernels.triton.call import on_gpu
    from kernels.triton.qmatmul import qmatmul

    if not on_gpu():  # the interpreter takes minutes a call at these sizes, and its time says nothing
        return {"skipped": "not on a GPU"}
    out = {}
    for n, k in ((14336, 4096), (4096, 14336)):
        w = to_qweight(random_raw(12, n, k, seed=3), 12, n, k)
        nbytes = sum(int(p.nbytes) for p in w.planes)
        x = jnp.asarray(np.random.default_rng(0).standard_normal((1, k)), jnp.float32)
        for name, fn in (("triton", jax.jit(qmatmul)), ("jnp", jax.jit(qmatmul_ref))):
            jax.block_until_ready(fn(x, w))
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(x, w))
                times.append(time.perf_counter() - t0)
            med = float(np.median(times))
            out[f"{name} N={n} K={k}"] = {"us": med * 1e6, "bytes": nbytes, "gb_per_s": nbytes / med / 1e9}
    return out


def main() -> int:
    out_path = Path(sys.argv[1])
    doc: dict = {"diag": "attention kernel vs twin", "cases": []}

    def save() -> None:
        out_path.write_text(json.dumps(doc, indent=1) + "\n")

    for name, fn in (("ftz_probe", ftz_probe), ("gemv_bandwidth", gemv_bandwidth)):
        try:
            doc[name] = fn()
        except Exception as e:  # noqa: BLE001 -- a probe that fails says why; the cases still run
            doc[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
        save()
    for case in CASES:
        t0 = time.perf_counter()
        try:
            row = compare(*case)
        except Exception as e:  # noqa: BLE001
            row = {"case": str(case), "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
        row["seconds"] = round(time.perf_counter() - t0, 2)
        doc["cases"].append(row)
        save()
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
