"""What each Triton kernel module tells `bankml gpu-check`: the variants to compile ahead of time, and
the result of running its kernels under Triton's interpreter against their jnp twins.

Kept free of triton imports, so the checker can read it anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class AotVariant:
    """One kernel specialization, compiled with `triton.compile(ASTSource(kernel, signature, constexprs), target)`."""

    name: str  # "qmatmul_gemv"
    types: tuple[str, ...]  # the weight or cache types it covers: ("Q4_K",), ("f16",)
    kernel: Any  # the @triton.jit function
    signature: dict[str, str]  # argument -> "*fp32", "*u8", "i32", or "constexpr"
    constexprs: dict[str, Any]  # argument -> value
    attrs: dict = field(default_factory=dict)  # e.g. {(0,): [["tt.divisibility", 16]]}


@dataclass(frozen=True)
class CheckResult:
    """A kernel run under the interpreter against its twin on one input."""

    name: str
    types: tuple[str, ...]
    shape: str  # what it ran on, for the report: "M=3 N=64 K=512"
    max_rel_err: float  # max |kernel - twin| / max(|twin|)
    tolerance: float
    ok: bool
