"""The engine thread and its asyncio bridge, without a server: ordering, cancellation, failures."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from gateway.engine_client import EngineClient
from model.engine_thread import EngineThread, EngineThreadFailed
from model.messages import FinishReason, GenerateRequest, SamplingParams, StepOutput

pytestmark = pytest.mark.timeout(60)


class CountingEngine:
    """Yields `n` tokens, `step_s` apart; records how many steps each request really ran."""

    def __init__(self, n: int = 5, step_s: float = 0.0, fail_at: int | None = None, die_at: int | None = None):
        self.n, self.step_s, self.fail_at, self.die_at = n, step_s, fail_at, die_at
        self.steps: dict[str, int] = {}
        self.threads: set[str] = set()

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
    assert waits[-1].finish_reason is FinishReason.ERROR and waits[-1].error.startswith("the engine thread stopped")
    assert thread.failure and not thread.alive
    later = asyncio.run(_collect(EngineClient(thread), "later"))
    assert later[-1].finish_reason is FinishReason.ERROR
    with pytest.raises(EngineThreadFailed):
        thread.call(lambda: None).result(5)


def test_no_engine_is_an_error_not_a_hang():
    thread = EngineThread()
    outs = asyncio.run(_collect(EngineClient(thread), "none"))
    assert outs[-1].finish_reason is FinishReason.ERROR and outs[-1].error == "no model is loaded"
    thread.stop()
