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
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
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
    if on_gpu():
        import jax_triton

        return jax_triton.triton_call(*args, kernel=kernel, out_shape=out_shape, grid=grid, num_warps=num_warps,
                                      num_stages=num_stages, zeroed_outputs=_all_outputs(out_shape),
                                      **metaparams)
    return interpret_call(*args, kernel=kernel, out_shape=out_shape, grid=grid, **metaparams)


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
