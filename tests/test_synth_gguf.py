"""bench/synth_gguf.py: a synthetic model passes the gate and the engine generates from it; its plan is
the named model's (llama3-8b checked without writing its 4.9 GB)."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import synth_gguf  # noqa: E402

from bankml.verify import verify  # noqa: E402

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return synth_gguf.write(tmp_path_factory.mktemp("synth") / "tiny.gguf", "tiny")


def test_tiny_passes_the_gate_through_the_fork_json_beside_it(tiny):
    fork = tiny.with_name(tiny.name + ".FORK.json")
    verified = verify(tiny, fork.read_text())
    assert verified.arch == "llama"
    assert verified.types == {"F32": 5, "Q4_K": 13, "Q6_K": 3}


def test_tiny_blocks_are_sane_and_centred(tiny):
    reader = gguf.GGUFReader(str(tiny))
    shape = synth_gguf.SHAPES["tiny"]
    assert len(reader.tensors) == len(synth_gguf.tensor_plan(shape))
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        assert np.isfinite(w).all(), t.name
        if t.tensor_type == Q.F32:
            continue
        d_at = 208 if t.tensor_type == Q.Q6_K else 0
        d = t.data.reshape(-1, gguf.GGML_QUANT_SIZES[t.tensor_type][1])[:, d_at:d_at + 2].copy().view(np.float16)
        assert (d > 0).all() and np.isfinite(d).all(), t.name
        assert 0.015 < w.std() < 0.025, (t.name, w.std())
        assert abs(w.mean()) < 0.1 * w.std(), (t.name, w.mean())


def test_the_engine_loads_tiny_and_generates(tiny):
    from model.engine import Engine
    from model.messages import SamplingParams

    engine = Engine.load(tiny, verified=True, n_ctx=64, max_seqs=1, warmup=False)
    eot = synth_gguf.SHAPES["tiny"].n_vocab - len(synth_gguf.SPECIALS) + synth_gguf.SPECIALS.index("<|eot_id|>")
    assert eot in engine.eog_ids
    prompt = engine.tokenizer.encode("hello there", True, False)
    assert prompt[0] == engine.config.n_vocab - len(synth_gguf.SPECIALS)  # <|begin_of_text|>
    outs = list(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4)))
    assert len(outs) == 4 and all(0 <= o.token < engine.config.n_vocab for o in outs)
    assert outs[-1].finish_reason is not None


def test_a_tensor_streams_in_chunks_into_the_same_layout(tmp_path, monkeypatch, tiny):
    monkeypatch.setattr(synth_gguf, "CHUNK_BYTES", 4096)  # the 512 x 256 Q4_K embedding: 18 chunks
    shape = synth_gguf.SHAPES["tiny"]
    chunks = list(synth_gguf.tensor_chunks(np.random.default_rng(0), (shape.n_vocab, shape.n_embd), Q.Q4_K))
    assert len(chunks) > 1 and max(c.nbytes for c in chunks) <= 4096
    small = synth_gguf.write(tmp_path / "tiny.gguf", "tiny")
    data_start = gguf.GGUFReader(str(tiny)).data_offset
    assert small.stat().st_size == tiny.stat().st_size
    assert small.read_bytes()[:data_start] == tiny.read_bytes()[:data_start]  # header and tensor table
    assert verify(small, small.with_name("tiny.gguf.FORK.json").read_text()).types == {"F32": 5, "Q4_K": 13,
                                                                                       "Q6_K": 3}


def test_llama3_8b_plan_is_q4_k_m_and_4_9_gb():
    shape = synth_gguf.SHAPES["llama3-8b"]
    plan = synth_gguf.tensor_plan(shape)
    types = {name: q for name, _, q in plan}
    assert len(plan) == 3 + 9 * 32
    assert types["output.weight"] == Q.Q6_K and types["token_embd.weight"] == Q.Q4_K
    v6 = [il for il in range(32) if types[f"blk.{il}.attn_v.weight"] == Q.Q6_K]
    assert v6 == [il for il in range(32) if types[f"blk.{il}.ffn_down.weight"] == Q.Q6_K]
    assert v6 == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]  # llama-quant.cpp's use_more_bits
    assert all(types[f"blk.{il}.ffn_gate.weight"] == Q.Q4_K for il in range(32))
    assert dict((n, s) for n, s, _ in plan)["blk.0.attn_k.weight"] == (8 * 128, 4096)
    total = sum(synth_gguf.nbytes(s, q) for _, s, q in plan)
    assert 4.85e9 < total < 4.95e9  # llama.cpp's Meta-Llama-3-8B Q4_K_M: 4.92 GB
    tokens, _ = synth_gguf.vocabulary(shape)
    assert len(tokens) == 128256 and len(set(tokens)) == 128256 and tokens[128009] == "<|eot_id|>"
