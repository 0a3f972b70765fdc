"""The GPU run's first contact, in seconds: do Triton kernels run through JAX here, and through which call?

    python bench/gpu_smoke.py OUT.json          # on the device: each Triton target jaxlib registers
    python bench/gpu_smoke.py OUT.json --lower   # on a CPU: lower the same checks for CUDA (sm_90), no run

Three checks, each against its jnp twin: a trivial kernel (x + 1), one Q4_K quantized matmul at M = 1 (the
decode GEMV; N = 512, K = 2048) and one paged decode attention (Llama 3 8B's heads: 32 on 8, Dh 128, f16
pool). Each records the custom-call targets in its lowered program, its error against the twin, its
seconds (compile included) and, on failure, the exception's text. On a GPU they run once per target
jaxlib registers (kernels/triton/call.py: "ffi", the typed FFI handler, and "legacy", the old call);
`chosen` is the first target under which all three passed, else the first under which the trivial kernel
ran, else null, and OUT.json's directory gets `triton_call.env` (BANKML_TRITON_CALL=...) for the steps
after. On a CPU the checks run under Triton's interpreter (TRITON_INTERPRET=1, no custom call), and
--lower lowers them for CUDA without running them (TRITON_INTERPRET=0 and jax-triton with jaxlib's GPU
plugin installed; otherwise it says why not). The JSON is rewritten after every check.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

KERNEL_TOL = 1e-4  # tests/test_gpu_kernels.py's KERNEL_TOL, and why
Q4_K = 12  # ggml's type id


def _trivial():
    import jax
    import jax.numpy as jnp
    import triton
    import triton.language as tl

    from kernels.triton.call import triton_call

    @triton.jit
    def add_one(x_ptr, out_ptr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + i, tl.load(x_ptr + i) + 1.0)

    def fn(x):
        return triton_call(x, kernel=add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,),
                           BLOCK=256)

    x = jnp.arange(1024, dtype=jnp.float32)
    return fn, (x,), lambda x: x + 1.0, "f32 [1024] + 1"


def _qmatmul():
    import jax.numpy as jnp

    from kernels.qlayout import qmatmul_ref, random_raw, to_qweight
    from kernels.triton.qmatmul import qmatmul

    n, k = 512, 2048
    w = to_qweight(random_raw(Q4_K, n, k, seed=1), Q4_K, n, k)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, k)), jnp.float32)
    return (lambda x: qmatmul(x, w)), (x,), (lambda x: qmatmul_ref(x, w)), f"Q4_K M=1 N={n} K={k}"


def _decode_attention():
    import jax.numpy as jnp

    from kernels.paged_attention import decode_attention as twin
    from kernels.triton.attention import check_inputs, decode_attention

    x = check_inputs(0, batch=2, kv_heads=8, group=4, head_dim=128, t=1)
    starts = jnp.array([100, 7], jnp.int32)
    pool = (x["k_pool"], x["v_pool"], x["layer"], x["table"], starts)
    one = (x["q"][:, 0], x["k_new"][:, 0], x["v_new"][:, 0])
    kw = dict(window=0, scale=1.0 / math.sqrt(128))
    return ((lambda *one: decode_attention(*one, *pool, **kw)), one, (lambda *one: twin(*one, *pool, **kw)),
            "B=2 H=32 Hkv=8 Dh=128 P=16 starts=100,7 f16")


CHECKS = {"trivial": _trivial, "qmatmul_q4_k_m1": _qmatmul, "decode_attention": _decode_attention}


def _failure(e: BaseException) -> dict:
    lines = traceback.format_exception(e)
    return {"ok": False, "error": f"{type(e).__name__}: {str(e).strip()[:2000]}",
            "traceback_tail": "".join(lines)[-3000:]}


def run_check(name: str, lower_for: str | None = None) -> dict:
    """One check: lower (the custom calls named), then, unless lowering for another platform, compile and
    run against the twin."""
    import jax

    from kernels.triton.call import ahead_of_time, lowered_targets

    t0 = time.perf_counter()
    out: dict = {"check": name}
    try:
        fn, args, want_fn, shape = CHECKS[name]()
        out["shape"] = shape
        if lower_for:
            with ahead_of_time(90):
                lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(lower_for,))
        else:
            lowered = jax.jit(fn).trace(*args).lower()
        out["custom_calls"] = sorted(set(lowered_targets(lowered.as_text())))
        if lower_for is None:
            got = np.asarray(jax.block_until_ready(lowered.compile()(*args)), np.float64)
            want = np.asarray(want_fn(*args), np.float64)
            err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
            finite = bool(np.isfinite(got).all())
            out.update(max_rel_err=err, tolerance=KERNEL_TOL, finite=finite, ok=finite and err <= KERNEL_TOL)
        else:
            out["ok"] = True
    except BaseException as e:  # noqa: B036 -- every failure is this check's result, never the script's end
        out.update(_failure(e))
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def _environment() -> dict:
    import jax

    from kernels.triton import call

    dev = jax.devices()[0]
    env = {"backend": jax.default_backend(), "device": dev.device_kind, "jax": jax.__version__}
    try:
        env["registered_targets"] = call.registered_targets()
    except Exception as e:  # noqa: BLE001 -- said, not fatal
        env["registered_targets"] = f"{type(e).__name__}: {e}"
    try:
        import triton

        env["triton"] = triton.__version__
        if call.on_gpu():
            env["triton_target"] = str(triton.runtime.driver.active.get_current_target())
    except Exception as e:  # noqa: BLE001
        env["triton_target"] = f"{type(e).__name__}: {e}"
    return env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--lower", action="store_true", help="lower for CUDA sm_90 without running (a CPU's check)")
    ap.add_argument("--targets", default="registered", help="ffi,legacy (default: those jaxlib registers)")
    args = ap.parse_args()
    result: dict = {"smoke": "bankml gpu", "runs": []}

    def save() -> None:
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")

    t_start = time.perf_counter()
    try:
        result["environment"] = _environment()
    except BaseException as e:  # noqa: B036
        result["environment"] = _failure(e)
    save()
    from kernels.triton import call

    on_gpu = call.on_gpu()
    registered = result["environment"].get("registered_targets")
    if args.lower and not (isinstance(registered, dict) and any(registered.values())):
        result.update(chosen=None, ok=None, skipped="jaxlib's GPU plugin is not installed here (a CPU jaxlib): "
                      "nothing lowers for CUDA without its Triton library (pip install jax-cuda12-plugin or "
                      "jax-cuda13-plugin, --no-deps, to lower here)")
        save()
        print(json.dumps({"skipped": result["skipped"]}))
        return 0
    if args.lower or on_gpu:
        if args.targets != "registered":
            targets = args.targets.split(",")
        elif isinstance(registered, dict) and any(registered.values()):
            targets = [t for t in ("ffi", "legacy") if registered[t]]
        else:
            targets = list(call.CALL_TARGETS)
    else:
        targets = ["interpreter"]
    for target in targets:
        run = {"target": target, "checks": []}
        result["runs"].append(run)
        if target != "interpreter":
            try:
                call.use_call_target(target)
            except BaseException as e:  # noqa: B036 -- jax-triton missing, or its lowering moved
                run["checks"].append({"check": "jax_triton", **_failure(e)})
                save()
                continue
        for name in CHECKS:
            run["checks"].append(run_check(name, "cuda" if args.lower else None))
            save()
        run["ok"] = all(c["ok"] for c in run["checks"])
    passed = [r["target"] for r in result["runs"] if r.get("ok")]
    trivial = [r["target"] for r in result["runs"] if r["checks"] and r["checks"][0].get("ok")]
    result["chosen"] = (passed or trivial or [None])[0]
    result["ok"] = bool(passed)
    result["seconds"] = round(time.perf_counter() - t_start, 2)
    save()
    if result["chosen"] in call.CALL_TARGETS and not args.lower:
        (args.out.parent / "triton_call.env").write_text(f"BANKML_TRITON_CALL={result['chosen']}\n")
    print(json.dumps({k: result[k] for k in ("chosen", "ok", "seconds")}))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
