"""The ops of the device-layout forward pass, each run the way this platform runs it best: the one chooser.

model/forward.py calls these four for every layer when the weights are in device layout (model/weights.py):

- `qmatmul(x [M, K], w) -> [M, N]`: a `QWeight` (kernels/qlayout.py) through the Triton kernel of its
  type (kernels/triton/qmatmul.py), or its jnp twin; a dense F16/BF16/F32 matrix through XLA's dot,
  upcast to f32 inside the program and at HIGHEST precision (never TF32 on Hopper).
- `take_rows(w, ids)`: the embedding lookup -- the rows' planes gathered, then dequantized (jnp everywhere:
  a gather is XLA's own job).
- `decode_attention` / `prefill_attention`: paged attention over the KV pool (f16, or q8_0 with its
  scales), the Triton kernels (kernels/triton/attention.py) or their jnp twins (kernels/paged_attention.py),
  one signature.

Which: on a CUDA or ROCm backend the Triton kernels, on the CPU the twins; an op or a weight type without a
kernel runs its twin, says so once in the log and in `report()`. `use("triton")` forces the kernels anywhere
(on the CPU they run under Triton's interpreter, kernels/triton/call.py: tests and `bankml gpu-check`),
`use("jnp")` the twins. The choice is made while a program is traced, so changing it clears JAX's caches:
a program traced under one choice is never reused under the other. triton is imported only when a kernel
is chosen (the CPU server has no triton installed).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from kernels.dequant import type_name
from kernels.qlayout import QWeight, dequantize_planes, qmatmul_ref

log = logging.getLogger(__name__)

MODES = ("auto", "triton", "jnp")
ATTENTION_OPS = ("decode_attention", "prefill_attention")

_mode = "auto"
_logged: set[tuple[str, str]] = set()  # (op, type) whose fallback the log already told
_seen_types: set[str] = set()  # matrix types qmatmul was traced with, for the report


@contextlib.contextmanager
def use(mode: str) -> Iterator[None]:
    """Within the block, run the Triton kernels ("triton"), the twins ("jnp"), or the platform's choice ("auto")."""
    before = _mode
    set_mode(mode)
    try:
        yield
    finally:
        _set(before)


def set_mode(mode: str) -> None:
    """From now on, as `use(mode)` within its block (bench/gpu.py --kernels jnp: the whole run)."""
    if mode not in MODES:
        raise ValueError(f"kernel mode must be one of {MODES}, got {mode!r}")
    _set(mode)


def _set(mode: str) -> None:
    global _mode
    if mode != _mode:
        jax.clear_caches()  # a traced program holds the choice it was traced with
        _mode = mode


def mode() -> str:
    """The mode as set: "auto", "triton" or "jnp"."""
    return _mode


def _on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def _wants_triton() -> tuple[bool, str]:
    if _mode == "triton":
        return True, "forced (kernels.ops.use('triton'))"
    if _mode == "jnp":
        return False, "forced (kernels.ops.use('jnp'))"
    if _on_gpu():
        return True, f"{jax.default_backend()} backend"
    return False, f"{jax.default_backend()} backend: the jnp twins"


def _module(name: str) -> tuple[Any | None, str]:
    """A Triton kernel module, imported on first need; (None, why) where it cannot be."""
    try:
        return importlib.import_module(name), ""
    except ImportError as e:  # no triton on this machine, or the kernel module is missing
        return None, f"{name} cannot be imported ({e})"


def matrix_type(w) -> str:
    """"Q4_K", or the dtype of a dense matrix ("F16", "BF16", "F32")."""
    if isinstance(w, QWeight):
        t = w.ggml_type
        return t if isinstance(t, str) else type_name(int(t))
    return {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}.get(jnp.dtype(w.dtype).name, str(w.dtype))


def _kernel_types(module) -> set[str]:
    """The weight types the module's kernels cover (KERNEL_TYPES: the types, or kernel -> its types)."""
    kt = module.KERNEL_TYPES
    types = [t for ts in kt.values() for t in ts] if isinstance(kt, dict) else list(kt)
    return {t if isinstance(t, str) else type_name(int(t)) for t in types}


def choice(op: str, matrix_type: str | None = None) -> tuple[str, str]:
    """(impl, why) for `op` (and, for qmatmul, the weight type): impl "triton" or "jnp"."""
    if op == "qmatmul" and matrix_type in ("F16", "BF16", "F32"):
        return "jnp", "dense: XLA's dot in f32 at HIGHEST precision"
    if op == "take_rows":
        return "jnp", "a gather of the rows' planes, then their dequantization (XLA)"
    if op not in ("qmatmul", *ATTENTION_OPS):
        raise ValueError(f"unknown op {op!r}")
    triton, why = _wants_triton()
    if not triton:
        return "jnp", why
    module, missing = _module("kernels.triton.qmatmul" if op == "qmatmul" else "kernels.triton.attention")
    if module is None:
        return "jnp", f"{why}, but {missing}: the jnp twin"
    if op == "qmatmul" and matrix_type not in _kernel_types(module):
        return "jnp", f"{why}, but kernels/triton/qmatmul.py has no kernel for {matrix_type}: its jnp twin"
    return "triton", why


def _chosen(op: str, matrix_type: str | None = None) -> str:
    impl, why = choice(op, matrix_type)
    key = (op, matrix_type or "")
    if impl == "jnp" and _wants_triton()[0] and key not in _logged:
        _logged.add(key)
        log.warning("kernels: %s%s runs its jnp twin: %s", op, f" {matrix_type}" if matrix_type else "", why)
    return impl


def qmatmul(x: jax.Array, w) -> jax.Array:
    """x [M, K] f32 @ w.T -> [M, N] f32, w [N, K] a QWeight or a dense matrix."""
    t = matrix_type(w)
    _seen_types.add(t)
    if not isinstance(w, QWeight):
        return lax.dot_general(x, w.astype(jnp.float32), (((1,), (1,)), ((), ())),
                               precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    if _chosen("qmatmul", t) == "triton":
        from kernels.triton.qmatmul import qmatmul as kernel

        return kernel(x, w)
    return qmatmul_ref(x, w)


def take_rows(w, ids: jax.Array) -> jax.Array:
    """Rows `ids` (any shape) of w [V, D], dequantized to f32: [*ids.shape, D]."""
    if not isinstance(w, QWeight):
        return w[ids].astype(jnp.float32)
    flat = ids.reshape(-1)
    rows = QWeight(planes=tuple(p[flat] for p in w.planes), ggml_type=w.ggml_type, shape=(flat.shape[0], w.shape[1]))
    return dequantize_planes(rows).reshape(*ids.shape, w.shape[1])


def decode_attention(q, k_new, v_new, k_pool, v_pool, layer, table, starts, *, window: int, scale: float,
                     k_scale=None, v_scale=None):
    """One new token per row: q [B, H, Dh] over the row's cached cells and its own k_new/v_new -> [B, H, Dh].
    k_scale, v_scale: a q8_0 pool's block scales (kernels/kvquant.py), None for f16."""
    if _chosen("decode_attention") == "triton":
        from kernels.triton.attention import decode_attention as kernel
    else:
        from kernels.paged_attention import decode_attention as kernel
    return kernel(q, k_new, v_new, k_pool, v_pool, layer, table, starts, window=window, scale=scale,
                  k_scale=k_scale, v_scale=v_scale)


def prefill_attention(q, k_new, v_new, k_pool, v_pool, layer, table, starts, n_new, *, window: int, scale: float,
                      k_scale=None, v_scale=None):
    """T new tokens per row (causal among themselves): q [B, T, H, Dh] -> [B, T, H, Dh]."""
    if _chosen("prefill_attention") == "triton":
        from kernels.triton.attention import prefill_attention as kernel
    else:
        from kernels.paged_attention import prefill_attention as kernel
    return kernel(q, k_new, v_new, k_pool, v_pool, layer, table, starts, n_new, window=window, scale=scale,
                  k_scale=k_scale, v_scale=v_scale)


def report(types: Iterable[str] = ()) -> dict:
    """How each op runs here: {"backend", "mode", "qmatmul": {type: {"impl", "why"}}, "take_rows": {...},
    "decode_attention": {...}, "prefill_attention": {...}}; qmatmul covers `types` and every type traced so far."""
    def entry(op: str, t: str | None = None) -> dict[str, str]:
        impl, why = choice(op, t)
        return {"impl": impl, "why": why}

    return {
        "backend": jax.default_backend(),
        "mode": _mode,
        "qmatmul": {t: entry("qmatmul", t) for t in sorted({*types, *_seen_types})},
        "take_rows": entry("take_rows"),
        **{op: entry(op) for op in ATTENTION_OPS},
    }
