"""The Ray ingress's and replica's own errors (bankml/replica.py) in the shape of the request's API, as
the gateway renders its own: no Ray needed (tests/test_ray_serve.py runs them through Ray's proxy)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from bankml.replica import WHOLE_BYTES, Forwarded, Head, Unavailable, error_body, error_chunk, forward


@pytest.mark.parametrize("target", ["/v1/chat/completions", "/completion", "/v1/responses?x=1", "/"])
def test_openai_and_llama_server_routes_get_the_error_object(target):
    doc = json.loads(error_body(413, "request body over 10 bytes", target))
    assert doc == {"error": {"code": 413, "message": "request body over 10 bytes", "type": "unavailable_error"}}


@pytest.mark.parametrize("target", ["/api/chat", "/api/generate?stream=false"])
def test_ollama_routes_get_ollamas_error(target):
    assert json.loads(error_body(502, "the replica failed", target)) == {"error": "the replica failed"}


@pytest.mark.parametrize("target", ["/v1/messages", "/v1/messages/count_tokens", "/v1/messages?beta=true"])
def test_anthropic_routes_get_anthropics_error_with_its_type_by_status(target):
    doc = json.loads(error_body(413, "too big", target))
    assert doc == {"type": "error", "error": {"type": "request_too_large", "message": "too big"}}
    assert json.loads(error_body(503, "x", target))["error"]["type"] == "overloaded_error"
    assert json.loads(error_body(502, "x", target))["error"]["type"] == "api_error"


def test_a_cut_stream_ends_in_its_own_shape():
    openai = error_chunk("text/event-stream; charset=utf-8", 502, "cut", "/v1/chat/completions")
    assert openai.startswith(b"data: ") and openai.endswith(b"\n\n")
    assert json.loads(openai[6:])["error"]["message"] == "cut"
    anthropic = error_chunk("text/event-stream", 502, "cut", "/v1/messages")
    event, data = anthropic.rstrip(b"\n").split(b"\n")
    assert event == b"event: error"  # the event the anthropic SDK raises on
    assert json.loads(data[len(b"data: "):]) == {"type": "error", "error": {"type": "api_error", "message": "cut"}}
    assert json.loads(error_chunk("application/x-ndjson", 502, "cut", "/api/chat")) == {"error": "cut"}
    assert error_chunk("application/json", 502, "cut", "/v1/chat/completions") is None


def _collect(transport: httpx.MockTransport, target: str) -> list:
    async def run() -> list:
        async with httpx.AsyncClient(transport=transport) as client:
            return [part async for part in forward(client, "http://127.0.0.1:9", Forwarded("POST", target, [], b"{}"))]
    return asyncio.run(run())


def test_a_child_that_takes_no_connection_is_unavailable_and_one_that_fails_answers_in_the_apis_shape():
    def refuse(request):
        raise httpx.ConnectError("refused", request=request)

    def time_out(request):
        raise httpx.ReadTimeout("slow", request=request)

    parts = _collect(httpx.MockTransport(refuse), "/api/chat")
    assert len(parts) == 1 and isinstance(parts[0], Unavailable)
    [head] = _collect(httpx.MockTransport(time_out), "/api/chat")  # a whole answer: its body in its head
    assert isinstance(head, Head) and head.status == 502
    assert json.loads(head.body)["error"].startswith("the replica's server did not answer: ReadTimeout")
    [head] = _collect(httpx.MockTransport(time_out), "/v1/messages")
    assert json.loads(head.body)["error"]["type"] == "api_error"


class Cut(httpx.AsyncByteStream):
    async def __aiter__(self):
        yield b'{"choices": ['
        raise httpx.ReadError("the child died")


def test_a_small_answer_cut_before_it_is_whole_is_a_502_in_the_apis_shape():
    def cut(request):
        return httpx.Response(200, headers={"content-type": "application/json", "content-length": "100"}, stream=Cut())

    [head] = _collect(httpx.MockTransport(cut), "/api/chat")
    assert head.status == 502 and json.loads(head.body)["error"].startswith("the replica's server stopped mid-answer")


class Chunks(httpx.AsyncByteStream):
    def __init__(self, parts: list[bytes]):
        self.parts = parts

    async def __aiter__(self):
        for part in self.parts:
            yield part


def test_a_small_whole_answer_comes_with_its_head_and_a_stream_or_a_large_one_in_pieces():
    """One item through Ray's streamed call for a small answer (bench/replicas.py: each costs ms)."""
    def small(request):
        return httpx.Response(200, json={"status": "ok"})

    def sse(request):
        return httpx.Response(200, headers={"content-type": "text/event-stream", "content-length": "9"},
                              stream=Chunks([b"data: 1\n\n"]))

    def large(request):
        return httpx.Response(200, headers={"content-length": str(WHOLE_BYTES + 1)},
                              stream=Chunks([b"x" * WHOLE_BYTES, b"x"]))

    [head] = _collect(httpx.MockTransport(small), "/health")
    assert head.status == 200 and json.loads(head.body) == {"status": "ok"}
    assert ("content-length", str(len(head.body))) in head.headers
    head, *rest = _collect(httpx.MockTransport(sse), "/v1/chat/completions")
    assert head.body is None and b"".join(rest) == b"data: 1\n\n"
    head, *rest = _collect(httpx.MockTransport(large), "/props")
    assert head.body is None and len(b"".join(rest)) == WHOLE_BYTES + 1
