"""The answer path after the engine: OpenAI's shapes on the wire and through the `openai` client, and
the one measurement of each answer (the engine thread's timeline and energy) that the receipt,
/bankml/metrics and Prometheus all report.

Over HTTP the gateway is the real one over the fake engine (tests/gateway_helpers.py); the engine
thread's own stamps are checked in process, with a fake energy meter.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading

import httpx
import openai
import pytest
from fake_engine import REPLY, FakeEngine
from gateway_helpers import FakeServer, tiny_model
from prometheus_client.parser import text_string_to_metric_families

from bankml import __version__
from gateway.serving.engine_client import EngineClient
from model.engine_thread import EngineThread
from model.messages import FinishReason, GenerateRequest, SamplingParams, StepOutput

pytestmark = pytest.mark.timeout(120)

HI = [{"role": "user", "content": "Say hello."}]
ID = re.compile(r"chatcmpl-[0-9a-f]{32}")
FINGERPRINT = f"b{__version__}"
CHUNK_KEYS = ["choices", "created", "id", "model", "system_fingerprint", "object"]


def sha(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = FakeServer(*tiny_model(tmp_path_factory.mktemp("answer")))
    yield s
    s.stop()


def post(server, body: dict | bytes, timeout_s: float = 30) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url("/v1/chat/completions"), content=content,
                      headers={"Content-Type": "application/json"}, timeout=timeout_s)


def sse(r: httpx.Response) -> list:
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream", r.text
    out = []
    for block in r.text.split("\n\n"):
        if block:
            assert block.startswith("data: ")
            data = block.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)


def prometheus(server) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(httpx.get(server.url("/metrics"), timeout=10).text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(v for k, v in sorted(s.labels.items()) if k != "le")] = s.value
    return out


# --- OpenAI's shape on the wire -------------------------------------------------------------------


def test_an_answer_has_an_id_and_a_fingerprint_in_llama_servers_key_order(server):
    a, b = post(server, {"messages": HI}), post(server, {"messages": HI})
    assert a.status_code == b.status_code == 200
    body = a.json()
    assert list(body) == ["choices", "created", "model", "system_fingerprint", "object", "usage", "id", "timings",
                          "bankml_receipt"]
    assert ID.fullmatch(body["id"]) and body["id"] != b.json()["id"]
    assert body["system_fingerprint"] == FINGERPRINT
    assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY}


def test_a_stream_opens_with_the_role_and_every_chunk_has_the_answers_id(server):
    body = json.dumps({"messages": HI, "stream": True}).encode()
    events = sse(post(server, body))
    *chunks, receipt, done = events
    assert done == "[DONE]"
    assert all(list(c)[:6] == CHUNK_KEYS for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and ID.fullmatch(chunks[0]["id"])
    assert {c["system_fingerprint"] for c in chunks} == {FINGERPRINT}
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": None},
                                     "finish_reason": None}]
    # without stream_options.include_usage the finish chunk carries usage all the same
    final = chunks[-1]
    assert list(final) == [*CHUNK_KEYS, "usage", "timings"]
    assert final["choices"] == [{"index": 0, "delta": {}, "finish_reason": "stop"}]
    assert final["usage"]["completion_tokens"] == 9
    # the receipt is a chunk of no choices with the answer's id, usage and timings again, so a client that
    # reads every chunk without choices as the usage chunk (llama-server's tests, the openai helper) agrees
    assert list(receipt) == [*CHUNK_KEYS, "usage", "timings", "bankml_receipt"] and receipt["choices"] == []
    assert receipt["id"] == final["id"] and (receipt["usage"], receipt["timings"]) == (final["usage"], final["timings"])
    assert final["timings"]["predicted_n"] == 9 and final["timings"]["prompt_n"] == final["usage"]["prompt_tokens"]
    text = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks[:-1])
    assert text == REPLY
    assert receipt["bankml_receipt"]["response_sha256"] == sha(text)
    assert receipt["bankml_receipt"]["request_sha256"] == sha(body)


def test_include_usage_puts_usage_in_a_last_chunk_without_choices(server):
    body = json.dumps({"messages": HI, "stream": True, "stream_options": {"include_usage": True}}).encode()
    *chunks, receipt, done = sse(post(server, body))
    finish, usage = chunks[-2:]
    assert list(finish) == CHUNK_KEYS and finish["choices"][0]["finish_reason"] == "stop"
    assert list(usage) == [*CHUNK_KEYS, "usage", "timings"] and usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 9 and usage["timings"]["cache_n"] == 0
    assert usage["timings"]["predicted_n"] == 9
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 9
    assert len({c["id"] for c in chunks}) == 1
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-2])
    assert receipt["bankml_receipt"]["response_sha256"] == sha(text) == sha(REPLY)
    assert all(isinstance(e["choices"], list) for e in [*chunks, receipt])


def test_stream_options_of_the_wrong_type_is_llama_servers_400(server):
    r = post(server, {"messages": HI, "stream": True, "stream_options": {"include_usage": "yes"}})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ("Field 'include_usage': [json.exception.type_error.302] "
                                            "type must be boolean, but is string")


# --- the openai client, unchanged -----------------------------------------------------------------


@pytest.mark.parametrize("include_usage", [False, True], ids=["plain", "include_usage"])
def test_the_openai_client_streams_with_one_id_and_a_receipt_that_verifies(server, include_usage):
    sent: list[bytes] = []
    http = httpx.Client(event_hooks={"request": [lambda r: sent.append(r.read())]}, timeout=30)
    c = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0, http_client=http)
    extra = {"stream_options": {"include_usage": True}} if include_usage else {}
    chunks = list(c.chat.completions.create(model="tiny-model.q8_0", messages=HI, stream=True, **extra))
    receipt = chunks[-1].model_extra["bankml_receipt"]
    answer = chunks[:-1]
    assert chunks[-1].choices == []
    assert len({x.id for x in answer}) == 1 and ID.fullmatch(answer[0].id)
    assert {x.system_fingerprint for x in answer} == {FINGERPRINT}
    assert answer[0].choices[0].delta.role == "assistant" and answer[0].choices[0].delta.content is None
    text = "".join(ch.delta.content or "" for x in answer for ch in x.choices)
    assert text == REPLY
    if include_usage:
        assert answer[-1].choices == [] and answer[-1].usage.completion_tokens == 9
        assert answer[-2].choices[0].finish_reason == "stop" and answer[-2].usage is None
    else:
        assert answer[-1].choices[0].finish_reason == "stop" and answer[-1].usage.completion_tokens == 9
    assert receipt["response_sha256"] == sha(text)
    assert receipt["request_sha256"] == sha(sent[-1])


def test_the_openai_clients_stream_helper_assembles_the_answer(server):
    # it reads `choices` of every chunk, the receipt's included
    with client(server).chat.completions.stream(model="tiny-model.q8_0", messages=HI,
                                                stream_options={"include_usage": True}) as stream:
        deltas = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert "".join(deltas) == REPLY
    assert final.choices[0].message.content == REPLY and final.choices[0].finish_reason == "stop"
    assert ID.fullmatch(final.id) and final.system_fingerprint == FINGERPRINT
    assert final.usage.completion_tokens == 9


def test_the_openai_client_plain_answer_has_the_id_and_fingerprint(server):
    out = client(server).chat.completions.create(model="tiny-model.q8_0", messages=HI)
    assert ID.fullmatch(out.id) and out.system_fingerprint == FINGERPRINT and out.object == "chat.completion"
    assert out.choices[0].message.content == REPLY


# --- one measurement: the receipt, /bankml/metrics and Prometheus agree ---------------------------


def test_one_ttft_for_the_receipt_the_record_and_prometheus_and_time_queued_is_not_in_it(server):
    before = prometheus(server)
    body = json.dumps({"messages": [{"role": "user", "content": "LONG"}], "stream": True,
                       "max_tokens": 300}).encode()
    with httpx.stream("POST", server.url("/v1/chat/completions"), content=body,
                      headers={"Content-Type": "application/json"}, timeout=30) as first:
        chunks = first.iter_bytes()
        next(chunks)  # the first answer has the engine, for 300 steps of 2 ms at least
        second: dict = {}
        waiting = threading.Thread(target=lambda: second.update(r=post(server, {"messages": HI, "stream": True})))
        waiting.start()
        for _ in chunks:
            pass
    waiting.join()
    receipt = sse(second["r"])[-2]["bankml_receipt"]
    records = httpx.get(server.url("/bankml/metrics")).json()["records"]
    assert [r["completion_tokens"] for r in records[-2:]] == [300, 9]  # the second answer ended last
    record = records[-1]
    # the receipt's TTFT is the record's: from the answer's turn on the engine, the wait excluded
    assert receipt["ttft_ms"] == pytest.approx(record["ttft_ms"], abs=1)
    assert 0 <= receipt["ttft_ms"] <= receipt["wall_ms"]
    after = prometheus(server)
    ttft_s = after["bankml_ttft_seconds_sum"][()] - before["bankml_ttft_seconds_sum"][()]
    assert ttft_s == pytest.approx((records[-2]["ttft_ms"] + record["ttft_ms"]) / 1e3, abs=1e-3)
    assert after["bankml_ttft_seconds_count"][()] == before["bankml_ttft_seconds_count"][()] + 2


def test_running_and_waiting_are_the_engines_own_counts(server):
    body = json.dumps({"messages": [{"role": "user", "content": "LONG"}], "stream": True}).encode()
    with httpx.stream("POST", server.url("/v1/chat/completions"), content=body,
                      headers={"Content-Type": "application/json"}, timeout=30) as long:
        received = long.iter_bytes()  # kept: a dropped iterator would close the stream
        next(received)  # the long answer runs
        waiting = threading.Thread(target=post, args=(server, {"messages": HI}))
        waiting.start()
        counts = (0, 0)
        for _ in range(200):
            prom = prometheus(server)
            counts = prom["bankml_requests_running"][()], prom["bankml_requests_waiting"][()]
            if counts == (1, 1):
                break
        assert counts == (1, 1)
        status = httpx.get(server.url("/bankml/status"), timeout=10).json()["serve"]
        assert (status["requests_running"], status["requests_waiting"]) == (1, 1)
    waiting.join()  # the client left the long answer: it aborted, and the waiting one ran
    prom = prometheus(server)
    assert (prom["bankml_requests_running"][()], prom["bankml_requests_waiting"][()]) == (0, 0)
    assert prom["bankml_answers_total"][("abort",)] >= 1


# --- the engine thread's stamps and energy, in process --------------------------------------------


class FakeMeter:
    """Marks are numbers; a reading is the list of marks still open when it was stopped."""

    def __init__(self, fail_start: bool = False):
        self.fail_start = fail_start
        self.open: set[int] = set()
        self.cancelled: list[int] = []
        self._n = 0

    def start(self) -> int:
        if self.fail_start:
            raise OSError("RAPL went away")
        self._n += 1
        self.open.add(self._n)
        return self._n

    def stop(self, mark: int) -> list[int]:
        others = sorted(self.open - {mark})
        self.open.discard(mark)
        return others

    def cancel(self, mark: int) -> None:
        self.open.discard(mark)
        self.cancelled.append(mark)


def run(thread: EngineThread, *prompts: str, max_tokens: int = -1) -> list[StepOutput]:
    async def one(prompt: str) -> StepOutput:
        request = GenerateRequest(list(prompt.encode()), SamplingParams(max_tokens=max_tokens), request_id=prompt)
        async with EngineClient(thread).generate(request) as generation:
            return [out async for out in generation][-1]

    async def all_of():
        return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(all_of())


@pytest.fixture
def engine_thread():
    thread = EngineThread()
    engine = FakeEngine(step_s=0.002)
    thread.call(lambda: thread.set_engine(engine)).result(5)
    yield thread
    thread.stop()


def test_the_final_output_carries_the_timeline_and_the_energy(engine_thread):
    meter = engine_thread.meter = FakeMeter()
    a, b = run(engine_thread, "one", "two", max_tokens=5)
    for out in (a, b):
        t = out.timeline
        assert out.finish_reason is FinishReason.LENGTH and out.completion_tokens == 5
        assert t.queued_s <= t.started_s <= t.first_token_s <= t.first_text_s <= t.ended_s
        assert out.prompt_ms == t.prompt_ms > 0 and out.predicted_ms == t.predicted_ms > 0
        assert out.energy == [] and out.energy_why is None  # one answer at a time: no other mark open
    assert b.timeline.started_s >= a.timeline.ended_s  # the second waited: its queue time, not its prompt
    assert b.timeline.queue_ms >= a.timeline.prompt_ms + a.timeline.predicted_ms
    assert meter.open == set() and meter.cancelled == []


def test_a_failed_answer_cancels_its_energy_mark_and_a_broken_meter_costs_only_the_energy(engine_thread):
    meter = engine_thread.meter = FakeMeter()
    failed, ok = run(engine_thread, "FAIL", "fine")
    assert failed.finish_reason is FinishReason.ERROR and failed.energy is None
    assert meter.cancelled == [1] and ok.energy == [] and meter.open == set()
    engine_thread.meter = FakeMeter(fail_start=True)
    (out,) = run(engine_thread, "again")
    assert out.finish_reason is FinishReason.STOP and out.energy is None
    assert out.energy_why == "the energy meter failed at the start: OSError: RAPL went away"
    engine_thread.meter = None
    (out,) = run(engine_thread, "unmetered")
    assert out.energy is None and out.energy_why == "no energy meter"
