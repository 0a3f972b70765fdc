"""The device layout (quantized blocks kept as they are, layers unrolled, ops through kernels/ops.py)
gives what the packed CPU path gives: on tiny random models, on the real SmolLM2 and gemma3, and, with the Triton
kernels forced on (interpreted here), in `model.wiring_check.run()` as `bankml gpu-check` runs it."""

from __future__ import annotations

import logging
from functools import partial
from types import SimpleNamespace

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from tiny_gguf import write_tiny_gguf

from gateway.monitor.bankml_routes import bankml_info
from gateway.serving.engine_client import EngineClient
from kernels import ops
from kernels.qlayout import QWeight, qmatmul_ref, random_raw, to_qweight
from model import wiring_check
from model.engine import Engine
from model.engine_thread import EngineThread
from model.forward import forward
from model.kvcache import init_pool
from model.messages import GenerateRequest, SamplingParams
from model.weights import device_bytes, file_tensor_bytes, load_weights

T = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """wiring_check's gemma3: six layers (one global), Q4_0/Q8_0/Q4_1/F16 mixed within and across layers."""
    return wiring_check.write_model(tmp_path_factory.mktemp("wiring") / "mixed.gguf")


def test_device_layout_keeps_each_layers_own_types_at_the_files_bytes(mixed):
    config, w = load_weights(mixed, verified=True, layout="device")
    assert isinstance(w.layers, tuple) and len(w.layers) == config.n_layer == 6
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    for il, layer in enumerate(w.layers):
        want = wiring_check.LAYER_TYPES[il % 2]
        for name, t in zip(names, want, strict=True):
            m = getattr(layer, name)
            if t in ("F16", "BF16"):
                assert m.dtype == (jnp.float16 if t == "F16" else jnp.bfloat16)  # 16-bit stays 16-bit
            else:
                assert isinstance(m, QWeight) and m.type_name == t
        assert layer.attn_norm.dtype == jnp.float32
    assert isinstance(w.token_embd, QWeight) and w.token_embd.type_name == "Q8_0"
    ratio = device_bytes(w) / file_tensor_bytes(mixed)
    assert 1.0 <= ratio <= 1.15


def test_layout_choice_is_checked(mixed):
    with pytest.raises(ValueError, match="layout must be one of"):
        load_weights(mixed, verified=True, layout="gpu")
    with pytest.raises(ValueError, match="contradicts"):
        load_weights(mixed, verified=True, layout="device", packed=True)
    with pytest.raises(ValueError, match="ggml"):
        load_weights(mixed, verified=True, layout="device", activations="ggml")
    _, w = load_weights(mixed, verified=True)  # the CPU default: today's stacked packed path
    assert not isinstance(w.layers, tuple)


def test_device_layout_with_the_twins_gives_the_packed_tokens_and_logits(mixed):
    """Ragged prompts prefilled in two chunks, then batched decode over the paged pool."""
    config, packed = load_weights(mixed, verified=True, layout="packed")
    _, device = load_weights(mixed, verified=True, layout="device")
    prompts = [np.random.default_rng(1).integers(0, config.n_vocab, n).tolist() for n in wiring_check.PROMPT_LENGTHS]
    want_tokens, want_logits = wiring_check.greedy(config, packed, prompts, 3)
    with ops.use("jnp"):
        got_tokens, got_logits = wiring_check.greedy(config, device, prompts, 3)
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_device_layout_lowers_for_cuda_with_every_dot_at_highest_precision(mixed):
    """No f32 dot may run as TF32 on Hopper: the decode step, exported for CUDA (twins), sets HIGHEST on all."""
    config, w = load_weights(mixed, verified=True, layout="device")

    def spec(a):
        return jax.ShapeDtypeStruct(a.shape, a.dtype)

    pool = jax.tree.map(spec, init_pool(config, 8, 16))
    i32 = jnp.int32
    args = (jax.tree.map(spec, w), pool, jax.ShapeDtypeStruct((2, 1), i32), jax.ShapeDtypeStruct((2, 4), i32),
            jax.ShapeDtypeStruct((2,), i32), jax.ShapeDtypeStruct((2,), i32))
    with ops.use("jnp"):
        step = jax.jit(lambda *a: forward(*a, config=config, window_pages=2))
        text = export.export(step, platforms=["cuda"])(*args).mlir_module()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) >= 7 * config.n_layer  # every matmul, the attention's and the LM head's
    loose = [line for line in dots if "precision = [HIGHEST, HIGHEST]" not in line]
    assert not loose, loose[:2]



@pytest.mark.parametrize("mode", ["jnp", "triton"])
def test_device_layout_steps_update_the_pool_in_place_without_copying_it(mixed, mode):
    """A decode step and a prefill chunk, compiled (the kernels' custom calls, or the twins' gathers,
    reading the pool): the scratch memory a step needs is far below the pool's size. A write of the new
    K/V that is not ordered after the last layer's reads of the pool makes XLA copy the whole pool, K and
    V, every step -- on a GPU whose pool takes most of the memory, a step that cannot run."""
    config, w = load_weights(mixed, verified=True, layout="device")

    def spec(a):
        return jax.ShapeDtypeStruct(a.shape, a.dtype)

    pool = jax.tree.map(spec, init_pool(config, 4096, 16))
    i32 = jnp.int32
    with ops.use(mode):
        for b, t in ((4, 1), (1, 64)):  # decode, prefill
            args = (jax.tree.map(spec, w), pool, jax.ShapeDtypeStruct((b, t), i32),
                    jax.ShapeDtypeStruct((b, 16), i32), jax.ShapeDtypeStruct((b,), i32),
                    jax.ShapeDtypeStruct((b,), i32))
            step = jax.jit(partial(forward, config=config, window_pages=4), donate_argnums=(1,))
            memory = step.lower(*args).compile().memory_analysis()
            assert memory.temp_size_in_bytes < pool.k.size * pool.k.dtype.itemsize / 4, (b, t, memory)

def test_engine_loads_the_device_layout_and_reports_it(tmp_path):
    path = write_tiny_gguf(tmp_path / "q8.gguf", "llama", n_layer=2, matrix_type=T.Q8_0, scale=0.3)
    engines = {layout: Engine.load(path, verified=True, n_ctx=64, max_seqs=2, warmup=False, layout=layout)
               for layout in ("packed", "device")}
    outs = {}
    for layout, engine in engines.items():
        tasks = [engine.add(GenerateRequest(p, SamplingParams(temperature=0.0, max_tokens=3), f"r{i}"))
                 for i, p in enumerate(([5, 6, 7, 8, 9] * 3, [40, 41, 42]))]  # both at once
        got = {t: [] for t in tasks}
        while engine.has_work():
            for t, out in engine.iterate().outputs:
                got[t].append(out.token)
        outs[layout] = list(got.values())
    assert outs["device"] == outs["packed"] and all(len(o) == 3 for o in outs["device"])

    report = engines["device"].weights_report()
    assert report["layout"] == "device" and report["file_bytes"] == file_tensor_bytes(path)
    assert report["ratio"] == pytest.approx(report["device_bytes"] / report["file_bytes"], rel=1e-3)
    assert report["ratio"] <= 1.15
    kernels = report["kernels"]
    assert kernels["backend"] == "cpu" and kernels["qmatmul"]["Q8_0"]["impl"] == "jnp"
    assert "cpu backend" in kernels["qmatmul"]["Q8_0"]["why"]
    assert kernels["decode_attention"]["impl"] == kernels["prefill_attention"]["impl"] == "jnp"
    assert engines["packed"].weights_report()["layout"] == "packed"

    # GET /bankml shows it for the resident engine, through its handle
    thread = EngineThread()
    try:
        thread.call(lambda: thread.set_engine(engines["device"])).result(30)
        loaded = SimpleNamespace(name="m", client=EngineClient(thread))
        state = SimpleNamespace(residency=SimpleNamespace(last=None, names=["m"], resident=lambda: [loaded],
                                                          most_recent=lambda: loaded), compat_listen=None)
        assert bankml_info(state)["weights"] == report
    finally:
        thread.stop()


def test_a_type_without_a_kernel_runs_its_twin_and_says_so(monkeypatch, caplog):
    only_q4_0 = SimpleNamespace(KERNEL_TYPES=("Q4_0",))
    real = ops._module
    monkeypatch.setattr(ops, "_module", lambda name: (only_q4_0, "") if name.endswith("qmatmul") else real(name))
    monkeypatch.setattr(ops, "_logged", set())
    w = to_qweight(random_raw(int(T.Q8_0), 8, 64, seed=0), int(T.Q8_0), 8, 64)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 64)), jnp.float32)
    assert ops.choice("qmatmul", "Q8_0")[0] == "jnp"  # the platform's choice here: the twins
    with ops.use("triton"), caplog.at_level(logging.WARNING, logger="kernels.ops"):
        assert ops.choice("qmatmul", "Q4_0") == ("triton", "forced (kernels.ops.use('triton'))")
        impl, why = ops.choice("qmatmul", "Q8_0")
        assert impl == "jnp" and "no kernel for Q8_0" in why
        for _ in range(2):
            np.testing.assert_array_equal(np.asarray(ops.qmatmul(x, w)), np.asarray(qmatmul_ref(x, w)))
        assert ops.report(["Q8_0"])["qmatmul"]["Q8_0"] == {"impl": "jnp", "why": why}
    told = [r for r in caplog.records if "Q8_0 runs its jnp twin" in r.getMessage()]
    assert len(told) == 1  # once, however often it is traced
    assert ops.mode() == "auto"
    with pytest.raises(ValueError, match="kernel mode"), ops.use("cuda"):
        pass


def test_take_rows_gathers_the_rows_of_a_qweight():
    raw = random_raw(int(T.Q4_1), 10, 64, seed=2)
    w = to_qweight(raw, int(T.Q4_1), 10, 64)
    dense = gguf.quants.dequantize(raw, T.Q4_1).reshape(10, 64)
    ids = jnp.array([[9, 0], [3, 3]])
    np.testing.assert_array_equal(np.asarray(ops.take_rows(w, ids)), dense[np.asarray(ids)])


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2_path", "gemma3_path"])
def test_real_model_in_device_layout_gives_the_packed_logits_and_tokens(request, model):
    """SmolLM2 (Q4_1, a Q8_0 embedding) and gemma3 Q4_K_M (layers mixing Q4_K/Q6_K and Q5_0/Q8_0) through
    the twins: the same greedy tokens, logits within rounding (f16 K/V rounding after every layer
    amplifies the paths' f32 rounding-order differences), device bytes within 1.15x of the file's."""
    path = request.getfixturevalue(model)
    results = {}
    for layout in ("packed", "device"):
        engine = Engine.load(path, verified=True, n_ctx=64, max_seqs=1, warmup=False, layout=layout)
        prompt = engine.tokenizer.encode("The capital of France is", True, False)
        seq, logits = list(prompt), None
        for _ in range(3):  # greedy by full forward: one compiled program (the 16-token bucket) per layout
            step = engine.logits(seq)
            logits = step if logits is None else logits
            seq.append(int(np.argmax(step[-1])))
        results[layout] = (seq[len(prompt):], logits)
        if layout == "device":
            assert engine.weights_report()["ratio"] <= 1.15
        del engine
    assert results["device"][0] == results["packed"][0]
    want = results["packed"][1]
    np.testing.assert_allclose(results["device"][1], want, rtol=0, atol=2e-3 * np.abs(want).max())
