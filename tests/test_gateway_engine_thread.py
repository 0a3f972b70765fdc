"""The engine thread and its asyncio bridge, without a server: ordering, batching, cancellation,
back-pressure, failures. The fake engines are generators under tests/batch_adapter.py's
GeneratorBatch, which gives them the thread's BatchEngine protocol (add, iterate, cancel, ...)."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import pytest
from batch_adapter import GeneratorBatch

from bankml.errors import Overloaded
from gateway.serving.engine_client import EngineClient
from model.engine_thread import EngineThread, EngineThreadFailed
from model.messages import FinishReason, GenerateRequest, SamplingParams, StepOutput

pytestmark = pytest.mark.timeout(60)


class CountingEngine(GeneratorBatch):
    """Yields `n` tokens, `step_s` apart; records how many steps each request really ran, and every
    iteration's running requests and every cancel, in order (`log`)."""

    def __init__(self, n: int = 5, step_s: float = 0.0, fail_at: int | None = None, die_at: int | None = None,
                 max_seqs: int = 1):
        super().__init__()
        self.n, self.step_s, self.fail_at, self.die_at = n, step_s, fail_at, die_at
        self.max_seqs = max_seqs
        self.steps: dict[str, int] = {}
        self.threads: set[str] = set()
        self.log: list[tuple] = []  # ("iterate", request ids with an output) and ("cancel", request id)
        self.rids: dict[int, str] = {}
        self.resets = 0

    def generate(self, prompt_tokens, params=None, request_id="generate"):
        self.threads.add(threading.current_thread().name)
        self.steps[request_id] = 0
        for i in range(self.n):
            if i == self.fail_at:
                raise RuntimeError("boom")
            if i == self.die_at:
                raise SystemExit("the device is gone")
            time.sleep(self.step_s)
            self.steps[request_id] += 1
            yield StepOutput(token=i, text=f"t{i} ", prompt_tokens=len(prompt_tokens), completion_tokens=i + 1,
                             finish_reason=FinishReason.STOP if i == self.n - 1 else None)

    def add(self, request):
        task = super().add(request)
        self.rids[task] = request.request_id
        return task

    def iterate(self):
        it = super().iterate()
        self.log.append(("iterate", *(self.rids[t] for t, _ in it.outputs)))
        return it

    def cancel(self, task):
        self.log.append(("cancel", self.rids[task]))
        return super().cancel(task)

    def reset(self):
        self.resets += 1
        return super().reset()


def _thread_with(engine) -> EngineThread:
    t = EngineThread()
    t.call(lambda: t.set_engine(engine)).result(5)
    return t


def _request(rid: str) -> GenerateRequest:
    return GenerateRequest([1, 2, 3], SamplingParams(), request_id=rid)


async def _collect(client: EngineClient, rid: str) -> list[StepOutput]:
    async with client.generate(_request(rid)) as gen:
        return [out async for out in gen]


def test_outputs_arrive_in_order_with_timings_on_the_last():
    engine = CountingEngine(n=4, step_s=0.01)
    thread = _thread_with(engine)
    outs = asyncio.run(_collect(EngineClient(thread), "a"))
    assert [o.text for o in outs] == ["t0 ", "t1 ", "t2 ", "t3 "]
    assert outs[-1].finish_reason is FinishReason.STOP
    assert outs[-1].prompt_ms > 0 and outs[-1].predicted_ms >= 25
    assert engine.threads == {"bankml-engine"}  # the device is touched by the engine thread only
    thread.stop()


def test_requests_queue_one_after_another():
    engine = CountingEngine(n=3, step_s=0.01)
    thread = _thread_with(engine)

    async def both():
        client = EngineClient(thread)
        return await asyncio.gather(_collect(client, "a"), _collect(client, "b"))

    a, b = asyncio.run(both())
    assert [o.text for o in a] == [o.text for o in b] == ["t0 ", "t1 ", "t2 "]
    # max_seqs = 1: the second starts when the first has ended, never beside it
    assert all(len(set(entry[1:])) <= 1 for entry in engine.log if entry[0] == "iterate")
    thread.stop()


def test_leaving_early_aborts_within_one_step_and_frees_the_engine():
    engine = CountingEngine(n=10_000, step_s=0.005)
    thread = _thread_with(engine)

    async def leave_after_two():
        client = EngineClient(thread)
        async with client.generate(_request("long")) as gen:
            async for out in gen:
                if out.completion_tokens == 2:
                    break
        t0 = time.monotonic()
        short = CountingEngine(n=2)
        await client.call(lambda: thread.set_engine(short))
        return time.monotonic() - t0

    waited = asyncio.run(leave_after_two())
    assert waited < 1.0  # the long one did not run on
    assert engine.steps["long"] <= 4  # two read, at most one more in flight when the flag was seen
    thread.stop()


def test_a_cancelled_task_cancels_its_generation():
    engine = CountingEngine(n=10_000, step_s=0.005)
    thread = _thread_with(engine)

    async def cancel_it():
        task = asyncio.create_task(_collect(EngineClient(thread), "gone"))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wrap_future(thread.call(lambda: None))  # runs once the aborted job is done

    asyncio.run(cancel_it())
    assert engine.steps["gone"] < 100
    thread.stop()


def test_an_engine_error_ends_that_request_with_the_reason_and_the_next_one_runs():
    thread = _thread_with(CountingEngine(n=5, fail_at=2))
    outs = asyncio.run(_collect(EngineClient(thread), "bad"))
    assert outs[-1].finish_reason is FinishReason.ERROR and "boom" in outs[-1].error
    thread.call(lambda: thread.set_engine(CountingEngine(n=2))).result(5)
    assert asyncio.run(_collect(EngineClient(thread), "good"))[-1].finish_reason is FinishReason.STOP
    thread.stop()


def test_a_dead_thread_answers_the_waiting_and_the_later_requests_at_once():
    engine = CountingEngine(n=5, step_s=0.01, die_at=2)
    thread = _thread_with(engine)

    async def run():
        client = EngineClient(thread)
        return await asyncio.gather(_collect(client, "dies"), _collect(client, "waits"))

    dies, waits = asyncio.run(run())
    assert dies[-1].finish_reason is FinishReason.ERROR and "the device is gone" in dies[-1].error
    # waiting in the engine's queue or in the thread's: answered with the reason either way
    assert waits[-1].finish_reason is FinishReason.ERROR and "the device is gone" in waits[-1].error
    assert thread.failure and not thread.alive
    later = asyncio.run(_collect(EngineClient(thread), "later"))
    assert later[-1].finish_reason is FinishReason.ERROR
    assert later[-1].error.startswith("the engine thread stopped") and "the device is gone" in later[-1].error
    with pytest.raises(EngineThreadFailed):
        thread.call(lambda: None).result(5)


def test_no_engine_is_an_error_not_a_hang():
    thread = EngineThread()
    outs = asyncio.run(_collect(EngineClient(thread), "none"))
    assert outs[-1].finish_reason is FinishReason.ERROR and outs[-1].error == "no model is loaded"
    thread.stop()


class _Held:
    """Holds the engine thread in a `call` until released, so that submissions pile up meanwhile."""

    def __init__(self, thread: EngineThread):
        self._release = threading.Event()
        self._running = threading.Event()
        self.done = thread.call(self._hold)
        assert self._running.wait(5)

    def _hold(self) -> None:
        self._running.set()
        self._release.wait(10)

    def release(self) -> None:
        self._release.set()
        self.done.result(5)


def _submit(thread: EngineThread, rid: str, into: queue.Queue):
    return thread.submit(_request(rid), lambda out: into.put((rid, out)))


def _drain(into: queue.Queue, n_final: int) -> list[tuple[str, StepOutput]]:
    """Outputs until `n_final` requests have had their last one."""
    got = []
    while n_final:
        rid, out = into.get(timeout=10)
        got.append((rid, out))
        n_final -= out.finish_reason is not None
    return got


def _until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_several_requests_interleave_up_to_max_seqs():
    engine = CountingEngine(n=3, max_seqs=2)
    thread = _thread_with(engine)
    held, into = _Held(thread), queue.Queue()
    for rid in "abc":
        _submit(thread, rid, into)
    held.release()
    got = _drain(into, 3)
    by_rid = {rid: [o.text for r, o in got if r == rid] for rid in "abc"}
    assert by_rid == {rid: ["t0 ", "t1 ", "t2 "] for rid in "abc"}
    iterations = [entry[1:] for entry in engine.log if entry[0] == "iterate"]
    assert iterations[:3] == [("a", "b")] * 3  # two sequences at once, each advanced every iteration
    assert ("c",) in iterations[3:]  # the third waited for a free sequence, then ran
    thread.stop()


def test_cancel_before_start_never_reaches_the_engine():
    engine = CountingEngine(n=3)
    thread = _thread_with(engine)
    held, into = _Held(thread), queue.Queue()
    ticket = _submit(thread, "early", into)
    ticket.cancel()
    held.release()
    [(rid, out)] = _drain(into, 1)
    assert out.finish_reason is FinishReason.ABORT and out.token is None
    assert "early" not in engine.steps and engine.rids == {}
    thread.stop()


def test_cancel_mid_stream_frees_the_sequence_before_the_next_step():
    engine = CountingEngine(n=10_000, step_s=0.002, max_seqs=1)
    thread = _thread_with(engine)
    into: queue.Queue = queue.Queue()
    ticket = _submit(thread, "long", into)
    after = _submit(thread, "next", into)  # waits for the only sequence
    while into.get(timeout=5)[1].completion_tokens < 3:
        pass
    ticket.cancel()
    while (out := into.get(timeout=5))[0] != "next":
        final = out[1]
    assert final.finish_reason is FinishReason.ABORT and final.timeline is not None
    after.cancel()
    _drain(into, 1)
    at = engine.log.index(("cancel", "long"))
    assert all("long" not in entry[1:] for entry in engine.log[at + 1:])  # no step of it after the cancel
    assert engine.log[at + 1] == ("iterate", "next")  # the freed sequence went to the one waiting
    assert engine.steps["long"] <= 5
    thread.stop()


def test_calls_run_between_iterations_while_a_generation_is_live():
    engine = CountingEngine(n=200, step_s=0.002)
    thread = _thread_with(engine)
    into: queue.Queue = queue.Queue()
    _submit(thread, "g", into)
    into.get(timeout=5)
    seen = thread.call(lambda: (engine.steps["g"], len(engine.log), threading.current_thread().name)).result(5)
    steps, n_log, name = seen
    assert 0 < steps < 200 and name == "bankml-engine"
    got = _drain(into, 1)
    assert got[-1][1].finish_reason is FinishReason.STOP and engine.steps["g"] == 200
    assert len(engine.log) > n_log  # it went on after the call
    thread.stop()


def test_a_call_with_a_condition_waits_for_it_between_iterations():
    """A slot action waits for its slot's sequence to end (model/slots.py): `ready` is checked after each
    iteration, the call runs at the first that holds, and the generation is never disturbed."""
    engine = CountingEngine(n=60, step_s=0.002)
    thread = _thread_with(engine)
    into: queue.Queue = queue.Queue()
    _submit(thread, "g", into)
    into.get(timeout=5)
    checks = []

    def ready() -> bool:
        checks.append(engine.steps["g"])
        return engine.steps["g"] >= 40

    ran_at = thread.call(lambda: engine.steps["g"], ready).result(5)
    assert 40 <= ran_at < 60 and len(checks) > 1 and checks == sorted(checks)
    got = _drain(into, 1)
    assert got[-1][1].finish_reason is FinishReason.STOP and engine.steps["g"] == 60
    # nothing runs: a condition that never holds is not waited for; one that fails lets the call run
    assert thread.call(lambda: "idle", lambda: False).result(5) == "idle"
    assert thread.call(lambda: "ran", lambda: 1 / 0).result(5) == "ran"
    thread.stop()


def test_swapping_the_engine_ends_the_old_engines_live_requests_with_an_error():
    old = CountingEngine(n=10_000, step_s=0.002, max_seqs=2)
    thread = _thread_with(old)
    into: queue.Queue = queue.Queue()
    _submit(thread, "a", into)
    _submit(thread, "b", into)
    into.get(timeout=5)
    new = CountingEngine(n=2)
    thread.call(lambda: thread.set_engine(new)).result(5)
    got = _drain(into, 2)
    finals = {r: o for r, o in got if o.finish_reason is not None}
    assert set(finals) == {"a", "b"}
    assert all(o.finish_reason is FinishReason.ERROR and "unloaded" in o.error for o in finals.values())
    assert asyncio.run(_collect(EngineClient(thread), "c"))[-1].finish_reason is FinishReason.STOP
    assert "c" in new.steps and "c" not in old.steps
    thread.stop()


def test_a_failed_iteration_ends_every_running_request_and_the_engine_serves_the_next():
    class Failing(CountingEngine):
        def iterate(self):
            if len(self.log) == 3:
                self.log.append(("failed",))
                raise RuntimeError("kaput")
            return super().iterate()

    engine = Failing(n=50, max_seqs=2)
    thread = _thread_with(engine)
    held, into = _Held(thread), queue.Queue()
    _submit(thread, "a", into)
    _submit(thread, "b", into)
    _submit(thread, "w", into)  # waits for a sequence: the failure is not its
    held.release()
    got = _drain(into, 3)
    finals = {r: o for r, o in got if o.finish_reason is not None}
    assert all(finals[r].finish_reason is FinishReason.ERROR and finals[r].error == "RuntimeError: kaput"
               for r in "ab")
    assert finals["w"].finish_reason is FinishReason.STOP
    assert engine.resets == 1 and thread.alive
    assert asyncio.run(_collect(EngineClient(thread), "c"))[-1].finish_reason is FinishReason.STOP
    thread.stop()


def test_overloaded_past_max_waiting_and_in_flight_counts():
    engine = CountingEngine(n=10_000, step_s=0.002, max_seqs=1)
    thread = EngineThread(max_waiting=2)
    thread.call(lambda: thread.set_engine(engine)).result(5)
    assert thread.in_flight() == (0, 0)
    held, into = _Held(thread), queue.Queue()
    # max_seqs + max_waiting in flight: the free sequence takes one of the queued at the next admission
    tickets = [_submit(thread, rid, into) for rid in "abc"]
    assert thread.in_flight() == (0, 3)
    with pytest.raises(Overloaded, match="2 requests are waiting.*max_waiting = 2"):
        _submit(thread, "d", into)
    held.release()
    _until(lambda: thread.in_flight() == (1, 2))  # one running, two waiting for the only sequence
    with pytest.raises(Overloaded):
        _submit(thread, "too many", into)
    for t in tickets:
        t.cancel()
    _until(lambda: thread.in_flight() == (0, 0) and thread.stats() is not None and thread.stats().running == 0)
    _submit(thread, "d", into)  # room again
    thread.stop()
