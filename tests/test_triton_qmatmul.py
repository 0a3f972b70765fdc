"""kernels/triton/qmatmul under Triton's interpreter against its jnp twin (kernels.qlayout.qmatmul_ref),
on random blocks of every type and on real rows of SmolLM2 and gemma3, and compiled ahead of time for
sm_90 and sm_80. Shapes are small: the interpreter costs about 2 ms a program."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from kernels.qlayout import QUANT_TYPES, qmatmul_ref, random_raw, to_qweight
from kernels.triton.qmatmul import (
    KERNEL_TYPES,
    SM_COUNT,
    Plan,
    aot_variants,
    interpret_checks,
    plan_for,
    qmatmul,
)
from model.weights import _tensor_table

TYPES = list(QUANT_TYPES)
IDS = list(QUANT_TYPES.values())
TOL = 1e-5  # max |kernel - twin| / max |twin|; f32 sums in another order give ~1e-6


def _rel_err(got, want) -> float:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == np.float32
    return float(np.abs(got - want).max() / np.abs(want).max())


def _x(M: int, K: int, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((M, K)), jnp.float32)


@pytest.fixture(scope="module")
def random_weights():
    N, K = 40, 512  # N not a multiple of the 16-column tiles: the edge is masked
    return {t: to_qweight(random_raw(t, N, K, seed=t), t, N, K) for t in TYPES}


@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("ggml_type", TYPES, ids=IDS)
def test_gemv_matches_twin(random_weights, ggml_type: int, M: int):
    w = random_weights[ggml_type]
    plan = plan_for(M, *w.shape)
    assert plan.kernel == "qmatmul_gemv" and plan.split_k > 1  # K is split here: partials are added
    x = _x(M, w.shape[1], seed=M)
    assert _rel_err(qmatmul(x, w), qmatmul_ref(x, w)) <= TOL


@pytest.mark.parametrize("ggml_type", TYPES, ids=IDS)
def test_gemm_of_two_tiles_matches_twin(random_weights, ggml_type: int):
    w = random_weights[ggml_type]
    x = _x(40, w.shape[1], seed=7)  # rows 32..39 of the second M-tile are real, the rest masked
    plan = Plan("qmatmul_gemm", block_m=32, block_n=64, block_k=64)
    assert _rel_err(qmatmul(x, w, plan), qmatmul_ref(x, w)) <= TOL


@pytest.mark.parametrize("ggml_type", TYPES, ids=IDS)
def test_weights_dequantized_in_registers_are_gguf_s_bits(ggml_type: int):
    # x = I makes out = w.T: every sum is one product with 1.0 and zeros, so the kernel's tile shows
    # exactly (but for the sign of a zero: 0.0 + -0.0 is 0.0).
    N, K = 32, 256
    raw = random_raw(ggml_type, N, K, seed=ggml_type + 100)
    got = np.asarray(qmatmul(jnp.eye(K, dtype=jnp.float32), to_qweight(raw, ggml_type, N, K),
                             Plan("qmatmul_gemm", block_m=128, block_n=32, block_k=64)))
    want = gguf.quants.dequantize(raw, T(ggml_type)).T
    assert np.array_equal(got, want)


def test_qmatmul_runs_inside_jit(random_weights):
    w = random_weights[T.Q4_K]
    x = _x(2, w.shape[1])
    f = jax.jit(lambda x, w: qmatmul(x, w) * 2.0)
    assert _rel_err(f(x, w), 2.0 * qmatmul_ref(x, w)) <= TOL


def test_plans_fill_the_gpu_and_pick_the_kernel():
    # decode on a 4096 x 4096 weight: at least two programs per SM; small N (gemma3's K/V) still split
    for M in (1, 8):
        p = plan_for(M, 4096, 4096)
        assert p.kernel == "qmatmul_gemv" and -(-4096 // p.block_n) * p.split_k >= 2 * SM_COUNT
        assert p.k_split(4096) % p.block_k == 0 and p.k_split(4096) * p.split_k >= 4096
    small = plan_for(1, 256, 640)
    assert small.block_n == 16 and small.split_k == 2
    assert plan_for(4, 4096, 4096).block_m == 4 and plan_for(5, 4096, 4096).block_m == 16
    assert plan_for(17, 4096, 4096).kernel == plan_for(2048, 4096, 4096).kernel == "qmatmul_gemm"
    with pytest.raises(ValueError, match="columns"):
        qmatmul(_x(1, 256), to_qweight(random_raw(T.Q8_0, 2, 512, 0), T.Q8_0, 2, 512))


def _real(tensor, rows: int):
    cols = int(tensor.shape[0])
    return to_qweight(np.asarray(tensor.data[:rows]), int(tensor.tensor_type), rows, cols)


def test_smollm2_rows(smollm2_path):
    tensors = {t.name: t for t in _tensor_table(smollm2_path).tensors}
    w = _real(tensors["blk.0.attn_k.weight"], rows=40)  # Q4_1, K = 576: the last K-step is masked
    assert w.type_name == "Q4_1"
    for M in (1, 5):
        x = _x(M, 576, seed=M)
        assert _rel_err(qmatmul(x, w), qmatmul_ref(x, w)) <= TOL
    x = _x(24, 576)
    assert _rel_err(qmatmul(x, w, Plan("qmatmul_gemm", 16, 32, 64)), qmatmul_ref(x, w)) <= TOL


def test_gemma3_rows(gemma3_path):
    tensors = {t.name: t for t in _tensor_table(gemma3_path).tensors}
    picks = {"token_embd.weight": "Q8_0", "blk.0.attn_q.weight": "Q5_0", "blk.0.attn_output.weight": "Q4_K",
             "blk.0.ffn_down.weight": "Q6_K"}
    for i, (name, type_name) in enumerate(picks.items()):
        w = _real(tensors[name], rows=32)
        assert w.type_name == type_name
        x = _x((1, 3, 8, 2)[i], w.shape[1], seed=i)
        assert _rel_err(qmatmul(x, w), qmatmul_ref(x, w)) <= TOL, name


def test_interpret_checks_report_each_kernel():
    # gpu-check runs all ten types; the tests above cover them, so two suffice here
    results = interpret_checks(types=(T.Q4_1, T.Q6_K))
    assert all(r.ok and 0 < r.max_rel_err <= r.tolerance for r in results)
    assert {(r.name, r.types[0]) for r in results} == {(k, t) for k in KERNEL_TYPES for t in ("Q4_1", "Q6_K")}
    assert all(set(types) == set(QUANT_TYPES.values()) for types in KERNEL_TYPES.values())


def test_aot_variants_cover_every_kernel_and_type():
    variants = aot_variants()
    assert {(v.name.split("_Q")[0], v.types[0]) for v in variants} == {
        (k, t) for k, types in KERNEL_TYPES.items() for t in types}
    assert all(v.kernel.arg_names == list(v.signature) for v in variants)


_AOT = textwrap.dedent("""
    import re
    import sys

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kernels.triton.qmatmul import aot_variants

    def build(v, target):
        src = ASTSource(fn=v.kernel, signature=v.signature, constexprs=v.constexprs, attrs=v.attrs)
        return triton.compile(src, target=target)

    wanted = set(sys.argv[1:])
    for v in aot_variants():
        if v.name in wanted:
            for cc in (90, 80):
                k = build(v, GPUTarget("cuda", cc, 32))
                print(v.name, cc, len(k.asm["cubin"]), f"sm_{cc}" in k.asm["ptx"])
                if cc == 90 and "M1_" in v.name:  # the loads of the decode GEMV
                    print("loads", *sorted(set(re.findall(r"ld\\.global[.a-z0-9]*", k.asm["ptx"]))))
    # AMD's backend refuses tf32x3: the hip variants ask for ieee
    hip = [v for v in aot_variants("hip") if v.name in wanted and "gemm" in v.name]
    k = build(hip[0], GPUTarget("hip", "gfx942", 64))
    print(hip[0].name, "gfx942", len(k.asm["hsaco"]), "gfx942" in k.asm["amdgcn"])
""")


def test_aot_compiles_to_cubin_for_sm90_and_sm80_and_hsaco_for_gfx942():
    names = ["qmatmul_gemv_Q4_1_M1_N4096_K4096", "qmatmul_gemv_Q6_K_M8_N4096_K4096",
             "qmatmul_gemm_Q4_K_M128_N4096_K4096"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # AOT needs the real jit
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", _AOT, *names], capture_output=True, text=True, env=env,
                         timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line.split() for line in run.stdout.splitlines() if not line.startswith("loads")]
    # Q4_1's qs bytes load 16 at a time (v4.b32) and its d, m once per group: no f16 load per element
    # would show as ld.global.b16 (the x row loads as b32)
    (loads,) = [line.split()[1:] for line in run.stdout.splitlines() if line.startswith("loads")]
    assert "ld.global.v4.b32" in loads and "ld.global.b16" not in loads and "ld.global.b8" not in loads, loads
    assert sorted((n, cc) for n, cc, *_ in lines) == sorted(
        [(n, cc) for n in names for cc in ("90", "80")] + [(names[2], "gfx942")])
    assert all(int(size) > 5_000 and ok == "True" for _, _, size, ok in lines)


_ON_GPU = textwrap.dedent("""
    import json
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels.qlayout import QUANT_TYPES, qmatmul_ref, random_raw, to_qweight
    from kernels.triton.qmatmul import qmatmul

    N, K, ROWS, REPEAT = 4096, 4096, (1, 8, 128), 20
    kernel, twin = jax.jit(qmatmul), jax.jit(qmatmul_ref)
    for t, name in QUANT_TYPES.items():
        w = to_qweight(random_raw(t, N, K, seed=t), t, N, K)
        for M in ROWS:
            x = jnp.asarray(np.random.default_rng(M).standard_normal((M, K)), jnp.float32)
            got, want = kernel(x, w).block_until_ready(), twin(x, w)
            start = time.perf_counter()
            for _ in range(REPEAT):
                kernel(x, w).block_until_ready()
            us = (time.perf_counter() - start) / REPEAT * 1e6
            err = float(jnp.abs(got - want).max() / jnp.abs(want).max())
            print(json.dumps({"type": name, "M": M, "max_rel_err": err, "us": round(us, 1)}))
""")


@pytest.mark.gpu
def test_kernels_against_twin_on_the_gpu():
    from kernels.triton.call import on_gpu

    if not on_gpu():
        pytest.skip("no CUDA/ROCm backend")
    # jax-triton compiles the real kernel: a process without the interpreter conftest chose here
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", _ON_GPU], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    print("\n".join(map(str, rows)))
    assert len(rows) == 3 * len(QUANT_TYPES)
    assert all(r["max_rel_err"] <= 1e-4 for r in rows), rows  # tf32x3 dots: f32 accuracy, another order
