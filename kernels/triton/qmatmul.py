"""Triton quantized matmul: x [M, K] f32 @ w.T for a QWeight w (kernels/qlayout.py), the weight
dequantized in registers from its planes, f32 accumulation. Its jnp twin is kernels.qlayout.qmatmul_ref.

Two kernels, each generic over the ten block types through one `QTYPE: tl.constexpr`:
- `qgemv_kernel` for decode, M = 1 .. 16: a program owns BLOCK_N output columns of all M rows and
  walks its share of K. Up to 4 rows it multiplies and `tl.sum`s (a dot would pad M to 16); from 5 to
  16 rows it `tl.dot`s a 16-row tile. A matrix with few output columns (gemma3's K/V projections, N=256)
  is split along K too, so that the grid has at least two programs per SM (132 on an H100/H200); the
  partial sums land in out [split, M, N] and XLA adds them: the same result every run (no atomics).
- `qgemm_kernel` for prefill, M up to 2048: BLOCK_M x BLOCK_N tiles, the dequantized [BLOCK_K, BLOCK_N]
  tile `tl.dot`ed into an f32 accumulator.

`_dequant_tile` gives the f32 tile of w.T [BLOCK_K, BLOCK_N] at columns k0.. and rows n0.. from the
planes, with integer ops only, as research/kernels.md §1 lays the formulas out:
- the quant bytes (qs, ql, qh, hmask) per element, their indices written as `(k // a) * b + k % c`, a
  form Triton's pointer analysis sees as runs of c contiguous bytes: a thread's 16 consecutive k load
  their bytes in one 16-byte access (ld.global.v4.b32 in the sm_90 PTX) instead of 16 byte loads;
- the per-group fields (d, m, dmin, sc, mn, Q5_0's qh) once per group, broadcast over its columns
  (`_group`); loaded per element they cost a load instruction per element.
The values are the twin's bit for bit (every product of an f16 field with the small integers is exact
in f32), so kernel and twin differ only by the order of the dot's additions -- and by the dot's input
precision on a GPU: "tf32x3" keeps f32 accuracy on NVIDIA's tensor cores where plain "tf32" would
round the inputs to 10 bits (DOT_PRECISION).

Plane pointers: each type's planes in kernels.qlayout.PLANES order, then a dummy byte array up to six.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from kernels.qlayout import QUANT_TYPES, QWeight, qmatmul_ref, random_raw, repack, to_qweight
from kernels.triton.call import triton_call
from kernels.triton.spec import AotVariant, CheckResult

MAX_PLANES = 6  # Q5_K: qs, qh, sc, mn, d, dmin
SM_COUNT = 132  # H100/H200 SXM; the split-K rule aims at two programs per SM
GEMV_MAX_M = 16
# tl.dot's input precision per Triton backend: "tf32x3" keeps f32 accuracy on NVIDIA's tensor cores;
# AMD's backend has no tf32x3 (it takes ieee, tf32, bf16x3, bf16x6), so "ieee" there.
DOT_PRECISION: dict[str, str] = {"cuda": "tf32x3", "hip": "ieee"}

KERNEL_TYPES: dict[str, tuple[str, ...]] = {
    "qmatmul_gemv": tuple(QUANT_TYPES.values()),
    "qmatmul_gemm": tuple(QUANT_TYPES.values()),
}


# ---------------------------------------------------------------------------------------------
# Dequantization in registers: one helper per type, the [BLOCK_K, BLOCK_N] tile of w.T at k0
# ---------------------------------------------------------------------------------------------
# Every helper takes the rows n (int64 [1, BN]) and their mask n_ok, the columns k = k0 + arange
# ([BK, 1]), and mask = n_ok & (k < K).


@triton.jit
def _u8(plane, n, per_row, col, mask):
    """Byte `col` of row n of a u8 plane with `per_row` bytes a row, as int32."""
    return tl.load(plane + n * per_row + col, mask=mask, other=0).to(tl.int32)


@triton.jit
def _group(plane, n, n_ok, k0, G: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """plane[n, k // G] for the tile's columns k, one load per group of G columns, as it is stored
    (u8, i8 or f16): [BLOCK_K, BN] broadcast from [BLOCK_K / G, BN], or [1, BN] where one group spans the
    tile. Loading per element instead costs a load instruction per element (16 a thread where this
    is one in the sm_90 PTX)."""
    if BLOCK_K > G:
        g = k0 // G + tl.arange(0, BLOCK_K // G)[:, None]
        v = tl.load(plane + n * (K // G) + g, mask=n_ok & (g < K // G), other=0)  # [BK / G, BN]
        v = tl.reshape(tl.broadcast_to(v[:, None, :], (BLOCK_K // G, G, v.shape[1])), (BLOCK_K, v.shape[1]))
    else:  # a 1-D load: in the tile's 2-D layout a [1, BN] load is repeated in every thread's k
        rows = tl.reshape(n, (n.shape[1],))
        v = tl.load(plane + rows * (K // G) + k0 // G, mask=tl.reshape(n_ok, (n.shape[1],)) & (k0 < K), other=0)
        v = v[None, :]  # [1, BN]
    return v


@triton.jit
def _f32(a):
    return a.to(tl.float32)


@triton.jit
def _nib32(qs, n, k, K: tl.constexpr, mask):
    """The 4-bit code of element k in a 32-block type: low nibble of the block's byte k % 16 for the
    first 16 elements, high nibble for the last 16."""
    return (_u8(qs, n, K // 2, (k // 32) * 16 + k % 16, mask) >> (((k // 16) % 2) * 4)) & 15


@triton.jit
def _q5_32(qs, qh, n, n_ok, k, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, mask):
    """Q5_0/Q5_1's 5-bit code: the nibble | bit k % 32 of the block's little-endian u32 qh, << 4."""
    hi = (_group(qh, n, n_ok, k0, 8, K, BLOCK_K).to(tl.int32) >> (k % 8)) & 1
    return _nib32(qs, n, k, K, mask) | (hi << 4)


@triton.jit
def _q4_0(qs, d, n, n_ok, k, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, mask):
    return _f32(_group(d, n, n_ok, k0, 32, K, BLOCK_K)) * _f32(_nib32(qs, n, k, K, mask) - 8)


@triton.jit
def _q4_1(qs, d, m, n, n_ok, k, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, mask):
    q = _f32(_nib32(qs, n, k, K, mask))
    return _f32(_group(d, n, n_ok, k0, 32, K, BLOCK_K)) * q + _f32(_group(m, n, n_ok, k0, 32, K, BLOCK_K))


@triton.jit
def _q5_0(qs, qh, d, n, n_ok, k, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, mask):
    q = _q5_32(qs, qh, n, n_ok, k, k0, K, BLOCK_K, mask) - 16
    return _f32(_group(d, n, n_ok, k0, 32, K, BLOCK_K)) * _f32(q)


@triton.jit
def _q5_1(qs, qh, d, m, n, n_ok, k, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, mask):
    q = _f32(_q5_32(qs, qh, n, n_ok, k, k0, K, BLOCK_K, mask))
    return _f32(_group(d, n, n_ok, k0, 32, K, BLOCK_K)) * q + _f32(_group(m, n, n_ok, k0, 32, K, BLOCK_K))


@triton.jit
def _q8_0(qs, d, n, n_ok, k, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, mask):
    q = _f32(tl.load(qs + n * K + k, mask=mask, other=0))
    return q * _f32(_group(d, n, n_ok, k0, 32, K, BLOCK_K))


@triton.jit
def _q2(qs, n, k, K: tl.constexpr, mask):
    """Q2_K/Q3_K's 2-bit code: element 128h + 32s + l of a super-block is (qs[32h + l] >> 2s) & 3, so
    element k's byte is 32 (k // 128) + k % 32 of the row."""
    return (_u8(qs, n, K // 4, (k // 128) * 32 + k % 32, mask) >> (((k // 32) % 4) * 2)) & 3


@triton.jit
def _q2_k(qs, sc, d, dmin, n, n_ok, k, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, mask):
    s = _group(sc, n, n_ok, k0, 16, K, BLOCK_K).to(tl.int32)  # low nibble scale, high nibble min
    dl = _f32(_group(d, n, n_ok, k0, 256, K, BLOCK_K)) * _f32(s & 15)
    ml = _f32(_group(dmin, n, n_ok, k0, 256, K, BLOCK_K)) * _f32(s >> 4)
    return dl * _f32(_q2(qs, n, k, K, mask)) - ml


@triton.jit
def _q3_k(hmask, qs, sc, d, n, n_ok, k, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, mask):
    h = (_u8(hmask, n, K // 8, (k // 256) * 32 + k % 32, mask) >> ((k // 32) % 8)) & 1
    q = _q2(qs, n, k, K, mask) - ((h ^ 1) << 2)  # a clear hmask bit subtracts 4
    dl = _f32(_group(d, n, n_ok, k0, 256, K, BLOCK_K)) * _f32(_group(sc, n, n_ok, k0, 16, K, BLOCK_K))
    return dl * _f32(q)


@triton.jit
def _q4(qs, n, k, K: tl.constexpr, mask):
    """Q4_K/Q5_K's 4-bit code: sub-block j = (k % 256) // 32 is the low (j even) or high nibbles of
    qs[32(j // 2) + l] of its super-block, so element k's byte is 32 (k // 64) + k % 32 of the row."""
    return (_u8(qs, n, K // 2, (k // 64) * 32 + k % 32, mask) >> (((k // 32) % 2) * 4)) & 15


@triton.jit
def _k_affine(q, sc, mn, d, dmin, n, n_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    dl = _f32(_group(d, n, n_ok, k0, 256, K, BLOCK_K)) * _f32(_group(sc, n, n_ok, k0, 32, K, BLOCK_K))
    ml = _f32(_group(dmin, n, n_ok, k0, 256, K, BLOCK_K)) * _f32(_group(mn, n, n_ok, k0, 32, K, BLOCK_K))
    return dl * _f32(q) - ml


@triton.jit
def _q4_k(qs, sc, mn, d, dmin, n, n_ok, k, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, mask):
    return _k_affine(_q4(qs, n, k, K, mask), sc, mn, d, dmin, n, n_ok, k0, K, BLOCK_K)


@triton.jit
def _q5_k(qs, qh, sc, mn, d, dmin, n, n_ok, k, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, mask):
    hi = (_u8(qh, n, K // 8, (k // 256) * 32 + k % 32, mask) >> ((k // 32) % 8)) & 1
    return _k_affine(_q4(qs, n, k, K, mask) | (hi << 4), sc, mn, d, dmin, n, n_ok, k0, K, BLOCK_K)


@triton.jit
def _q6_k(ql, qh, sc, d, n, n_ok, k, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, mask):
    # element 128h + 32t + i of a super-block: nibble t // 2 of ql[64h + 32(t % 2) + i], 2-bit field t
    # of qh[32h + i]; over the row, h and the super-block fold into k // 128
    lo = _u8(ql, n, K // 2, (k // 128) * 64 + ((k // 32) % 2) * 32 + k % 32, mask) >> (((k // 64) % 2) * 4)
    hi = _u8(qh, n, K // 4, (k // 128) * 32 + k % 32, mask) >> (((k // 32) % 4) * 2)
    dl = _f32(_group(d, n, n_ok, k0, 256, K, BLOCK_K)) * _f32(_group(sc, n, n_ok, k0, 16, K, BLOCK_K))
    return dl * _f32(((lo & 15) | ((hi & 3) << 4)) - 32)


@triton.jit
def _dequant_tile(QTYPE: tl.constexpr, p0, p1, p2, p3, p4, p5, n, n_ok, k0,
                  K: tl.constexpr, BLOCK_K: tl.constexpr):
    """f32 w.T [BLOCK_K, BN] at rows n (int64 [1, BN]) and columns k0 .. k0 + BLOCK_K; 0 where masked."""
    k = k0 + tl.arange(0, BLOCK_K)[:, None]  # [BK, 1]
    mask = n_ok & (k < K)
    if QTYPE == 2:
        w = _q4_0(p0, p1, n, n_ok, k, k0, K, BLOCK_K, mask)
    elif QTYPE == 3:
        w = _q4_1(p0, p1, p2, n, n_ok, k, k0, K, BLOCK_K, mask)
    elif QTYPE == 6:
        w = _q5_0(p0, p1, p2, n, n_ok, k, k0, K, BLOCK_K, mask)
    elif QTYPE == 7:
        w = _q5_1(p0, p1, p2, p3, n, n_ok, k, k0, K, BLOCK_K, mask)
    elif QTYPE == 8:
        w = _q8_0(p0, p1, n, n_ok, k, k0, K, BLOCK_K, mask)
    elif QTYPE == 10:
        w = _q2_k(p0, p1, p2, p3, n, n_ok, k, k0, K, BLOCK_K, mask)
    elif QTYPE == 11:
        w = _q3_k(p0, p1, p2, p3, n, n_ok, k, k0, K, BLOCK_K, mask)
    elif QTYPE == 12:
        w = _q4_k(p0, p1, p2, p3, p4, n, n_ok, k, k0, K, BLOCK_K, mask)
    elif QTYPE == 13:
        w = _q5_k(p0, p1, p2, p3, p4, p5, n, n_ok, k, k0, K, BLOCK_K, mask)
    else:
        tl.static_assert(QTYPE == 14, "unknown ggml type")
        w = _q6_k(p0, p1, p2, p3, n, n_ok, k, k0, K, BLOCK_K, mask)
    return tl.broadcast_to(w, (BLOCK_K, n.shape[1]))


# ---------------------------------------------------------------------------------------------
# The kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def qgemv_kernel(x_ptr, p0, p1, p2, p3, p4, p5, out_ptr,
                 M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, QTYPE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 K_SPLIT: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """out[s, m, n] = sum over k in split s of x[m, k] * w[n, k]; grid (cdiv(N, BLOCK_N), splits)."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n = rn[None, :].to(tl.int64)  # [1, BN]
    n_ok = rn[None, :] < N
    m_ok = rm[:, None] < M  # [BM, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_SPLIT, BLOCK_K):
        kk = split * K_SPLIT + k0
        rk = kk + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        w = _dequant_tile(QTYPE, p0, p1, p2, p3, p4, p5, n, n_ok, kk, K, BLOCK_K)  # [BK, BN]
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=m_ok & k_ok[None, :], other=0.0)  # [BM, BK]
        if USE_DOT:
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        else:
            acc += tl.sum(x[:, :, None] * w[None, :, :], axis=1)
    out = out_ptr + split * M * N + rm[:, None] * N + rn[None, :]
    tl.store(out, acc, mask=m_ok & n_ok)


@triton.jit
def qgemm_kernel(x_ptr, p0, p1, p2, p3, p4, p5, out_ptr,
                 M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, QTYPE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """out[m, n] = sum over k of x[m, k] * w[n, k]; grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)): the
    M-tiles of one weight tile are launched side by side, so they find its bytes in L2."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n = rn[None, :].to(tl.int64)  # [1, BN]
    n_ok = rn[None, :] < N
    m_ok = rm[:, None] < M  # [BM, 1]
    x_row = x_ptr + rm[:, None].to(tl.int64) * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        w = _dequant_tile(QTYPE, p0, p1, p2, p3, p4, p5, n, n_ok, k0, K, BLOCK_K)  # [BK, BN]
        x = tl.load(x_row + rk[None, :], mask=m_ok & k_ok[None, :], other=0.0)  # [BM, BK]
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc, mask=m_ok & n_ok)


# ---------------------------------------------------------------------------------------------
# Launch plans and the entry point
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """How one (M, N, K) is launched: which kernel, its tile sizes, the K split and warps."""

    kernel: str  # "qmatmul_gemv" | "qmatmul_gemm"
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1  # gemv only
    num_warps: int = 4

    def k_split(self, K: int) -> int:
        """Columns per split, a whole number of BLOCK_K."""
        return -(-K // (self.split_k * self.block_k)) * self.block_k


def plan_for(M: int, N: int, K: int) -> Plan:
    """The launch this module uses for x [M, K] and a weight [N, K]."""
    if M <= GEMV_MAX_M:
        block_m = 16 if M > 4 else 1 << (M - 1).bit_length()  # tl.dot wants 16 rows; the sum form pads to 2^i
        # the sum form's [BLOCK_M, BLOCK_K, BLOCK_N] product lives in registers: at most 32 a thread at
        # 4 warps ([4, 64, 16])
        block_k = 128 if block_m == 1 else 64
        # few output columns: narrower tiles first, then split K while the grid has under two programs
        # per SM and each split keeps at least two K-steps
        block_n = 32 if -(-N // 32) >= 2 * SM_COUNT else 16
        tiles, split = -(-N // block_n), 1
        while tiles * split < 2 * SM_COUNT and K // (2 * split) >= 2 * block_k:
            split *= 2
        return Plan("qmatmul_gemv", block_m, block_n, block_k, split)
    # 4 warps for both: AotVariant carries no num_warps, so gpu-check compiles what runs. At 4 warps
    # ptxas (sm_90) gives a 128 x 64 tile 241-250 registers a thread, one block per SM's worth; 64 x 64
    # takes 127-142 and no spills for every type.
    return Plan("qmatmul_gemm", 64 if M >= 64 else 32, 64, 32)


_DUMMY = np.zeros(16, np.uint8)  # the pointer of a plane the type does not have: never read


def triton_backend() -> str:
    """The Triton backend the default device compiles for: "hip" on ROCm, else "cuda" (also what the
    interpreter is told; it ignores the precision)."""
    client = jax.devices()[0].client
    return "hip" if "rocm" in str(getattr(client, "platform_version", "")).lower() else "cuda"


def qmatmul(x: jax.Array, w: QWeight, plan: Plan | None = None) -> jax.Array:
    """x [M, K] f32 @ w.T -> [M, N] f32, through kernels/triton/call.triton_call (works under jax.jit)."""
    (M, K), (N, K_w) = x.shape, w.shape
    if K != K_w:
        raise ValueError(f"x has {K} columns, the {w.type_name} weight {K_w}")
    plan = plan or plan_for(M, N, K)
    planes = (*w.planes, *[jnp.asarray(_DUMMY)] * (MAX_PLANES - len(w.planes)))
    x = x.astype(jnp.float32)
    common = dict(M=M, N=N, K=K, QTYPE=w.ggml_type, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
                  BLOCK_K=plan.block_k, DOT_PRECISION=DOT_PRECISION[triton_backend()], num_warps=plan.num_warps)
    if plan.kernel == "qmatmul_gemv":
        if M > plan.block_m:
            raise ValueError(f"the GEMV plan holds {plan.block_m} rows, x has {M}")
        k_split = plan.k_split(K)
        splits = -(-K // k_split)
        partial = triton_call(x, *planes, kernel=qgemv_kernel,
                              out_shape=jax.ShapeDtypeStruct((splits, M, N), jnp.float32),
                              grid=(triton.cdiv(N, plan.block_n), splits), K_SPLIT=k_split,
                              USE_DOT=plan.block_m > 4, **common)
        return partial[0] if splits == 1 else partial.sum(axis=0)
    return triton_call(x, *planes, kernel=qgemm_kernel, out_shape=jax.ShapeDtypeStruct((M, N), jnp.float32),
                       grid=(triton.cdiv(M, plan.block_m), triton.cdiv(N, plan.block_n)), **common)


# ---------------------------------------------------------------------------------------------
# What `bankml gpu-check` reads: AOT variants and interpreter checks
# ---------------------------------------------------------------------------------------------

_KERNELS = {"qmatmul_gemv": qgemv_kernel, "qmatmul_gemm": qgemm_kernel}
_POINTER = {np.dtype(np.uint8): "*u8", np.dtype(np.int8): "*i8", np.dtype(np.float16): "*fp16"}


def plane_dtypes(ggml_type: int) -> tuple[np.dtype, ...]:
    """The dtypes of a type's planes, as repack makes them (from a one-row example)."""
    block = 256 if ggml_type >= 10 else 32
    return tuple(p.dtype for p in repack(random_raw(ggml_type, 1, block, 0), ggml_type, 1, block))


def variant(ggml_type: int, M: int, N: int, K: int, backend: str = "cuda") -> AotVariant:
    """The AOT specialization qmatmul launches for x [M, K] and a [N, K] weight of this type, for a
    Triton backend ("cuda" or "hip")."""
    plan = plan_for(M, N, K)
    kernel = _KERNELS[plan.kernel]
    dtypes = plane_dtypes(ggml_type)
    pointers = ["*fp32", *(_POINTER[d] for d in dtypes), *["*u8"] * (MAX_PLANES - len(dtypes)), "*fp32"]
    args = kernel.arg_names
    constexprs = dict(M=M, N=N, K=K, QTYPE=ggml_type, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
                      BLOCK_K=plan.block_k, DOT_PRECISION=DOT_PRECISION[backend])
    if plan.kernel == "qmatmul_gemv":
        constexprs.update(K_SPLIT=plan.k_split(K), USE_DOT=plan.block_m > 4)
    signature = {a: (pointers[i] if i < len(pointers) else "constexpr") for i, a in enumerate(args)}
    return AotVariant(name=f"{plan.kernel}_{QUANT_TYPES[ggml_type]}_M{M}_N{N}_K{K}",
                      types=(QUANT_TYPES[ggml_type],), kernel=kernel, signature=signature, constexprs=constexprs,
                      attrs={(i,): [["tt.divisibility", 16]] for i in range(len(pointers))})


def aot_variants(backend: str = "cuda") -> list[AotVariant]:
    """Every kernel x type at a 4096 x 4096 weight: decode (M = 1 sum form, 8 and 16 through tl.dot) and a
    128-token prefill tile, 40 in all. All 40 compile for sm_90 and sm_80 (83 s on this 2-core box);
    with backend="hip" they compile for gfx942. ptxas at sm_90, registers a thread: 54-72 for M = 1,
    125-160 for M = 8 and 16, 127-142 for the GEMM; no local memory (spills) in any."""
    return [variant(t, M, 4096, 4096, backend) for t in QUANT_TYPES for M in (1, 8, 16, 128)]


def interpret_checks(types: tuple[int, ...] = tuple(QUANT_TYPES)) -> list[CheckResult]:
    """Each kernel x type under Triton's interpreter against qmatmul_ref on random blocks: the GEMV in its
    sum form (M = 1, 3) and dot form (M = 16), K split, and a GEMM of 2 x 1 tiles (M = 40). Needs
    TRITON_INTERPRET=1 before triton's import; about 4 s a type here."""
    N, K, tolerance = 32, 512, 1e-5
    results = []
    for ggml_type in types:
        w = to_qweight(random_raw(ggml_type, N, K, seed=ggml_type), ggml_type, N, K)
        for M, plan in [(1, None), (3, None), (16, None), (40, Plan("qmatmul_gemm", 32, 32, 64))]:
            x = jnp.asarray(np.random.default_rng(M).standard_normal((M, K)), jnp.float32)
            got, want = np.asarray(qmatmul(x, w, plan)), np.asarray(qmatmul_ref(x, w))
            err = float(np.abs(got - want).max() / max(np.abs(want).max(), np.finfo(np.float32).tiny))
            results.append(CheckResult((plan or plan_for(M, N, K)).kernel, (QUANT_TYPES[ggml_type],),
                                       f"M={M} N={N} K={K}", err, tolerance, err <= tolerance))
    return results
