"""One model across processes (model/distributed.py: jax.distributed, gloo on the CPU), two processes on
this machine:

- the wire format of the lockstep ops, and the flags' checks;
- a process whose file differs, or whose gate refuses its file, is named, and every process refuses;
- gemma3 split over two processes (one CPU device each) answers greedy requests through process 0's
  HTTP API with the tokens one process gives, /bankml shows the mesh over two processes, what does
  not span processes yet is refused with the reason, and a stop of process 0 stops the other;
- a process that dies: process 0's answer in flight ends with an error and its server stops; the
  follower of a process 0 that dies stops too. Nothing waits forever.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import run_cli
from gateway_helpers import CliServer, free_port, tiny_model
from tiny_gguf import write_tiny_gguf

from bankml.config import ConfigInvalid, load_config, serve_options
from bankml.pin import fork_record
from model import distributed
from model.sampler_chain import chain_arrays

PROMPT = [2, 105, 2364, 107, 3689, 563, 506, 5279, 529, 9079, 19, 106, 107]
ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}


def test_ops_cross_as_json_and_npz_without_pickle():
    sa = chain_arrays([None, None], [7, 8])
    rows = np.array([1, 2], np.int32)
    data = distributed.encode("sample", ("select", 2, 0, sa, None, None, None, rows, 3.5, True))
    assert b"pickle" not in data
    op, args = distributed.decode(data)
    assert op == "sample" and args[:3] == ("select", 2, 0) and args[4:7] == (None, None, None)
    assert args[8:] == (3.5, True)
    np.testing.assert_array_equal(args[7], rows)
    assert type(args[3]) is type(sa)
    for name in ("seed", "temperature", "top_k"):
        np.testing.assert_array_equal(getattr(args[3], name), getattr(sa, name))
    with pytest.raises(TypeError, match="not sent to the other processes"):
        distributed.encode("forward", (object(),))


def test_every_process_compiles_a_program_before_its_first_run(monkeypatch):
    """A program's collectives give a late process 30 s (gloo's): before a program first runs, every
    process waits at a barrier until all have compiled it; the same program later runs without one."""
    calls = []

    class Client:
        def wait_at_barrier(self, name, timeout_ms):
            calls.append((name, timeout_ms))

    monkeypatch.setattr(distributed, "_client", Client)
    lockstep = distributed.Lockstep()
    for key in [("decode", 1, 4), ("select", 1, 0), ("decode", 1, 4), ("decode", 2, 4), ("select", 1, 0)]:
        lockstep.compiled(key)
    assert [name for name, _ in calls] == ["bankml/compiled/0", "bankml/compiled/1", "bankml/compiled/2"]
    assert all(ms >= 600_000 for _, ms in calls)  # a compile on a busy machine takes minutes


def test_the_runner_waits_for_the_others_before_a_program_first_runs(tmp_path):
    from model.engine import Engine

    engine = Engine.load(write_tiny_gguf(tmp_path / "tiny.gguf"), verified=True, n_ctx=64, max_seqs=2, warmup=False)
    order = []
    compile_program = engine.compiled.get
    engine.compiled.get = lambda *key: order.append(("compiled", key)) or compile_program(*key)
    engine.runner.barrier = lambda key: order.append(("barrier", key))
    from model.messages import SamplingParams

    list(engine.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)))
    ran = {key for what, key in order if what == "compiled"}
    assert {key[0] for key in ran} >= {"row", "prefill", "select"}
    assert {key for what, key in order if what == "barrier"} == ran
    for i, (what, key) in enumerate(order):  # each barrier right after its program's compile
        if what == "barrier":
            assert order[i - 1] == ("compiled", key)


def test_cluster_flags_are_checked(monkeypatch):
    config = load_config(None)
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigInvalid, match="--coordinator HOST:PORT is needed"):
        serve_options(config, native=True, num_processes=2)
    with pytest.raises(ConfigInvalid, match="--process-id 2 is not in 0..1"):
        serve_options(config, native=True, num_processes=2, process_id=2, coordinator="127.0.0.1:9")
    with pytest.raises(ConfigInvalid, match="--native"):
        serve_options(config, num_processes=2, coordinator="127.0.0.1:9")
    with pytest.raises(ConfigInvalid, match="without --num-processes"):
        serve_options(config, native=True, process_id=1)
    with pytest.raises(ConfigInvalid, match="serve the whole model alone"):
        serve_options(config, native=True, coordinator="127.0.0.1:9")
    options = serve_options(config, native=True, num_processes=2, process_id=1, coordinator="127.0.0.1:9")
    assert options.cluster == ("127.0.0.1:9", 2, 1)
    assert serve_options(config, native=True).cluster is None
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:19")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "3")
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    assert serve_options(config, native=True).cluster == ("127.0.0.1:19", 3, 2)  # JAX's own variables
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(ConfigInvalid, match="JAX_NUM_PROCESSES"):
        serve_options(config, native=True)


def _serve(bankml_cmd, model: Path, fork: Path, pid: int, coordinator: str, *extra: str) -> subprocess.Popen:
    port = free_port()
    return subprocess.Popen([*bankml_cmd, "serve", str(model), "--fork", str(fork), "--native",
                             "--listen", f"127.0.0.1:{port}", "--upstream", f"127.0.0.1:{free_port()}",
                             "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(pid), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **ENV})


def _both_refuse(procs: list[subprocess.Popen]) -> list[str]:
    errs = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            raise
        assert p.returncode == 2, err[-2000:]
        errs.append(err)
    return errs


@pytest.mark.timeout(300)
def test_a_differing_file_is_named_and_every_process_refuses(tmp_path, bankml_cmd):
    a, fork_a = tiny_model(tmp_path / "a", "Model.Q8_0.gguf")
    (tmp_path / "b").mkdir()
    b = write_tiny_gguf(tmp_path / "b" / "Model.Q8_0.gguf", seed=1)  # the same name, other weights
    fork_b = b.with_name(b.name + ".FORK.json")
    fork_b.write_text(json.dumps(fork_record(b)))
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [_serve(bankml_cmd, a, fork_a, 0, coordinator), _serve(bankml_cmd, b, fork_b, 1, coordinator)]
    sha_a, sha_b = (json.loads(f.read_text())["files"][0]["sha256"] for f in (fork_a, fork_b))
    assert sha_a != sha_b
    for err in _both_refuse(procs):
        assert f"process 1's file has sha256 {sha_b}, process 0's {sha_a}" in err, err[-2000:]


@pytest.mark.timeout(300)
def test_a_refused_gate_is_named_on_every_process(tmp_path, bankml_cmd):
    a, fork_a = tiny_model(tmp_path / "a", "Model-A.Q8_0.gguf")
    b, _ = tiny_model(tmp_path / "b", "Model-B.Q8_0.gguf")
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [_serve(bankml_cmd, a, fork_a, 0, coordinator), _serve(bankml_cmd, b, fork_a, 1, coordinator)]
    for err in _both_refuse(procs):  # process 1 pins its file with another file's FORK.json
        assert "process 1's gate refused its file" in err, err[-2000:]


def _reference(path: Path, n: int) -> list[int]:
    from model.engine import Engine
    from model.messages import SamplingParams

    engine = Engine.load(path, verified=True, n_ctx=512, max_seqs=2, warmup=False)
    return [o.token for o in engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))]


class _Cluster:
    """gemma3 over two processes: process 0 a CliServer (HTTP), process 1 its follower."""

    def __init__(self, bankml_cmd, path: Path, fork: Path):
        coordinator = f"127.0.0.1:{free_port()}"
        common = ["--fork", str(fork), "--ctx", "512", "--config", "cpu", "--coordinator", coordinator,
                  "--num-processes", "2"]
        self.follower = _serve(bankml_cmd, path, fork, 1, coordinator, "--ctx", "512", "--config", "cpu")
        self.follower_lines: list[str] = []
        try:
            self.leader = CliServer(bankml_cmd, str(path), *common, "--process-id", "0", env=ENV)
        except Exception:
            self.follower.kill()
            raise

    def stop(self) -> None:
        self.leader.stop()
        if self.follower.poll() is None:
            self.follower.kill()
        self.follower.wait(10)


@pytest.fixture
def gemma3_fork(tmp_path, bankml_cmd, gemma3_path) -> Path:
    fork = tmp_path / "gemma3.FORK.json"
    assert run_cli(bankml_cmd, "fork", str(gemma3_path), "-o", str(fork)).returncode == 0
    return fork


def _wait_exit(p: subprocess.Popen, timeout_s: float) -> int:
    try:
        return p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail(f"the process did not stop within {timeout_s} s")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_processes_answer_as_one_and_stop_together(bankml_cmd, gemma3_path, gemma3_fork):
    want = _reference(gemma3_path, 24)
    cluster = _Cluster(bankml_cmd, gemma3_path, gemma3_fork)
    try:
        server = cluster.leader
        assert "split 2 ways over 2 processes" in server.log()
        r = httpx.post(server.url("/completion"), json={"prompt": PROMPT, "n_predict": 24, "temperature": 0,
                                                         "ignore_eos": True, "return_tokens": True}, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == want
        chat = httpx.post(server.url("/v1/chat/completions"), timeout=300, json={
            "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "temperature": 0})
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]
        mesh = httpx.get(server.url("/bankml"), timeout=30).json()["mesh"]
        assert mesh["processes"] == 2 and mesh["axes"] == {"tp": 2} and len(mesh["devices"]) == 2
        assert len(mesh["weight_bytes"]) == 1  # this process's own device's share
        refused = httpx.post(server.url("/v1/embeddings"), json={"input": "hi"}, timeout=60)
        assert refused.status_code == 400 and "not served by a model split across processes" in refused.text
        # a keep_alive of 0 does not unload it: the other process holds its shares
        httpx.post(server.url("/api/generate"), json={"model": gemma3_path.name.lower().removesuffix(".gguf"),
                                                      "keep_alive": 0}, timeout=60)
        again = httpx.post(server.url("/completion"), json={"prompt": PROMPT, "n_predict": 4, "temperature": 0,
                                                             "ignore_eos": True, "return_tokens": True}, timeout=300)
        assert again.json()["tokens"] == want[:4]
        server.proc.send_signal(signal.SIGTERM)
        assert _wait_exit(server.proc, 60) == 0
        assert _wait_exit(cluster.follower, 60) == 0
        assert "process 0 stopped; stopping" in cluster.follower.stderr.read()
    finally:
        cluster.stop()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("dies", ["follower", "leader"])
def test_a_process_that_dies_stops_the_others(bankml_cmd, gemma3_path, gemma3_fork, dies):
    cluster = _Cluster(bankml_cmd, gemma3_path, gemma3_fork)
    try:
        server = cluster.leader
        with httpx.stream("POST", server.url("/completion"), timeout=600,
                          json={"prompt": PROMPT, "n_predict": 400, "temperature": 0, "ignore_eos": True,
                                "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert "content" in first
            t0 = time.monotonic()
            (cluster.follower if dies == "follower" else server.proc).kill()
            if dies == "leader":
                assert _wait_exit(cluster.follower, 60) != 0
                return
            rest = [line for line in lines if line.startswith("data: ")]
        assert time.monotonic() - t0 < 60
        assert "error" in rest[-1] and "Gloo" in rest[-1], rest[-3:]
        assert _wait_exit(server.proc, 60) != 0
        assert "failed" in server.log() and "stopping the server" in server.log()
    finally:
        cluster.stop()
