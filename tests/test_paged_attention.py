"""Paged attention: the jnp twins against a dense reference and the forward pass's own attention, and
the Triton kernels under Triton's interpreter against the twins (plus an AOT compile for sm_90/sm_80).

Shapes are the shipped models' head layouts at toy lengths: gemma3 is 4 query heads on 1 kv head with
Dh 256 and a sliding window, SmolLM2 9 on 3 with Dh 64. Every row's pages are shuffled through the pool.
A q8_0 pool (int8 quants and their blocks' f16 scales, kernels/kvquant.py) runs the same checks against
the dense softmax over its dequantized cells.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import paged_attention as twin
from kernels.kvquant import as_cached, dequantize_q8_0
from kernels.triton import attention as tk
from model import forward as fwd
from model.config import Config

GEMMA3 = dict(group=4, kv_heads=1, head_dim=256)
SMOLLM2 = dict(group=3, kv_heads=3, head_dim=64)
P = 16


def _inputs(shape: dict, starts, t: int, seed: int = 0, max_pages: int = 8, n_pages: int = 12,
            cache_type: str = "f16"):
    x = tk.check_inputs(seed, batch=len(starts), t=t, page=P, n_pages=n_pages, max_pages=max_pages,
                        cache_type=cache_type, **shape)
    x["starts"] = jnp.asarray(starts, jnp.int32)
    return x


def _pool_args(x: dict):
    return x["k_pool"], x["v_pool"], x["layer"], x["table"], x["starts"]


def _scales(x: dict) -> dict:
    return dict(k_scale=x["k_scale"], v_scale=x["v_scale"])


def _dequantized(x: dict) -> dict:
    """A q8_0 input as the dense reference reads it: its pools dequantized, its new K/V rounded through
    q8_0 as the forward rounds them before attention."""
    return dict(x, k_pool=dequantize_q8_0(x["k_pool"], x["k_scale"]), v_pool=dequantize_q8_0(x["v_pool"], x["v_scale"]),
                k_new=as_cached(x["k_new"], "q8_0"), v_new=as_cached(x["v_new"], "q8_0"), k_scale=None, v_scale=None)


def _dense(x: dict, n_new, window: int, scale: float) -> np.ndarray:
    """Softmax over the gathered cells each query may see, one query at a time, in f64."""
    q, kn, vn = (np.asarray(x[k], np.float64) for k in ("q", "k_new", "v_new"))
    kp, vp = (np.asarray(x[k][int(x["layer"])], np.float64) for k in ("k_pool", "v_pool"))
    table, starts = np.asarray(x["table"]), np.asarray(x["starts"])
    b, t, h, dh = q.shape
    g = h // kn.shape[2]
    out = np.zeros(q.shape)
    for row in range(b):
        for ti in range(int(n_new[row])):
            pos = starts[row] + ti
            for hi in range(h):
                keys, vals = [], []
                for w in range(starts[row]):
                    if not window or pos - w < window:
                        keys.append(kp[table[row, w // P], hi // g, w % P])
                        vals.append(vp[table[row, w // P], hi // g, w % P])
                for s in range(ti + 1):
                    if not window or ti - s < window:
                        keys.append(kn[row, s, hi // g])
                        vals.append(vn[row, s, hi // g])
                scores = np.stack(keys) @ q[row, ti, hi] * scale
                p = np.exp(scores - scores.max())
                out[row, ti, hi] = p @ np.stack(vals) / p.sum()
    return out


def _config(shape: dict, window: int) -> Config:
    h = shape["group"] * shape["kv_heads"]
    return Config(arch="gemma3", n_vocab=8, n_ctx_train=1024, n_embd=h * shape["head_dim"], n_layer=2, n_head=h,
                  n_head_kv=shape["kv_heads"], head_dim=shape["head_dim"], n_ff=8, n_rot=shape["head_dim"],
                  norm_eps=1e-6, rope_neox=True, rope_base=1e6, rope_freq_scale=1.0, rope_base_swa=1e4,
                  rope_freq_scale_swa=1.0, attn_scale=1.0 / math.sqrt(shape["head_dim"]), n_swa=window,
                  swa_layers=(bool(window),) * 2, embd_scale=1.0, final_logit_softcap=0.0, ffn_gelu=True,
                  qk_norm=True, post_norms=True)


@partial(jax.jit, static_argnames="config")
def _forward_attention(x: dict, config: Config) -> jax.Array:
    """model.forward._attention on the same cells, gathered and stale-zeroed as `forward` does."""
    b, t = x["q"].shape[:2]
    il, table, starts = x["layer"], x["table"], x["starts"]
    stale = (jnp.arange(table.shape[1] * P) >= starts[:, None]).reshape(b, table.shape[1], 1, P, 1)
    k_old = x["k_pool"][il, table].astype(jnp.float32)  # [B, Wp, Hkv, P, Dh]
    v_old = jnp.where(stale, 0.0, x["v_pool"][il, table].astype(jnp.float32))
    positions = starts[:, None] + jnp.arange(t)
    out = fwd._attention(x["q"], x["k_new"], x["v_new"], k_old, v_old, starts, positions, jnp.bool_(config.n_swa > 0),
                         config)
    return out.reshape(x["q"].shape)


def _close(got, want, rtol: float = 1e-5):
    got, want = np.asarray(got), np.asarray(want)
    assert np.all(np.isfinite(got))
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err <= rtol, err


# --- the twins --------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,window", [(GEMMA3, 24), (SMOLLM2, 0)])
def test_prefill_twin_matches_dense_softmax_and_forward(shape, window):
    x = _inputs(shape, starts=[37, 0, 100], t=6)
    n_new = jnp.array([6, 4, 6], jnp.int32)
    scale = 1.0 / math.sqrt(shape["head_dim"])
    got = twin.prefill_attention(x["q"], x["k_new"], x["v_new"], *_pool_args(x), n_new, window=window, scale=scale)
    _close(got, _dense(x, n_new, window, scale))
    real = (jnp.arange(6)[None, :] < n_new[:, None])[:, :, None, None]
    _close(jnp.where(real, got, 0), jnp.where(real, _forward_attention(x, config=_config(shape, window)), 0))
    assert not np.any(np.asarray(got)[1, 4:])  # padding rows come back zero


@pytest.mark.parametrize("shape,window", [(GEMMA3, 24), (SMOLLM2, 0)])
def test_decode_twin_matches_dense_softmax_and_forward(shape, window):
    x = _inputs(shape, starts=[37, 0, 100], t=1)
    scale = 1.0 / math.sqrt(shape["head_dim"])
    got = twin.decode_attention(x["q"][:, 0], x["k_new"][:, 0], x["v_new"][:, 0], *_pool_args(x), window=window,
                                scale=scale)
    _close(got, _dense(x, [1, 1, 1], window, scale)[:, 0])
    _close(got, _forward_attention(x, config=_config(shape, window))[:, 0])


def test_the_window_changes_the_answer():
    # guards the window tests above against a context that never leaves the window
    x = _inputs(GEMMA3, starts=[100], t=1)
    args = (x["q"][:, 0], x["k_new"][:, 0], x["v_new"][:, 0], *_pool_args(x))
    windowed = twin.decode_attention(*args, window=24, scale=0.0625)
    assert np.max(np.abs(np.asarray(windowed - twin.decode_attention(*args, window=0, scale=0.0625)))) > 1e-3


@pytest.mark.parametrize("shape,window", [(GEMMA3, 24), (SMOLLM2, 0)])
def test_q8_0_twins_match_dense_softmax_over_the_dequantized_cells(shape, window):
    x = _inputs(shape, starts=[37, 0, 100], t=6, cache_type="q8_0")
    assert x["k_pool"].dtype == jnp.int8
    dense_x = _dequantized(x)
    n_new = jnp.array([6, 4, 6], jnp.int32)
    scale = 1.0 / math.sqrt(shape["head_dim"])
    got = twin.prefill_attention(x["q"], x["k_new"], x["v_new"], *_pool_args(x), n_new, window=window, scale=scale,
                                 **_scales(x))
    _close(got, _dense(dense_x, n_new, window, scale))
    one = (x["q"][:, 0], x["k_new"][:, 0], x["v_new"][:, 0])
    got = twin.decode_attention(*one, *_pool_args(x), window=window, scale=scale, **_scales(x))
    _close(got, _dense(dense_x, [1, 1, 1], window, scale)[:, 0])
    # and the scales matter: the same quants read as f16 values are far off
    off = twin.decode_attention(*one, x["k_pool"].astype(jnp.float16), x["v_pool"].astype(jnp.float16),
                                *_pool_args(x)[2:], window=window, scale=scale)
    assert np.max(np.abs(np.asarray(off - got))) > 0.1


def _poison_stale(x: dict, value: float) -> dict:
    """Every cell at or past its row's start, in every layer, holds `value` (a reused page's leftovers)."""
    k, v = np.array(x["k_pool"]), np.array(x["v_pool"])
    for row, start in enumerate(np.asarray(x["starts"])):
        for w in range(int(start), x["table"].shape[1] * P):
            page = int(x["table"][row, w // P])
            k[:, page, :, w % P] = value
            v[:, page, :, w % P] = value
    listed = set(np.asarray(x["table"]).ravel().tolist())
    unlisted = [p for p in range(k.shape[1]) if p not in listed]
    k[:, unlisted], v[:, unlisted] = value, value
    return dict(x, k_pool=jnp.asarray(k), v_pool=jnp.asarray(v))


def _poison_stale_scales(x: dict, value: float) -> dict:
    """A q8_0 pool's stale cells: their blocks' scales hold `value` (what a NaN or inf K/V quantizes to)."""
    poisoned = _poison_stale(dict(x, k_pool=x["k_scale"], v_pool=x["v_scale"]), value)
    return dict(x, k_scale=poisoned["k_pool"], v_scale=poisoned["v_pool"])


@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_stale_cells_past_a_rows_start_never_reach_the_output(value, cache_type):
    # the rows share no page; page 0, where a kernel's masked-off table lookups point, is row 1's last: stale
    x = _inputs(GEMMA3, starts=[37, 20], t=4, n_pages=16, cache_type=cache_type)
    x["table"] = jnp.arange(15, -1, -1, dtype=jnp.int32).reshape(2, 8)
    bad = _poison_stale(x, value) if cache_type == "f16" else _poison_stale_scales(x, value)
    n_new = jnp.array([4, 3], jnp.int32)
    for attn in (twin, tk):
        clean = attn.prefill_attention(x["q"], x["k_new"], x["v_new"], *_pool_args(x), n_new, window=0,
                                       scale=0.0625, **_scales(x))
        got = attn.prefill_attention(bad["q"], bad["k_new"], bad["v_new"], *_pool_args(bad), n_new, window=0,
                                     scale=0.0625, **_scales(bad))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(clean))
        one = (bad["q"][:, 0], bad["k_new"][:, 0], bad["v_new"][:, 0])
        got = attn.decode_attention(*one, *_pool_args(bad), window=24, scale=0.0625, **_scales(bad))
        clean = attn.decode_attention(x["q"][:, 0], x["k_new"][:, 0], x["v_new"][:, 0], *_pool_args(x), window=24,
                                      scale=0.0625, **_scales(x))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(clean))


# --- the Triton kernels, interpreted ----------------------------------------------------------------

# per-row starts: mid-page, none cached, past the window with its first split wholly outside it, a page edge
STARTS = [37, 0, 100, 64]


@pytest.mark.parametrize("shape,window", [(GEMMA3, 24), (GEMMA3, 0), (SMOLLM2, 0), (SMOLLM2, 40)])
def test_triton_decode_matches_twin(shape, window):
    x = _inputs(shape, starts=STARTS, t=1)
    one = (x["q"][:, 0], x["k_new"][:, 0], x["v_new"][:, 0])
    kw = dict(window=window, scale=1.0 / math.sqrt(shape["head_dim"]))
    _close(tk.decode_attention(*one, *_pool_args(x), **kw), twin.decode_attention(*one, *_pool_args(x), **kw))


@pytest.mark.parametrize("shape,window,t", [(GEMMA3, 24, 12), (SMOLLM2, 0, 8),
                                            (dict(group=1, kv_heads=2, head_dim=64), 5, 8),
                                            (dict(group=1, kv_heads=1, head_dim=16), 5, 136)])
def test_triton_prefill_matches_twin(shape, window, t):
    # n_new: a full row, padding past a few tokens (gemma3's query blocks past it are skipped), one token, none;
    # at 136 tokens the last query block's window starts tiles past the first new token
    x = _inputs(shape, starts=STARTS, t=t)
    n_new = jnp.array([t, 3, 1, 0], jnp.int32)
    new = (x["q"], x["k_new"], x["v_new"])
    kw = dict(window=window, scale=1.0 / math.sqrt(shape["head_dim"]))
    got = tk.prefill_attention(*new, *_pool_args(x), n_new, **kw)
    _close(got, twin.prefill_attention(*new, *_pool_args(x), n_new, **kw))
    assert not np.any(np.asarray(got)[1, 3:]) and not np.any(np.asarray(got)[3])


@pytest.mark.parametrize("shape,window", [(GEMMA3, 24), (SMOLLM2, 0), (dict(group=1, kv_heads=2, head_dim=96), 5)])
def test_triton_kernels_over_a_q8_0_pool_match_the_twin(shape, window):
    # Dh 96: BLOCK_D 128 pads past the last of three blocks, whose scales must not be read
    x = _inputs(shape, starts=STARTS, t=8, cache_type="q8_0")
    kw = dict(window=window, scale=1.0 / math.sqrt(shape["head_dim"]), **_scales(x))
    one = (x["q"][:, 0], x["k_new"][:, 0], x["v_new"][:, 0])
    _close(tk.decode_attention(*one, *_pool_args(x), **kw), twin.decode_attention(*one, *_pool_args(x), **kw))
    n_new = jnp.array([8, 3, 1, 0], jnp.int32)
    new = (x["q"], x["k_new"], x["v_new"])
    got = tk.prefill_attention(*new, *_pool_args(x), n_new, **kw)
    _close(got, twin.prefill_attention(*new, *_pool_args(x), n_new, **kw))
    assert not np.any(np.asarray(got)[1, 3:]) and not np.any(np.asarray(got)[3])


def test_a_start_past_the_tables_columns_reads_only_the_listed_pages():
    # the twins see the cells the table lists; the kernels must not read page ids past a row's columns
    x = _inputs(SMOLLM2, starts=[70, 37], t=3, max_pages=2)
    n_new = jnp.array([3, 3], jnp.int32)
    one, new = (x["q"][:, 0], x["k_new"][:, 0], x["v_new"][:, 0]), (x["q"], x["k_new"], x["v_new"])
    _close(tk.decode_attention(*one, *_pool_args(x), window=0, scale=0.125),
           twin.decode_attention(*one, *_pool_args(x), window=0, scale=0.125))
    _close(tk.prefill_attention(*new, *_pool_args(x), n_new, window=0, scale=0.125),
           twin.prefill_attention(*new, *_pool_args(x), n_new, window=0, scale=0.125))


def test_triton_decode_under_jit_serves_every_layer_from_one_program():
    x = _inputs(SMOLLM2, starts=[37, 5], t=1)
    one = (x["q"][:, 0], x["k_new"][:, 0], x["v_new"][:, 0])
    step = jax.jit(lambda layer: tk.decode_attention(*one, x["k_pool"], x["v_pool"], layer, x["table"],
                                                     x["starts"], window=0, scale=0.125))
    for layer in (0, 1):
        want = twin.decode_attention(*one, x["k_pool"], x["v_pool"], jnp.int32(layer), x["table"], x["starts"],
                                     window=0, scale=0.125)
        _close(step(jnp.int32(layer)), want)
    assert step._cache_size() == 1


def test_decode_splits_fill_the_gpu_and_cover_the_table():
    for batch, kv_heads, max_pages in ((1, 1, 2048), (8, 8, 256), (1, 1, 4), (64, 8, 64)):
        splits, cells = tk.decode_splits(batch, kv_heads, max_pages, P)
        assert cells % tk.DECODE_BLOCK_N == 0 and (splits - 1) * cells < max_pages * P <= splits * cells
        tiles = max_pages * P // tk.DECODE_BLOCK_N
        assert batch * kv_heads * splits >= min(tk.GPU_PROGRAMS // 2, batch * kv_heads * tiles)  # a wave of 132 SMs


def test_shapes_the_kernels_cannot_take_are_refused():
    x = _inputs(dict(group=1, kv_heads=3, head_dim=64), starts=[5], t=1)
    with pytest.raises(ValueError, match="do not group"):
        tk.decode_attention(x["q"][:, 0, :2], x["k_new"][:, 0], x["v_new"][:, 0], *_pool_args(x), window=0,
                            scale=0.125)
    x = _inputs(dict(group=2, kv_heads=1, head_dim=8), starts=[5], t=2)
    with pytest.raises(ValueError, match="head_dim 8"):
        tk.prefill_attention(x["q"], x["k_new"], x["v_new"], *_pool_args(x), jnp.array([2]), window=0, scale=0.3)
    x = _inputs(dict(group=2, kv_heads=1, head_dim=48), starts=[5], t=2)
    with pytest.raises(ValueError, match="q8_0 cache needs head_dim % 32 == 0, not 48"):
        tk.decode_attention(x["q"][:, 0], x["k_new"][:, 0], x["v_new"][:, 0], *_pool_args(x), window=0, scale=0.3,
                            k_scale=x["k_pool"][..., :1], v_scale=x["v_pool"][..., :1])


def test_interpret_checks_pass():
    results = tk.interpret_checks()
    # one result per kernel, cache type and case, under the kernel's AotVariant name and types: gpu-check
    # joins the two on them (a q8_0 pool has no merge of its own: the merge reads no pool)
    per_type = {t: sorted({v.name for v in tk.aot_variants() if v.types == (t,)}) for t in ("f16", "q8_0")}
    assert per_type == {"f16": ["attn_decode_merge", "attn_decode_split", "attn_prefill"],
                        "q8_0": ["attn_decode_split", "attn_prefill"]}
    for t, names in per_type.items():
        assert sorted(r.name for r in results if r.types == (t,)) == sorted(names * 2)
    assert all(r.ok and r.max_rel_err <= r.tolerance for r in results), results


# --- ahead of time, for the GPUs --------------------------------------------------------------------

_AOT = """
import json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from kernels.triton.attention import NUM_STAGES, NUM_WARPS, aot_variants
out = []
for v in aot_variants():
    if (v.constexprs["DH"], v.constexprs["G"]) not in ((64, 3), (256, 4)):  # SmolLM2's and gemma3's
        continue
    for arch in (90, 80):
        k = compile(ASTSource(fn=v.kernel, signature=v.signature, constexprs=v.constexprs, attrs=v.attrs),
                    target=GPUTarget("cuda", arch, 32), options=dict(num_warps=NUM_WARPS, num_stages=NUM_STAGES))
        out.append([v.kernel.__name__, arch, len(k.asm["cubin"]), k.metadata.shared, ".target sm_%d" % arch in k.asm["ptx"]])
json.dump(out, sys.stdout)
"""

SHARED_BYTES = {90: 232448, 80: 166912}  # the most shared memory one block may have: H100/H200, A100


def test_aot_compiles_decode_merge_and_prefill_for_sm90_and_sm80():
    variants = tk.aot_variants()
    assert {v.constexprs["DH"] for v in variants} == {64, 128, 256}
    assert {v.constexprs["G"] for v in variants} == {1, 3, 4, 8}
    assert all(list(v.signature) == v.kernel.arg_names for v in variants)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", _AOT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = json.loads(done.stdout)
    assert {kernel for kernel, *_ in compiled} == {"_decode_split", "_decode_merge", "_prefill"}
    assert len(compiled) == 20  # 2 shapes x (3 f16 kernels + 2 q8_0) x 2 targets
    for name, arch, cubin_bytes, shared, ptx_target in compiled:
        assert cubin_bytes > 0 and ptx_target, name
        assert shared <= SHARED_BYTES[arch], (name, arch, shared)


# --- on a GPU (marker `gpu`): the compiled kernels against the twins at serving sizes ----------------

_ON_GPU = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from kernels import paged_attention as twin
from kernels.triton import attention as tk
from kernels.triton.call import on_gpu
assert on_gpu(), jax.default_backend()
errs = {}
starts = jnp.array([0, 1, 15, 16, 17, 300, 700, 950], jnp.int32)
n_new = jnp.array([64, 1, 30, 64, 2, 64, 10, 24], jnp.int32)
for name, dh, h, hkv, window in tk.AOT_SHAPES:
    x = tk.check_inputs(0, batch=8, kv_heads=hkv, group=h // hkv, head_dim=dh, t=64, n_pages=640, max_pages=64)
    pool = (x["k_pool"], x["v_pool"], x["layer"], x["table"], starts)
    kw = dict(window=window, scale=dh ** -0.5)
    one = (x["q"][:, 0], x["k_new"][:, 0], x["v_new"][:, 0])
    new = (x["q"], x["k_new"], x["v_new"])
    for kind, got, want in (("decode", tk.decode_attention(*one, *pool, **kw), twin.decode_attention(*one, *pool, **kw)),
                            ("prefill", tk.prefill_attention(*new, *pool, n_new, **kw),
                             twin.prefill_attention(*new, *pool, n_new, **kw))):
        errs[f"{kind}_{name}"] = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
json.dump(errs, sys.stdout)
"""


@pytest.mark.gpu
def test_compiled_kernels_match_the_twins_on_a_gpu():
    if jax.default_backend() not in ("gpu", "cuda", "rocm"):
        pytest.skip("needs a GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # jax-triton compiles for the device
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", _ON_GPU], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    errs = json.loads(done.stdout)
    assert len(errs) == 2 * len(tk.AOT_SHAPES) and max(errs.values()) <= 1e-5, errs
