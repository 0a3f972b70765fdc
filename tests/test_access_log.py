"""The access log (gateway/http/access_log.py): one line per request when it ends, with its method, path
(no query), status, model, tokens in and out and milliseconds; a stream's line after its last event; a
refusal by route or by rule; `--quiet` none. Sanic's "PRODUCTION mode" banner never shows."""

from __future__ import annotations

import re

import httpx
import pytest
from gateway_helpers import FakeServer, tiny_model

pytestmark = pytest.mark.timeout(300)
LINE = re.compile(r"bankml serve: (GET|POST|DELETE|HEAD) (\S+) (\d{3}|-) (\S+)(?: in=(\d+) out=(\d+))? (\d+) ms$")
HI = [{"role": "user", "content": "hi"}]


def _access(server) -> list[re.Match]:
    return [m for m in (LINE.match(line.rstrip("\n")) for line in server.lines) if m]


def _wait_lines(server, n: int) -> list[re.Match]:
    server.wait_for_log(r"(?s)(bankml serve: (GET|POST) .*){" + str(n) + "}")
    return _access(server)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("access"))


def test_a_line_per_request_with_its_model_tokens_and_status(models):
    server = FakeServer(*models, engine={"max_seqs": 2})
    try:
        assert not _access(server)  # start-up lines are not requests
        r = httpx.post(server.url("/v1/chat/completions"), json={"messages": HI, "max_tokens": 5, "n": 2}, timeout=60)
        assert r.status_code == 200
        kept = httpx.get(server.url("/bankml/metrics"), timeout=30).json()  # the two choices' records
        with httpx.stream("POST", server.url("/v1/chat/completions"), timeout=60,
                          json={"messages": HI, "max_tokens": 3, "stream": True}) as s:
            assert s.status_code == 200 and "[DONE]" in s.read().decode()
        assert httpx.get(server.url("/nowhere?key=secret"), timeout=30).status_code == 404
        assert httpx.post(server.url("/v1/chat/completions"), json={"messages": "no"}, timeout=30).status_code == 400
        lines = _wait_lines(server, 5)
        chat, metrics, stream, missing, bad = lines[-5:]
        assert (metrics[1], metrics[2], metrics[3], metrics[4]) == ("GET", "/bankml/metrics", "200", "-")
        assert (chat[1], chat[2], chat[3]) == ("POST", "/v1/chat/completions", "200")
        assert chat[4] != "-"  # the model's name
        assert kept["kept"] == 2  # each choice an answer: the line adds them up
        assert (int(chat[5]), int(chat[6])) == (kept["prompt_tokens"], kept["completion_tokens"])
        assert stream[3] == "200" and int(stream[6]) >= 1
        assert (missing[2], missing[3], missing[4], missing[5]) == ("/nowhere", "404", "-", None)  # no query
        assert "secret" not in server.log()
        assert bad[3] == "400" and bad[5] is None
        assert "PRODUCTION mode" not in server.log()
    finally:
        server.stop()


def test_quiet_writes_none(models):
    server = FakeServer(*models, flags=["--quiet"])
    try:
        r = httpx.post(server.url("/v1/chat/completions"), json={"messages": HI, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        assert httpx.get(server.url("/health"), timeout=30).status_code == 200
        server.wait_for_log(r"POST /v1/chat", timeout_s=1)
        assert not _access(server)
    finally:
        server.stop()
