"""Start-up refusals: `bankml serve: refuse: <why>`, exit 2, and no socket left bound."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from gateway_helpers import HERE, FakeServer, free_port, registry_dir, tiny_model

from bankml.pin import fork_record

pytestmark = pytest.mark.timeout(120)


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def fake_serve(model, fork, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HERE / "gateway_fake_server.py"), str(model), "--fork", str(fork),
                           *extra], capture_output=True, text=True, timeout=60)


def test_an_unverified_model_is_refused_before_any_socket(tmp_path, bankml_cmd):
    model, fork = tiny_model(tmp_path)
    record = json.loads(fork.read_text())
    record["files"][0]["sha256"] = "0" * 64
    fork.write_text(json.dumps(record))
    port, upstream = free_port(), free_port()
    r = subprocess.run([*bankml_cmd, "serve", str(model), "--fork", str(fork), "--native", "--listen",
                        f"127.0.0.1:{port}", "--upstream", f"127.0.0.1:{upstream}"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.startswith("bankml serve: refuse: Tiny-Model.Q8_0.gguf sha256 ") and "!= pinned" in r.stderr
    assert port_is_free(port) and port_is_free(upstream)


def test_a_model_that_cannot_load_is_refused_before_any_socket(tmp_path):
    model, fork = tiny_model(tmp_path)
    port, upstream = free_port(), free_port()
    r = fake_serve(model, fork, "--fail-load", "--listen", f"127.0.0.1:{port}", "--upstream", f"127.0.0.1:{upstream}")
    assert r.returncode == 2
    assert "bankml serve: refuse: cannot load" in r.stderr and "the fake engine cannot load this" in r.stderr
    assert "listening on" not in r.stderr


@pytest.mark.parametrize("busy", ["listen", "upstream"])
def test_an_address_in_use_is_refused_and_the_other_one_is_let_go(tmp_path, busy):
    model, fork = tiny_model(tmp_path)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        taken_port, other = taken.getsockname()[1], free_port()
        ports = {"listen": taken_port, "upstream": other} if busy == "listen" else {"listen": other,
                                                                                     "upstream": taken_port}
        r = fake_serve(model, fork, "--listen", f"127.0.0.1:{ports['listen']}", "--upstream",
                       f"127.0.0.1:{ports['upstream']}")
    assert r.returncode == 2
    want = (f"bankml serve: refuse: cannot listen on 127.0.0.1:{taken_port}: " if busy == "listen" else
            f"bankml serve: refuse: cannot listen on the engine address 127.0.0.1:{taken_port}: ")
    assert want in r.stderr
    assert port_is_free(other)



def test_a_registry_that_is_not_a_directory_is_refused_and_one_that_is_is_served(tmp_path):
    model, fork = tiny_model(tmp_path / "startup")
    r = fake_serve(model, fork, "--registry", str(tmp_path / "none"))
    assert r.returncode == 2
    assert f"bankml serve: refuse: --registry {tmp_path / 'none'}: not a directory" in r.stderr
    reg = registry_dir(tmp_path / "reg", ["Model-A.Q8_0.gguf"])
    (reg / "Junk.gguf").write_bytes(b"not a gguf" * 10)
    (reg / "Junk.gguf.FORK.json").write_text(json.dumps(fork_record(reg / "Junk.gguf")))
    server = FakeServer(model, fork, registry=reg)
    try:
        assert "models tiny-model.q8_0, model-a.q8_0 (at most 3 resident)" in server.log()
        assert "Junk.gguf is listed, not served: guard refused" in server.log()
    finally:
        server.stop()
