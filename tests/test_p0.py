"""P0: bankml serve in front of llama-server (`--spawn`, `--upstream`), against tests/mock_llama_server.py.

Each gateway runs as `bankml serve` would run it (tests/p0_launch.py: the options, the gate, then
gateway.p0.app.run_p0) in its own process, so start-up refusals, exit codes, signals and orphans are
real. The engine is the mock, launched through a wrapper script as `--spawn BIN` would launch
llama-server, or started by the test for `--upstream` (tests/p0_helpers.py). test_p0_oracle.py does
the same against a real llama-server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from gateway_helpers import exchange, free_port, request_bytes, split_response, tiny_model
from p0_helpers import (
    LAUNCH,
    MIB,
    REPLY,
    Engine,
    Gateway,
    StandaloneMock,
    alive,
    chat_body,
    configure,
    last_upstream_body,
    receipt_event,
    sha,
    stream_text,
    wait_for,
    wait_gone,
)

from bankml.verify import FileIdentity
from gateway.p0.chat import ENGINE_MOVED, FILE_CHANGED, token_counts, with_receipt
from gateway.p0.spawn import llama_server_argv

pytestmark = pytest.mark.timeout(180)


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """A gateway that launched the mock with --spawn; tests reset the mock's switches after use."""
    d = tmp_path_factory.mktemp("p0")
    model, fork = tiny_model(d / "models")
    engine = Engine(d / "engine")
    up = free_port()
    g = Gateway(model, fork, "--spawn", str(engine.bin), "--upstream", f"127.0.0.1:{up}",
                "--spec-ngram", "--slot-dir", str(d / "slots"))
    assert g.ready, g.log()
    g.model, g.fork, g.engine, g.up = model, fork, engine, up
    yield g
    g.stop()


@pytest.fixture
def gateway():
    """Gateway(...) for one test; every one started is stopped at teardown, even after a failure."""
    started: list[Gateway] = []

    def start(*args, **kw) -> Gateway:
        started.append(Gateway(*args, **kw))
        return started[-1]

    yield start
    for g in started:
        g.stop()


@pytest.fixture
def mock_reset(spawned):
    yield
    configure(spawned.up, model_path=str(spawned.model), props_status=200, chat_status=200, reply=REPLY,
              oversize=None, oversize_bytes=64 * MIB + 1, stream_delay_ms=0, pieces_from_max_tokens=False)


# --- pure parts --------------------------------------------------------------------------------


def test_engine_argv_is_the_originals():
    assert llama_server_argv("/bin/llama-server", "/m/x.gguf", "127.0.0.1", 18092, 3, 4096) == [
        "/bin/llama-server", "-m", "/m/x.gguf", "--host", "127.0.0.1", "--port", "18092", "-t", "3", "-c", "4096",
        "-np", "1", "--jinja", "--reasoning", "off", "--no-webui"]
    assert llama_server_argv("b", "m", "h", 1, 2, 3, spec_ngram=True, slot_dir="/s")[-4:] == [
        "--spec-type", "ngram-simple", "--slot-save-path", "/s"]


def test_counts_come_from_usage_or_else_from_llama_servers_timings():
    assert token_counts({"usage": {"prompt_tokens": 7, "completion_tokens": 2}}) == (True, 7, 2)
    assert token_counts({"timings": {"cache_n": 32, "prompt_n": 1, "predicted_n": 3}}) == (False, 33, 3)
    assert token_counts({"usage": {"prompt_tokens": 7, "completion_tokens": 2},
                         "timings": {"cache_n": 0, "prompt_n": 1, "predicted_n": 1}}) == (True, 7, 2)
    assert token_counts({"usage": {"prompt_tokens": True, "completion_tokens": 2}}) is None
    assert token_counts({"choices": []}) is None and token_counts([1]) is None


def test_the_receipt_goes_before_the_last_brace_and_every_other_byte_stays():
    raw = b'{"choices":[{"message":{"content":"a}b"}}],"usage":{"x":1}}\n'
    out = with_receipt(raw, {"signed": False})
    assert out == b'{"choices":[{"message":{"content":"a}b"}}],"usage":{"x":1}, "bankml_receipt": {"signed": false}}\n'
    assert with_receipt(b"{ }", {"a": 1}) == b'{ "bankml_receipt": {"a": 1}}'


# --- start-up ----------------------------------------------------------------------------------


def test_spawn_launches_llama_server_on_the_verified_path_with_the_originals_argv(spawned):
    rec = spawned.engine.recorded()
    assert rec["argv"][2:] == ["-m", os.path.realpath(spawned.model), "--host", "127.0.0.1", "--port", str(spawned.up),
                               "-t", "3", "-c", "4096", "-np", "1", "--jinja", "--reasoning", "off", "--no-webui",
                               "--spec-type", "ngram-simple", "--slot-save-path", str(spawned.model.parents[1] / "slots")]
    # its own process group, so a terminal's Ctrl-C reaches only the gateway, which stops it
    assert os.getpgid(rec["pid"]) == rec["pid"] != os.getpgid(spawned.proc.pid)


def test_bankml_reports_what_was_verified_in_p0_shape(spawned):
    r = httpx.get(spawned.url("/bankml"), timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    v = r.json()
    assert list(v) == ["verified", "model", "upstream", "engine", "hashed_at"]
    assert v["verified"]["model_sha256"] == sha(spawned.model.read_bytes())
    assert '"verdict": "play"' in r.text
    assert v["model"] == os.path.realpath(spawned.model)
    assert v["upstream"] == f"127.0.0.1:{spawned.up}"
    assert v["engine"] == "llama.cpp b0-mock llama-server (loopback), behind bankml P0"
    assert abs(v["hashed_at"] - time.time()) < 600


@pytest.mark.parametrize("path", ["/health", "/props", "/v1/models"])
def test_llama_server_routes_pass_through(spawned, path):
    through = httpx.get(spawned.url(path), timeout=10)
    direct = httpx.get(f"http://127.0.0.1:{spawned.up}{path}", timeout=10)
    assert through.status_code == direct.status_code == 200
    assert through.content == direct.content


def test_the_monitor_routes_answer_in_p0(spawned):
    usage = httpx.get(spawned.url("/bankml/usage"), timeout=30)
    assert usage.status_code == 200
    names = {p["name"]: p["pid"] for p in usage.json()["processes"]}
    assert names["llama-server"] == spawned.engine.recorded()["pid"]  # the engine is measured too
    metrics = httpx.get(spawned.url("/bankml/metrics"), timeout=10)
    assert metrics.status_code == 200 and metrics.json()["records"] == []  # llama-server keeps its own
    status = httpx.get(spawned.url("/bankml/status"), timeout=30).json()
    assert status["serve"]["mode"] == "p0" and status["model"] == os.path.realpath(spawned.model)
    assert httpx.get(spawned.url("/metrics"), timeout=30).status_code == 200
    assert httpx.get(spawned.url("/"), timeout=10).text == "bankml is running (in front of llama-server)"


def test_paths_match_exactly_and_the_loopback_rules_apply(spawned):
    assert httpx.get(spawned.url("/health?x=1"), timeout=10).status_code == 404
    assert httpx.get(spawned.url("/nope"), timeout=10).status_code == 404
    assert split_response(exchange(spawned.port, request_bytes("GET", "/health", host="evil.example")))[0] == 403
    text = exchange(spawned.port, request_bytes("POST", "/v1/chat/completions", body=chat_body(),
                                                content_type="text/plain"))
    assert split_response(text)[0] == 415


def test_upstream_mode_checks_a_running_engine(tmp_path, gateway):
    model, fork = tiny_model(tmp_path)
    mock = StandaloneMock(model)
    try:
        g = gateway(model, fork, "--upstream", mock.address)
        assert g.ready, g.log()
        r = g.post(chat_body())
        assert r.status_code == 200 and r.json()["bankml_receipt"]["response_sha256"] == sha(REPLY)
    finally:
        mock.stop()


def test_a_different_model_path_is_refused_at_start_and_nothing_listens(tmp_path, gateway):
    model, fork = tiny_model(tmp_path / "a")
    other, _ = tiny_model(tmp_path / "b", name="Other.Q8_0.gguf")
    mock = StandaloneMock(other)
    try:
        g = gateway(model, fork, "--upstream", mock.address)
        assert g.exit_code() == 2
        assert (f"bankml serve: refuse: upstream {mock.address} serves {os.path.realpath(other)}, "
                f"not the verified {os.path.realpath(model)}: refused") in g.log()
        with pytest.raises(httpx.ConnectError):
            httpx.get(g.url("/bankml"), timeout=2)
    finally:
        mock.stop()


def test_spawn_refuses_when_something_already_answers(tmp_path, gateway):
    model, fork = tiny_model(tmp_path)
    mock = StandaloneMock(model)
    engine = Engine(tmp_path / "engine")
    try:
        g = gateway(model, fork, "--spawn", str(engine.bin), "--upstream", mock.address)
        assert g.exit_code() == 2
        assert f"bankml serve: refuse: {mock.address} already answers" in g.log()
        assert not engine.record.exists()  # nothing was launched
    finally:
        mock.stop()


def test_an_engine_that_exits_during_startup_is_noticed_at_once_with_its_last_lines(tmp_path, gateway):
    model, fork = tiny_model(tmp_path)
    engine = Engine(tmp_path / "engine", "--mock-exit-during-startup")
    t0 = time.monotonic()
    g = gateway(model, fork, "--spawn", str(engine.bin), "--upstream", f"127.0.0.1:{free_port()}")
    assert g.exit_code() == 2
    assert time.monotonic() - t0 < 30  # not the 900 s health limit
    log = g.log()
    assert "bankml serve: refuse: the engine exited (exit status 1) before it was healthy" in log
    assert f"llama_model_load: error loading model: mock cannot read {os.path.realpath(model)}" in log
    assert "main: exiting due to model loading error" in log


def test_a_spawned_engine_serving_another_file_is_refused_and_stopped(tmp_path, gateway):
    model, fork = tiny_model(tmp_path / "a")
    other, _ = tiny_model(tmp_path / "b", name="Other.Q8_0.gguf")
    engine = Engine(tmp_path / "engine", "--mock-model-path", str(other))
    g = gateway(model, fork, "--spawn", str(engine.bin), "--upstream", f"127.0.0.1:{free_port()}")
    assert g.exit_code() == 2
    assert f"not the verified {os.path.realpath(model)}: refused" in g.log()
    assert wait_gone(engine.recorded()["pid"])


def test_the_listener_is_bound_only_once_the_engine_is_healthy(tmp_path, gateway):
    model, fork = tiny_model(tmp_path)
    engine = Engine(tmp_path / "engine", "--mock-loading-s", "3")
    up = free_port()
    g = gateway(model, fork, "--spawn", str(engine.bin), "--upstream", f"127.0.0.1:{up}", timeout_s=0.1)
    assert wait_for(lambda: _health_status(up) == 503, 20)
    with pytest.raises(httpx.ConnectError):  # the engine answers "Loading model": no gateway yet
        httpx.get(g.url("/bankml"), timeout=2)
    assert wait_for(lambda: "listening on http://" in g.log(), 30), g.log()
    assert httpx.get(g.url("/health"), timeout=10).status_code == 200


def _health_status(port: int) -> int | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code
    except httpx.HTTPError:
        return None


def test_upstream_that_never_gets_healthy_is_refused_after_10_s(tmp_path, gateway):
    model, fork = tiny_model(tmp_path)
    up = free_port()  # nothing there
    t0 = time.monotonic()
    g = gateway(model, fork, "--upstream", f"127.0.0.1:{up}", timeout_s=0.1)
    assert g.exit_code(60) == 2
    assert 9.5 < time.monotonic() - t0 < 40
    assert f"bankml serve: refuse: upstream 127.0.0.1:{up} not healthy after 10 s" in g.log()


# --- receipts ----------------------------------------------------------------------------------


def test_a_plain_answer_carries_the_receipt_inserted_into_the_upstream_json(spawned):
    body = chat_body(max_tokens=8)
    r = spawned.post(body)
    assert r.status_code == 200
    receipt = r.json()["bankml_receipt"]
    assert list(receipt) == ["bankml", "engine", "model_sha256", "guard", "prompt_tokens", "completion_tokens",
                             "ttft_ms", "wall_ms", "response_sha256", "request_sha256", "signed", "key_id",
                             "signature"]
    assert receipt["model_sha256"] == sha(spawned.model.read_bytes())
    assert receipt["response_sha256"] == sha(REPLY)
    assert receipt["request_sha256"] == sha(body)
    assert (receipt["prompt_tokens"], receipt["completion_tokens"]) == (7, 2)
    assert receipt["ttft_ms"] is None and receipt["signed"] is True
    assert receipt["engine"] == "llama.cpp b0-mock llama-server (loopback), behind bankml P0"
    assert last_upstream_body(spawned.up) == body  # forwarded byte for byte
    # the upstream's own bytes are untouched: the mock's compact JSON, then the receipt
    assert r.content.startswith(b'{"choices":[{"finish_reason":"stop","index":0,"message":{"role":"assistant",'
                                b'"content":"Savante knows."}}]')
    assert b'"timings":{"prompt_n":7,"predicted_n":2}, "bankml_receipt": {' in r.content


def test_the_receipt_hashes_the_text_as_the_engine_sent_it(spawned, mock_reset):
    reply = 'Savante "knows"\n\té 😀 \\ done'
    configure(spawned.up, reply=reply)
    r = spawned.post(chat_body())
    assert r.json()["bankml_receipt"]["response_sha256"] == sha(reply)
    with httpx.stream("POST", spawned.url("/v1/chat/completions"), content=chat_body(stream=True),
                      headers={"Content-Type": "application/json"}, timeout=30) as s:
        sse = s.read().decode()
    assert stream_text(sse) == reply
    assert receipt_event(sse)["response_sha256"] == sha(reply)


@pytest.mark.parametrize("usage", [False, True], ids=["timings", "include_usage"])
def test_a_streamed_answer_passes_through_and_ends_with_the_receipt_before_done(spawned, usage):
    body = chat_body(stream=True, **({"stream_options": {"include_usage": True}} if usage else {}))
    with httpx.stream("POST", spawned.url("/v1/chat/completions"), content=body,
                      headers={"Content-Type": "application/json"}, timeout=30) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        sse = s.read().decode()
    assert '"delta":{"content":"Savante "}' in sse  # llama-server's events, unchanged
    events = [e for e in sse.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert events[-2].startswith('data: {"choices": [], "bankml_receipt": {')
    receipt = receipt_event(sse)
    assert receipt["response_sha256"] == sha(REPLY) == sha(stream_text(sse))
    assert receipt["request_sha256"] == sha(body)
    assert (receipt["prompt_tokens"], receipt["completion_tokens"]) == (7, 2)
    assert isinstance(receipt["ttft_ms"], int)


def test_stream_events_are_forwarded_as_they_arrive(spawned, mock_reset):
    configure(spawned.up, stream_delay_ms=400)
    arrivals = []
    with httpx.stream("POST", spawned.url("/v1/chat/completions"), content=chat_body(stream=True),
                      headers={"Content-Type": "application/json"}, timeout=30) as s:
        t0 = time.monotonic()
        for line in s.iter_lines():
            if '"content":"' in line:
                arrivals.append(time.monotonic() - t0)
    # two pieces 400 ms apart arrive apart, not together at the end
    assert len(arrivals) == 2 and arrivals[1] - arrivals[0] > 0.25


def test_a_client_that_goes_away_closes_the_upstream_stream(spawned, mock_reset):
    configure(spawned.up, stream_delay_ms=300, pieces_from_max_tokens=True)
    stats = f"http://127.0.0.1:{spawned.up}/mock/stats"
    before = httpx.get(stats, timeout=10).json()["aborted_streams"]
    with httpx.stream("POST", spawned.url("/v1/chat/completions"), content=chat_body(stream=True, max_tokens=100),
                      headers={"Content-Type": "application/json"}, timeout=30) as s:
        for line in s.iter_lines():
            if '"content":"t0 "' in line:
                break  # leave after the first piece: 99 more would take 30 s
    # the gateway closed its upstream connection, so the engine stopped writing (llama-server stops generating)
    assert wait_for(lambda: httpx.get(stats, timeout=10).json()["aborted_streams"] == before + 1, 10)


def test_an_upstream_error_passes_through_without_a_receipt(spawned, mock_reset):
    configure(spawned.up, chat_status=400)
    for stream in (False, True):
        r = spawned.post(chat_body(stream=stream))
        assert r.status_code == 400
        assert r.json() == {"error": {"code": 400, "message": "mock chat failure", "type": "invalid_request_error"}}
        assert b"bankml_receipt" not in r.content


def test_a_body_that_is_not_json_is_400_and_never_forwarded(spawned):
    before = last_upstream_body(spawned.up)
    r = spawned.post(b'{"messages": [')
    assert r.status_code == 400 and "not JSON" in r.text
    assert last_upstream_body(spawned.up) == before


# --- per-answer re-checks ----------------------------------------------------------------------


def test_a_different_model_path_mid_run_is_503_without_a_receipt(spawned, mock_reset, tmp_path):
    other, _ = tiny_model(tmp_path, name="Other.Q8_0.gguf")
    configure(spawned.up, model_path=str(other))
    for stream in (False, True):
        r = spawned.post(chat_body(stream=stream))
        assert r.status_code == 503 and ENGINE_MOVED in r.text and "bankml_receipt" not in r.text
    configure(spawned.up, model_path=str(spawned.model))
    assert spawned.post(chat_body()).status_code == 200


def test_props_failing_is_502_without_a_receipt(spawned, mock_reset):
    configure(spawned.up, props_status=500)
    r = spawned.post(chat_body())
    assert r.status_code == 502 and "bankml_receipt" not in r.text


def test_the_file_changed_is_503_without_a_receipt(tmp_path, gateway):
    model, fork = tiny_model(tmp_path)
    engine = Engine(tmp_path / "engine")
    g = gateway(model, fork, "--spawn", str(engine.bin), "--upstream", f"127.0.0.1:{free_port()}")
    assert g.ready, g.log()
    assert g.post(chat_body()).status_code == 200
    before = FileIdentity.of(model)
    with open(model, "r+b") as f:  # overwritten in place: same inode, other bytes and mtime
        f.seek(0, os.SEEK_END)
        f.write(b"\0")
    assert FileIdentity.of(model) != before
    for stream in (False, True):
        r = g.post(chat_body(stream=stream))
        assert r.status_code == 503 and FILE_CHANGED in r.text and "bankml_receipt" not in r.text


# --- upstream bodies over 64 MiB -------------------------------------------------------------


def test_an_announced_oversized_body_is_refused_before_it_is_read(spawned, mock_reset):
    configure(spawned.up, oversize="length")  # Content-Length 64 MiB + 1, and only a few bytes
    r = spawned.post(chat_body())
    assert r.status_code == 502 and "larger than 64 MiB" in r.text and "bankml_receipt" not in r.text
    assert httpx.get(spawned.url("/health"), timeout=10).status_code == 200


def test_a_chunked_body_that_grows_past_64_mib_is_refused(spawned, mock_reset):
    configure(spawned.up, oversize="chunked")
    r = spawned.post(chat_body())
    assert r.status_code == 502 and "larger than 64 MiB" in r.text


def test_a_stream_line_past_64_mib_ends_the_stream_without_a_receipt(spawned, mock_reset):
    configure(spawned.up, oversize="line")
    with httpx.stream("POST", spawned.url("/v1/chat/completions"), content=chat_body(stream=True),
                      headers={"Content-Type": "application/json"}, timeout=60) as s:
        sse = s.read().decode()
    assert "larger than 64 MiB" in sse
    assert "bankml_receipt" not in sse and "[DONE]" not in sse


# --- signals and orphans -----------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_stops_the_spawned_engine(tmp_path, sig, gateway):
    model, fork = tiny_model(tmp_path)
    engine = Engine(tmp_path / "engine")
    g = gateway(model, fork, "--spawn", str(engine.bin), "--upstream", f"127.0.0.1:{free_port()}")
    assert g.ready, g.log()
    pid = engine.recorded()["pid"]
    assert alive(pid)
    g.proc.send_signal(sig)
    assert g.exit_code() == 128 + sig
    assert wait_gone(pid)


def test_a_stop_signal_works_when_stderr_is_gone(tmp_path):
    """A supervisor's pipe closed (`bankml serve ... 2>&1 | head`): the signal still stops both."""
    model, fork = tiny_model(tmp_path)
    engine = Engine(tmp_path / "engine")
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(LAUNCH), str(model), "--fork", str(fork), "--spawn", str(engine.bin),
                             "--upstream", f"127.0.0.1:{free_port()}", "--listen", f"127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if "listening on http://" in line:
                break
        proc.stderr.close()  # nobody reads what it writes any more
        pid = engine.recorded()["pid"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 128 + signal.SIGTERM
        assert wait_gone(pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_an_engine_that_dies_while_serving_gives_502_and_is_reported(tmp_path, gateway):
    model, fork = tiny_model(tmp_path)
    engine = Engine(tmp_path / "engine")
    g = gateway(model, fork, "--spawn", str(engine.bin), "--upstream", f"127.0.0.1:{free_port()}")
    assert g.ready, g.log()
    os.kill(engine.recorded()["pid"], signal.SIGKILL)
    assert wait_for(lambda: "exited (killed by signal 9 (SIGKILL)) while serving" in g.log(), 10), g.log()
    assert httpx.get(g.url("/health"), timeout=10).status_code == 502
    r = g.post(chat_body())
    assert r.status_code == 502 and "bankml_receipt" not in r.text
    assert httpx.get(g.url("/bankml"), timeout=10).status_code == 200  # what was verified still answers


def test_sigkill_of_the_gateway_leaves_no_orphan_engine(tmp_path, gateway):
    model, fork = tiny_model(tmp_path)
    engine = Engine(tmp_path / "engine")
    g = gateway(model, fork, "--spawn", str(engine.bin), "--upstream", f"127.0.0.1:{free_port()}")
    assert g.ready, g.log()
    pid = engine.recorded()["pid"]
    g.proc.kill()  # no handler runs: only the kernel's parent-death signal can stop the engine
    g.proc.wait(10)
    assert wait_gone(pid), f"llama-server (pid {pid}) outlived the gateway"


def test_a_signal_during_the_health_wait_stops_the_engine_too(tmp_path, gateway):
    model, fork = tiny_model(tmp_path)
    engine = Engine(tmp_path / "engine", "--mock-loading-s", "60")
    g = gateway(model, fork, "--spawn", str(engine.bin), "--upstream", f"127.0.0.1:{free_port()}", timeout_s=0.1)
    pid = engine.recorded()["pid"]
    g.proc.send_signal(signal.SIGTERM)
    assert g.exit_code() == 128 + signal.SIGTERM
    assert wait_gone(pid)
