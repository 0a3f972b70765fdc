"""Tensor parallelism (model/parallel.py, `--tensor-parallel N`) on simulated CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=N, in processes of their own: this one's JAX has
one device).

- what is refused, and why: heads, KV heads or FFN columns that do not split N ways, more devices than
  the platform has, quantized blocks a shard would cut, P0;
- the layout (tests/parallel_probe.py): each device holds about 1/N of the weight bytes, the shards of
  a nibble-packed row-parallel matrix are its columns, the compiled decode step has two all-reduces
  per layer and one for the embedding lookup, and one all-gather of the logits;
- through the HTTP API: SmolLM2 split 3 ways (9 heads, 3 KV heads) and gemma3 split 2 ways (4 heads,
  one KV head, held by both devices) answer greedy requests with the tokens one device gives, and
  /bankml and /props show the mesh, /bankml/usage and /metrics each device's bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import run_cli
from gateway_helpers import CliServer, free_port

from bankml.config import ConfigInvalid, load_config, serve_options
from bankml.guard import guard_file
from model import parallel
from model.config import Config

HERE = Path(__file__).parent
PROMPT = [1, 504, 3458, 282, 4649, 314, 216, 30, 2, 28, 14, 9]


def _devices(n: int) -> dict[str, str]:
    return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}", "JAX_PLATFORMS": "cpu"}


def _config(path: Path) -> Config:
    return Config.from_gguf(guard_file(path).metadata)


def test_refusals_name_the_reason(smollm2_path):
    smol = _config(smollm2_path)  # 9 heads, 3 KV heads, 1536 FFN columns
    assert parallel.refusal(smol, 3, 3, "cpu") is None
    assert parallel.refusal(smol, 1, 1, "cpu") is None
    assert "9 attention heads do not split 2 ways" in parallel.refusal(smol, 2, 2, "cpu")
    why = parallel.refusal(smol, 3, 1, "cpu")
    assert "needs 3 devices; this cpu platform has 1" in why and "device_count=3" in why
    assert "device_count" not in parallel.refusal(smol, 3, 2, "gpu")
    assert "at least 1" in parallel.refusal(smol, 0, 1, "cpu")
    six = dataclasses.replace(smol, n_head=6, n_head_kv=2)  # 2 KV heads: neither split 3 ways nor dividing 3
    assert "2 KV heads neither split 3 ways nor divide 3" in parallel.refusal(six, 3, 3, "cpu")
    odd_ffn = dataclasses.replace(smol, n_ff=1537)
    assert "1537 columns do not split 3 ways" in parallel.refusal(odd_ffn, 3, 3, "cpu")
    # device layout: attn_output's 576 input columns split 3 ways are 192, not whole Q4_K blocks of 256
    why = parallel.refusal(smol, 3, 3, "cpu", {"attn_output": 256})
    assert "attn_output's 576 input columns split 3 ways give 192, not whole blocks of 256" in why
    assert parallel.refusal(smol, 3, 3, "cpu", {"attn_output": 32, "ffn_down": 32}) is None


def test_p0_refuses_tensor_parallel(tmp_path):
    with pytest.raises(ConfigInvalid, match="--native.*--split-mode"):
        serve_options(load_config(None), tensor_parallel=2)
    options = serve_options(load_config(None), native=True, tensor_parallel=2)
    assert options.config.engine.tensor_parallel == 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_refuses_a_split_the_model_does_not_allow(bankml_cmd, smollm2_path, smollm2_fork):
    r = run_cli(bankml_cmd, "serve", str(smollm2_path), "--fork", str(smollm2_fork), "--native",
                "--tensor-parallel", "2", "--listen", f"127.0.0.1:{free_port()}", env=_devices(2), timeout=300)
    assert r.returncode != 0
    assert "9 attention heads do not split 2 ways" in r.stderr, r.stderr[-2000:]
    r = run_cli(bankml_cmd, "serve", str(smollm2_path), "--fork", str(smollm2_fork), "--native", "-tp", "4",
                "--listen", f"127.0.0.1:{free_port()}", env=_devices(1), timeout=300)
    assert r.returncode != 0
    assert "--tensor-parallel 4 needs 4 devices; this cpu platform has 1" in r.stderr, r.stderr[-2000:]


def _probe(path: Path, n: int, layout: str) -> dict:
    r = subprocess.run([sys.executable, str(HERE / "parallel_probe.py"), str(path), str(n), layout],
                       capture_output=True, text=True, timeout=600, env={**os.environ, **_devices(n)})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("model", "n", "layout"), [("smollm2", 3, "packed"), ("gemma3", 2, "device")])
def test_layout_bytes_and_collectives(request, model, n, layout):
    path = request.getfixturevalue(f"{model}_path")
    got = _probe(path, n, layout)
    whole = sum(got["bytes"]["whole"].values())
    split = got["bytes"]["split"]
    assert len(split) == n
    for device_bytes in split.values():  # about 1/N each: norms and (gemma3) the K/V projections are on all
        assert whole / n <= device_bytes < 1.05 * whole / n, (device_bytes, whole)
    assert got["argmax_same"], got
    assert got["max_rel_diff"] < 5e-3, got  # the all-reduces add the shares in another order, f16 K/V round
    assert got["q8_0_argmax_same"], got
    # two all-reduces a layer (attention output, FFN down) and one for the embedding lookup; the packed
    # layout's layers run under one lax.scan, whose body holds the layer's two
    per_layer = 2 if layout == "packed" else 2 * got["n_layer"]
    assert got["all_reduces"] == per_layer + 1, got
    assert got["all_gathers"] == 1, got  # the logits' vocabulary shares
    assert got["kv_split"] == (model == "smollm2")
    assert got["slot_roundtrip"]
    if layout == "packed":
        assert got["shard_columns_ok"]


@pytest.mark.timeout(600)
def test_tiny_models_split_as_they_run_whole(tmp_path):
    """Biases (qwen2), one KV head per device, an untied output, a vocabulary two devices do not divide,
    the packed, dense and device layouts, and the embeddings' forward."""
    r = subprocess.run([sys.executable, str(HERE / "parallel_probe.py"), "tiny", str(tmp_path)], capture_output=True,
                       text=True, timeout=600, env={**os.environ, **_devices(2)})
    assert r.returncode == 0, r.stderr[-3000:]
    cases = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(cases) == 5
    assert {c["layout"] for c in cases.values()} == {"packed", "dense", "device"}
    assert {c["kv_split"] for c in cases.values()} == {True, False}
    for name, c in cases.items():
        assert c["argmax_same"] and c["max_rel_diff"] < 1e-4 and c["embed_max_rel_diff"] < 1e-4, (name, c)
        assert not c["vocab_split"]  # 261 tokens: held whole on both devices


def test_packed_groups_are_whole_blocks_of_a_shard(smollm2_path):
    from model.weights import load_weights

    config, weights = load_weights(smollm2_path, verified=True, layout="packed")
    blocks = parallel.row_blocks(weights)
    assert blocks == {"attn_output": 32, "ffn_down": 32}  # Q4_1's groups of 32
    assert parallel.refusal(config, 3, 3, "cpu", blocks) is None
    narrow = dataclasses.replace(config, n_ff=1536 + 48)  # 528 columns a shard: not whole groups of 32
    assert "not whole blocks of 32" in parallel.refusal(narrow, 3, 3, "cpu", blocks)


def _greedy_reference(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """What one device answers (this process: one CPU device)."""
    from model.engine import Engine
    from model.messages import SamplingParams

    engine = Engine.load(path, verified=True, n_ctx=512, max_seqs=2, warmup=False)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [[o.token for o in engine.generate(p, params)] for p in prompts]


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize(("model", "n"), [("smollm2", 3), ("gemma3", 2)])
def test_split_server_answers_as_one_device(request, tmp_path, bankml_cmd, model, n):
    path = request.getfixturevalue(f"{model}_path")
    if model == "smollm2":
        fork = request.getfixturevalue("smollm2_fork")
    else:
        fork = tmp_path / "gemma3.FORK.json"
        assert run_cli(bankml_cmd, "fork", str(path), "-o", str(fork)).returncode == 0
    prompts = [PROMPT, [2, 105, 2364, 107, 3689, 563, 506, 5279, 529, 9079, 19, 106, 107]]
    want = _greedy_reference(path, prompts, 24)
    server = CliServer(bankml_cmd, str(path), "--fork", str(fork), "--ctx", "512", "--config", "cpu",
                       "--tensor-parallel", str(n), "--slot-dir", str(tmp_path / "slots"), env=_devices(n))
    try:
        assert f"split the weights {n} ways" in server.log()
        for prompt, tokens in zip(prompts, want, strict=True):
            r = httpx.post(server.url("/completion"), json={"prompt": prompt, "n_predict": 24, "temperature": 0,
                                                             "ignore_eos": True, "return_tokens": True},
                           timeout=300)
            assert r.status_code == 200, r.text
            assert r.json()["tokens"] == tokens
        info = httpx.get(server.url("/bankml"), timeout=30).json()
        mesh = info["mesh"]
        assert mesh["axes"] == {"tp": n} and mesh["processes"] == 1
        assert mesh["devices"] == [f"cpu:{i}" for i in range(n)]
        assert mesh["kv_heads"] == ("split" if model == "smollm2" else "one per device")
        assert sorted(mesh["weight_bytes"]) == mesh["devices"] and len(set(mesh["weight_bytes"].values())) == 1
        assert len(set(mesh["kv_bytes"].values())) == 1
        props = httpx.get(server.url("/props"), timeout=30).json()
        assert props["mesh"]["axes"] == {"tp": n}
        # a slot file holds the model's KV heads (gemma3's one, not one copy per device) and comes back
        body = {"prompt": prompts[0], "n_predict": 8, "temperature": 0, "ignore_eos": True, "id_slot": 0,
                "return_tokens": True}
        first = httpx.post(server.url("/completion"), json=body, timeout=300).json()["tokens"]
        saved = httpx.post(server.url("/slots/0?action=save"), json={"filename": "s.bin"}, timeout=60).json()
        heads = _config(path).n_head_kv * _config(path).head_dim
        per_cell = 2 * _config(path).n_layer * heads * 2  # K and V, f16
        assert saved["n_saved"] > 0 and saved["n_written"] >= saved["n_saved"] * per_cell
        assert saved["n_written"] < saved["n_saved"] * per_cell * 2  # not n copies of a replicated head
        assert httpx.post(server.url("/slots/0?action=erase"), json={}, timeout=60).status_code == 200
        restored = httpx.post(server.url("/slots/0?action=restore"), json={"filename": "s.bin"}, timeout=60).json()
        assert restored["n_restored"] == saved["n_saved"]
        assert httpx.post(server.url("/completion"), json=body, timeout=300).json()["tokens"] == first
        devices = httpx.get(server.url("/bankml/usage"), timeout=30).json()["engine_devices"]
        assert [d["device"] for d in devices] == mesh["devices"]
        assert all(d["weight_bytes"] == mesh["weight_bytes"][d["device"]] and d["kv_bytes"] > 0 for d in devices)
        metrics = httpx.get(server.url("/metrics"), timeout=30).text
        for name in mesh["devices"]:
            assert f'bankml_device_weight_bytes{{device="{name}"}}' in metrics
            assert f'bankml_device_kv_cache_bytes{{device="{name}"}}' in metrics
    finally:
        server.stop()
