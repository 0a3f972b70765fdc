"""Issue 28: the server never wedges silently, a failing engine step never loops, and SIGTERM always ends it.

- a scheduler iteration that raises ends the sequences it touched (the head of the queue it was
  admitting too), and a second failed iteration in a row marks the engine failed: 500 with the reason,
  then 503 with it on /health and for every new request; never a retry loop;
- /health is 503 naming a wedged engine (no step with work in flight for `[limits] wedged_after_s`) or
  a wedged worker pool (every worker busy, work queued, none moving), and 200 once it moves;
- a stop ends the process even when a worker thread and the engine thread are stuck.

In-process parts use fake clocks and engines blocked on Events; the servers' parts block on fifos the
test opens (tests/fake_engine.py "HANG:", tests/wedge_server.py "PREP-BLOCK:"): no timing assertions,
each wait bounded only as a hang guard.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fake_engine import REPLY, STEP_FAILED, FakeEngine
from gateway_helpers import (
    HERE,
    FakeServer,
    _Server,
    connect,
    exchange,
    read_all,
    request_bytes,
    split_response,
    tiny_model,
)
from scheduler_fakes import add, drain, make, prompt

from gateway.http.liveness import Liveness, WorkerPool
from gateway.http.shutdown import FORCED_EXIT, ExitWatchdog
from model.engine_thread import EngineThread
from model.messages import FinishReason, GenerateRequest, SamplingParams

pytestmark = pytest.mark.timeout(180)

GUARD_S = 60  # a hang guard, never a speed bound


def wait_until(check, what: str, timeout_s: float = GUARD_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"never happened: {what}")


# --- the scheduler: a failed iteration drops what it touched --------------------------------------


def test_a_failed_admission_drops_the_sequence_it_was_admitting_and_the_rest_are_served():
    sched, runner = make()
    start = runner.start_sequence

    def start_sequence(seq):  # a bug that hits one request at its admission (as Work.id_slot = None did)
        if seq.request.request_id == "r7":
            raise TypeError("'>=' not supported between instances of 'NoneType' and 'int'")
        start(seq)

    runner.start_sequence = start_sequence
    good = add(sched, prompt(5, seed=1), max_tokens=3)
    bad = add(sched, prompt(7, seed=2), max_tokens=3)
    later = add(sched, prompt(9, seed=3), max_tokens=3)
    with pytest.raises(TypeError):
        sched.iterate()
    # the running one and the head being admitted are dropped; the one never reached waits on
    assert sorted(sched.reset()) == sorted([good, bad])
    assert [s.task for s in sched.waiting] == [later] and not sched.running
    outs, _ = drain(sched)  # no second failure: the bad sequence is gone
    assert set(outs) == {later} and outs[later][-1].finish_reason is FinishReason.LENGTH
    assert sched.pool.used == 0 and len(sched._free_slots) == sched.max_seqs


def test_a_sequence_that_finished_in_the_failed_iteration_is_dropped_too():
    sched, runner = make()
    short = add(sched, prompt(4, seed=1), max_tokens=1)  # ends with its first token, at its prefill
    other = add(sched, prompt(6, seed=2), max_tokens=5)
    prefill = runner.prefill

    def failing_prefill(seq, n):
        if seq.task == other:
            raise RuntimeError("device lost")
        return prefill(seq, n)

    runner.prefill = failing_prefill
    with pytest.raises(RuntimeError):
        sched.iterate()  # `short` finished (its output went with the iteration), then `other` failed
    assert sorted(sched.reset()) == sorted([short, other])  # so its client hears of it, not nothing


# --- the engine thread: a failure, then the engine marked failed -----------------------------------


def _thread_with(engine, **kw) -> EngineThread:
    t = EngineThread(**kw)
    t.call(lambda: t.set_engine(engine)).result(5)
    return t


def _submit(thread: EngineThread, text: str, into: queue.Queue, rid: str) -> None:
    thread.submit(GenerateRequest(list(text.encode()), SamplingParams(), request_id=rid),
                  lambda out: into.put((rid, out)))


def _final(into: queue.Queue, rid: str):
    while True:
        got, out = into.get(timeout=GUARD_S)
        if got == rid and out.finish_reason is not None:
            return out


def test_a_failing_step_fails_its_request_once_and_a_second_in_a_row_marks_the_engine_failed(caplog):
    caplog.set_level(logging.ERROR, logger="model.engine_thread")
    thread = _thread_with(FakeEngine(step_s=0.0))
    into: queue.Queue = queue.Queue()
    _submit(thread, "STEPERROR", into, "a")
    out = _final(into, "a")
    assert out.finish_reason is FinishReason.ERROR and out.error == f"RuntimeError: {STEP_FAILED}"
    _submit(thread, "hello", into, "b")  # a step completes: the count starts again
    assert _final(into, "b").finish_reason is FinishReason.STOP and thread.alive
    _submit(thread, "STEPERROR", into, "c")
    assert _final(into, "c").error == f"RuntimeError: {STEP_FAILED}" and thread.alive
    _submit(thread, "BROKEN", into, "d")  # two pieces, then every iteration raises
    assert _final(into, "d").finish_reason is FinishReason.ERROR
    _submit(thread, "hello", into, "e")
    out = _final(into, "e")
    assert out.finish_reason is FinishReason.ERROR and "failed 2 iterations in a row" in out.error
    assert not thread.alive and thread.failure is not None and "(broken)" in thread.failure
    _submit(thread, "hello", into, "f")  # answered at once, with the reason
    assert _final(into, "f").error.startswith("the engine thread stopped: RuntimeError")
    failures = [r for r in caplog.records if "an engine iteration failed" in r.getMessage()]
    assert len(failures) == 4  # a, c, d, e: each failure logged once, no retry loop


# --- the heartbeats, on fake clocks ------------------------------------------------------------


class Resident:
    def __init__(self, name, client):
        self.name, self.client = name, client


class Clock:
    def __init__(self):
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_an_engine_blocked_in_a_step_is_wedged_until_it_completes_one():
    entered, release = threading.Event(), threading.Event()

    class Blocked(FakeEngine):
        def iterate(self):
            entered.set()
            release.wait(GUARD_S)
            return super().iterate()

    clock = Clock()
    thread = _thread_with(Blocked(step_s=0.0), clock=clock)
    liveness = Liveness(None, wedged_after_s=10.0)
    resident = [Resident("tiny", thread)]
    assert thread.stalled_s() == 0 and liveness.problems(resident) == []  # idle is never wedged
    into: queue.Queue = queue.Queue()
    _submit(thread, "hello", into, "a")
    assert entered.wait(GUARD_S)
    clock.now_s += 10.0
    assert liveness.problems(resident) == []  # at the bound, not past it
    clock.now_s += 5.0
    [problem] = liveness.problems(resident)
    assert problem == ("the engine of tiny has completed no step for 15.0 s while 0 request(s) run and 1 wait "
                       "([limits] wedged_after_s = 10)")
    release.set()
    assert _final(into, "a").finish_reason is FinishReason.STOP
    assert thread.stalled_s() == 0 and liveness.report(resident) == {"status": "ok", "wedged_after_s": 10.0}
    thread.stop()


def test_a_worker_pool_with_every_worker_stuck_and_work_queued_is_wedged_until_one_moves():
    clock = Clock()
    pool = WorkerPool(max_workers=2, clock=clock)
    liveness = Liveness(pool, wedged_after_s=10.0)
    release = [threading.Event(), threading.Event()]
    started = [threading.Event(), threading.Event()]

    def stuck(i):
        started[i].set()
        release[i].wait(GUARD_S)

    futures = [pool.submit(stuck, i) for i in range(2)]
    assert all(e.wait(GUARD_S) for e in started)
    clock.now_s += 100.0
    assert liveness.problems([]) == []  # every worker busy, nothing waits: busy, not wedged
    queued = pool.submit(lambda: "done")
    dropped = pool.submit(lambda: "never")
    assert pool.counts() == (2, 2)
    dropped.cancel()  # its awaiting task went away: it leaves the queue
    assert pool.counts() == (2, 1)
    clock.now_s += 10.5
    assert liveness.problems([]) == ["all 2 worker threads have been busy for 10.5 s with 1 task(s) queued "
                                     "behind them ([limits] wedged_after_s = 10)"]
    assert liveness.report([])["workers"] == {"threads": 2, "busy": 2, "queued": 1}
    release[0].set()
    assert queued.result(GUARD_S) == "done" and futures[0].result(GUARD_S) is None
    assert liveness.problems([]) == [] and pool.counts() == (1, 0)
    release[1].set()
    pool.shutdown()


def test_the_exit_watchdog_names_the_busy_threads_flushes_and_exits():
    exited, codes = threading.Event(), []
    stuck = threading.Event()
    busy = threading.Thread(target=stuck.wait, name="bankml-worker_7", daemon=True)
    busy.start()
    dog = ExitWatchdog(exit=lambda code: (codes.append(code), exited.set()))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("bankml.gateway").addHandler(handler)
    try:
        dog.arm(0.0)
        assert exited.wait(GUARD_S)
    finally:
        logging.getLogger("bankml.gateway").removeHandler(handler)
        stuck.set()
    assert codes == [FORCED_EXIT] and dog.fired
    [line] = [r.getMessage() for r in records if "exiting now" in r.getMessage()]
    assert "bankml-worker_7" in line


# --- the server: /health, /bankml and every answer ------------------------------------------------


def chat_bytes(content: str, stream: bool = False) -> bytes:
    body = json.dumps({"messages": [{"role": "user", "content": content}], "stream": stream}).encode()
    return request_bytes("POST", "/v1/chat/completions", body=body)


def get(port: int, path: str) -> tuple[int, dict]:
    status, _, body = split_response(exchange(port, request_bytes("GET", path), timeout_s=GUARD_S))
    return status, json.loads(body)


def release(fifo: Path) -> None:
    """Let whoever blocks on `fifo` go (it opened it for reading: a non-blocking open for writing works)."""
    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_a_failing_step_is_a_500_then_the_engine_failed_is_a_503_everywhere(tmp_path):
    server = FakeServer(*tiny_model(tmp_path))
    try:
        status, _, body = split_response(exchange(server.port, chat_bytes("STEPERROR"), GUARD_S))
        assert status == 500 and json.loads(body)["error"]["message"] == f"RuntimeError: {STEP_FAILED}"
        status, _, body = split_response(exchange(server.port, chat_bytes("hello"), GUARD_S))
        assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == REPLY
        assert get(server.port, "/health") == (200, {"status": "ok"})
        # a stream whose engine breaks mid-answer: its pieces, then the error event
        status, _, body = split_response(exchange(server.port, chat_bytes("BROKEN", stream=True), GUARD_S))
        assert status == 200 and b"[DONE]" not in body
        last = body.decode().rstrip().rsplit("data: ", 1)[-1]
        assert json.loads(last.split("\r\n")[0])["error"]["message"] == f"RuntimeError: {STEP_FAILED} (broken)"
        # the next step fails too: the engine is failed, and every answer says why
        for _ in range(2):
            status, _, body = split_response(exchange(server.port, chat_bytes("hello"), GUARD_S))
            error = json.loads(body)["error"]
            assert status == 503 and "failed 2 iterations in a row" in error["message"], body
        status, health = get(server.port, "/health")
        assert status == 503 and health["error"]["type"] == "unavailable_error"
        assert "failed 2 iterations in a row" in health["error"]["message"]
        assert server.log().count("an engine iteration failed") == 3  # STEPERROR, BROKEN, the last: no loop
    finally:
        server.stop()


def test_health_is_503_while_the_engine_is_wedged_and_200_once_it_steps_again(tmp_path):
    server = FakeServer(*tiny_model(tmp_path), limits={"wedged_after_s": 0.2})
    fifo = tmp_path / "engine.fifo"
    os.mkfifo(fifo)
    try:
        assert get(server.port, "/health") == (200, {"status": "ok"})
        with connect(server.port, timeout_s=GUARD_S) as waiting:
            waiting.sendall(chat_bytes(f"HANG:{fifo}"))
            status, health = wait_until(lambda: (r := get(server.port, "/health"))[0] == 503 and r,
                                        "/health says the engine is wedged")
            assert health["error"]["code"] == 503 and health["error"]["type"] == "unavailable_error"
            message = health["error"]["message"]
            assert message.startswith("the server is wedged: the engine of tiny-model.q8_0 has completed no step for")
            assert message.endswith("wait ([limits] wedged_after_s = 0.2)")
            status, info = get(server.port, "/bankml")
            assert info["health"]["status"] == "wedged" and "tiny-model.q8_0" in info["health"]["reasons"][0]
            release(fifo)
            status, _, body = split_response(read_all(waiting))
        assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == REPLY
        assert get(server.port, "/health") == (200, {"status": "ok"})
        assert get(server.port, "/bankml")[1]["health"]["status"] == "ok"
    finally:
        server.stop()


class WedgeServer(_Server):
    """tests/wedge_server.py: the fake-engine gateway whose chat preparation can hang on a fifo."""

    def __init__(self, model: Path, fork: Path, limits: dict, config: Path | None = None):
        super().__init__([sys.executable, str(HERE / "wedge_server.py"), str(model), "--fork", str(fork),
                          "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:0", "--limits", json.dumps(limits),
                          *(["--config", str(config)] if config else [])], GUARD_S)


def test_health_is_503_while_every_worker_thread_is_stuck_and_200_once_one_moves(tmp_path):
    server = WedgeServer(*tiny_model(tmp_path), limits={"wedged_after_s": 0.2, "max_connections": 100})
    sockets = []
    try:
        workers = get(server.port, "/bankml")[1]["health"]["workers"]["threads"]
        fifos = [tmp_path / f"prep{i}.fifo" for i in range(workers)]
        for fifo in fifos:
            os.mkfifo(fifo)
            sockets.append(connect(server.port, timeout_s=GUARD_S))
            sockets[-1].sendall(chat_bytes(f"PREP-BLOCK:{fifo}"))
        wait_until(lambda: get(server.port, "/bankml")[1]["health"]["workers"]["busy"] == workers,
                   "every worker is stuck in a preparation")
        assert get(server.port, "/health") == (200, {"status": "ok"})  # all busy, nothing waits: not wedged
        plain = connect(server.port, timeout_s=GUARD_S)
        plain.sendall(chat_bytes("hello"))  # its body's parsing queues behind them
        status, health = wait_until(lambda: (r := get(server.port, "/health"))[0] == 503 and r,
                                    "/health says the workers are wedged")
        assert health["error"]["message"].startswith(f"the server is wedged: all {workers} worker threads have been "
                                                     "busy for")
        release(fifos[0])  # one moves: the queue behind it moves, and the plain chat is answered
        status, _, body = split_response(read_all(plain))
        assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == REPLY
        wait_until(lambda: get(server.port, "/health") == (200, {"status": "ok"}), "/health is 200 again")
        for fifo in fifos[1:]:
            release(fifo)
        for s in sockets:
            assert split_response(read_all(s))[0] == 200
    finally:
        for s in sockets:
            s.close()
        server.stop()


def test_sigterm_ends_the_process_while_a_worker_and_the_engine_are_stuck(tmp_path):
    model, fork = tiny_model(tmp_path)
    config = tmp_path / "grace.toml"
    config.write_text("[serve]\nshutdown_grace_s = 1.0\n")
    server = WedgeServer(model, fork, limits={"wedged_after_s": 0.2}, config=config)
    prep, engine = tmp_path / "prep.fifo", tmp_path / "engine.fifo"
    os.mkfifo(prep)
    os.mkfifo(engine)
    try:
        with connect(server.port, timeout_s=GUARD_S) as a, connect(server.port, timeout_s=GUARD_S) as b:
            a.sendall(chat_bytes(f"HANG:{engine}"))  # the engine thread blocks in its step
            wait_until(lambda: get(server.port, "/health")[0] == 503, "the engine is stuck")
            b.sendall(chat_bytes(f"PREP-BLOCK:{prep}"))  # a worker blocks in its preparation
            wait_until(lambda: get(server.port, "/bankml")[1]["health"]["workers"]["busy"] == 1, "a worker is stuck")
        # both clients went away (the abandoned requests): nothing in flight holds the stop
        server.proc.send_signal(signal.SIGTERM)
        try:
            code = server.proc.wait(GUARD_S)  # without the watchdog: forever (SIGKILL was needed)
        except subprocess.TimeoutExpired:
            raise AssertionError("SIGTERM did not end the process:\n" + server.log()) from None
        assert code == FORCED_EXIT, server.log()
        line = server.wait_for_log(r"stopping: the process is still running .* exiting now")
        assert line is not None and "bankml-worker" in line.group(0), server.log()
    finally:
        server.stop()
