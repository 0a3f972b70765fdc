"""How a Triton kernel is called from JAX: `triton_call`, with jax-triton's signature, on every platform.

On a CUDA or ROCm backend it is `jax_triton.triton_call`: the kernel is compiled for the device and runs
as an XLA custom call inside the jitted step. Everywhere else (this CPU machine, CI) the same call runs
the same `@triton.jit` function through Triton's interpreter, from a `jax.pure_callback`, so a kernel
and the engine's wiring of it are tested without a GPU -- slowly (about 2 ms a program), which is why
the CPU engine takes this path only when asked. The interpreter needs TRITON_INTERPRET=1 in the
environment before triton is first imported (see `interpreted`); AOT compilation needs it unset, so
`bankml gpu-check` runs the two in separate processes.

Triton's interpreter wants torch tensors; `_HostTensor` is the little of torch's tensor API it reads,
over a numpy array. With numpy >= 2.4 the interpreter's `tensor.__index__` fails (`int()` of a
one-element array; triton-lang/triton#9171, fixed upstream by #9172, not in triton 3.6.0): `_patched`
reads the element instead. That is the only patch; pinning numpy < 2.4 would hold back the server.

Which XLA custom call a kernel lowers to (`call_target`): jaxlib registers two Triton targets (jaxlib
0.11.2's gpu_triton.py: "triton_kernel_call", the old status-returning call that jax-triton 0.3.1 emits
with `api_version=2` and the kernel in `backend_config`; and "triton_kernel_call_ffi", the typed FFI
handler that upstream jax-triton emits from jax 0.10.1 on, `api_version=4`, the kernel in the `opaque`
attribute). jax-triton 0.4 (the FFI form) needs triton >= 3.7, so we keep 0.3.1 and, for "ffi", lower
through its own rule and emit the same kernel bytes as the FFI call instead (`_ffi_rule`). "auto" takes
"ffi" where the plugin registers it, else "legacy"; BANKML_TRITON_CALL=ffi|legacy forces one (the GPU
run's smoke step tries both and passes on the one that ran).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

Grid = tuple[int, ...] | Callable[[dict[str, Any]], tuple[int, ...]]


def on_gpu() -> bool:
    """True where jax-triton lowers kernels: a CUDA or ROCm backend."""
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def triton_call(*args, kernel, out_shape, grid: Grid, num_warps: int = 4, num_stages: int = 3,
                **metaparams):
    """jax-triton's `triton_call`: `kernel(*args, *outputs, **metaparams)` over `grid`.

    args: jax arrays (pointers) and Python scalars; out_shape: one `jax.ShapeDtypeStruct` or a sequence
    of them (the outputs start zeroed); metaparams: the kernel's `tl.constexpr` arguments.
    Returns one array, or a tuple as out_shape was a sequence.
    """
    if on_gpu() or _ahead["cc"] is not None:
        return device_call(*args, kernel=kernel, out_shape=out_shape, grid=grid, num_warps=num_warps,
                           num_stages=num_stages, compute_capability=_ahead["cc"], **metaparams)
    return interpret_call(*args, kernel=kernel, out_shape=out_shape, grid=grid, **metaparams)


_ahead: dict[str, int | None] = {"cc": None}


@contextlib.contextmanager
def ahead_of_time(compute_capability: int = 90) -> Iterator[None]:
    """Within the block, `triton_call` goes through jax-triton for a GPU of this compute capability even
    on a CPU, so a program can be lowered for CUDA here (`.trace(...).lower(lowering_platforms=("cuda",))`)
    and its custom calls read; running it needs the GPU. Needs TRITON_INTERPRET unset and jaxlib's GPU
    plugin installed (jax-triton imports its Triton library)."""
    before = _ahead["cc"]
    _ahead["cc"] = compute_capability
    try:
        yield
    finally:
        _ahead["cc"] = before


def device_call(*args, kernel, out_shape, grid: Grid, num_warps: int = 4, num_stages: int = 3,
                compute_capability: int | None = None, **metaparams):
    """`triton_call` through jax-triton, whatever the backend: the kernel is compiled while the program is
    lowered for CUDA or ROCm. compute_capability (90 for sm_90) lets a CPU lower for a GPU it has not got
    (the tests read the custom call that comes out); None asks the device."""
    return _jax_triton().triton_call(*args, kernel=kernel, out_shape=out_shape, grid=grid, num_warps=num_warps,
                                     num_stages=num_stages, zeroed_outputs=_all_outputs(out_shape),
                                     compute_capability=compute_capability, **metaparams)


# BANKML_TRITON_CALL -> the XLA custom-call target a kernel lowers to
CALL_TARGETS = {"ffi": "triton_kernel_call_ffi", "legacy": "triton_kernel_call"}


def registered_targets() -> dict[str, bool]:
    """{"legacy": bool, "ffi": bool}: which Triton targets this jaxlib's GPU plugin registers (both False
    without a plugin: a CPU jaxlib)."""
    from jax._src.lib import gpu_triton

    plugin = getattr(gpu_triton, "_cuda_triton", None) or getattr(gpu_triton, "_hip_triton", None)
    if plugin is None:
        return {"legacy": False, "ffi": False}
    ffi = getattr(plugin, "registrations", None)
    return {"legacy": hasattr(plugin, "get_custom_call"),
            "ffi": callable(ffi) and CALL_TARGETS["ffi"] in ffi()}


def call_target() -> str:
    """"ffi" or "legacy": BANKML_TRITON_CALL where it names one, else "ffi" where the plugin has it."""
    asked = os.environ.get("BANKML_TRITON_CALL", "auto").strip().lower() or "auto"
    if asked in CALL_TARGETS:
        return asked
    if asked != "auto":
        raise ValueError(f"BANKML_TRITON_CALL must be auto, ffi or legacy, not {asked!r}")
    return "ffi" if registered_targets()["ffi"] else "legacy"


@functools.cache
def _jax_triton():
    """jax_triton, its lowering for CUDA and ROCm set to `call_target()` (read once per process)."""
    import jax_triton

    _install(call_target())
    return jax_triton


def use_call_target(target: str) -> None:
    """From now on kernels lower to `target` ("ffi" or "legacy"); programs traced before are dropped."""
    if target not in CALL_TARGETS:
        raise ValueError(f"a Triton call target is one of {sorted(CALL_TARGETS)}, not {target!r}")
    os.environ["BANKML_TRITON_CALL"] = target
    _jax_triton()
    _install(target)
    jax.clear_caches()


def _install(target: str) -> None:
    from jax.interpreters import mlir
    from jax_triton import triton_lib

    for platform, backend in (("cuda", triton_lib.get_cuda_backend), ("rocm", triton_lib.get_hip_backend)):
        rule = functools.partial(triton_lib.triton_kernel_call_lowering, backend)  # as jax-triton registers it
        mlir.register_lowering(triton_lib.triton_kernel_call_p, _ffi_rule(rule) if target == "ffi" else rule,
                               platform=platform)


def _ffi_rule(legacy_rule: Callable) -> Callable:
    """A lowering that runs jax-triton 0.3.1's own (which compiles the kernel and emits the old custom
    call, the last op it adds) and puts in place of that call the FFI one: the same operands, results,
    aliases and compressed kernel proto, as upstream jax-triton emits it (`opaque`, api_version 4)."""

    def rule(ctx, *operands, **params):
        results = legacy_rule(ctx, *operands, **params)
        old = results[0].owner
        config = old.attributes["backend_config"]
        kernel_bytes = _string_bytes(config)
        new = jax.ffi.ffi_lowering(CALL_TARGETS["ffi"], api_version=4,
                                   operand_output_aliases=dict(params.get("input_output_aliases") or ()))(
            ctx, *operands, opaque=kernel_bytes)
        for before, after in zip(results, new, strict=True):
            before.replace_all_uses_with(after)
        old.erase()
        return new

    return rule


def _string_bytes(attr) -> bytes:
    """The bytes of an MLIR string attribute (a custom call's backend_config)."""
    from jax._src.lib.mlir import ir

    return ir.StringAttr(attr).value_bytes


def lowered_targets(hlo_text: str) -> list[str]:
    """The custom-call targets named in a lowered program's text (StableHLO), in order."""
    return re.findall(r"stablehlo\.custom_call @([\w.]+)", hlo_text)


# Triton's interpreter patches triton.language while a kernel runs: one kernel at a time per process
# (under shard_map, XLA:CPU runs each device's callback on a thread of its own)
_INTERPRETER = threading.Lock()


def _all_outputs(out_shape) -> Callable[[dict], tuple[int, ...]]:
    n = 1 if isinstance(out_shape, jax.ShapeDtypeStruct) else len(out_shape)
    return lambda meta: tuple(range(n))


def interpret_call(*args, kernel, out_shape, grid: Grid, **metaparams):
    """`triton_call` through Triton's interpreter on the host, usable inside `jax.jit`."""
    single = isinstance(out_shape, jax.ShapeDtypeStruct)
    outs = (out_shape,) if single else tuple(out_shape)
    arrays = [i for i, a in enumerate(args) if isinstance(a, (jax.Array, np.ndarray))]

    def host(*values):
        full = list(args)
        for i, v in zip(arrays, values, strict=True):
            full[i] = _HostTensor(np.ascontiguousarray(np.asarray(v)))
        results = [np.zeros(o.shape, o.dtype) for o in outs]
        g = grid(metaparams) if callable(grid) else grid
        with _INTERPRETER:
            interpreted(kernel)[tuple(g)](*full, *(_HostTensor(r) for r in results), **metaparams)
        return tuple(results)

    got = jax.pure_callback(host, outs, *(args[i] for i in arrays))
    return got[0] if single else got


def interpreted(kernel):
    """The kernel as Triton's interpreter runs it: `@triton.jit` gives an `InterpretedFunction` when
    TRITON_INTERPRET=1 was set before triton was imported (for the kernel and for triton.language's own
    jitted helpers, `tl.sum` and the like, so it cannot be switched on later in the process)."""
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, InterpretedFunction):
        raise RuntimeError("Triton kernels run on the CPU only under its interpreter: set TRITON_INTERPRET=1 "
                           "before triton is imported (tests/conftest.py does; `bankml gpu-check` does in "
                           "its own process)")
    _patch_index()
    return kernel


@functools.cache
def _patch_index() -> None:
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def _patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patched


class _HostTensor:
    """What Triton's interpreter reads of a torch tensor, over a contiguous numpy array (shared, not copied)."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.dtype = array.dtype

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self) -> _HostTensor:
        return self

    def cpu(self) -> _HostTensor:
        return self

    def copy_(self, other) -> None:  # the interpreter worked on this very memory
        pass

    def new_empty(self, *shape, device=None) -> _HostTensor:
        return self

    def set_(self, storage, offset, size, stride) -> _HostTensor:
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self) -> Sequence[int]:
        return self.array.shape

    def stride(self) -> Sequence[int]:
        return tuple(s // self.array.itemsize for s in self.array.strides)
