"""The monitor's routes on the real gateway over the fake engine: /bankml/usage, /bankml/metrics,
/bankml/status, /metrics and GET / — shapes, key order, one record per answer, the loopback rule."""

from __future__ import annotations

import json

import httpx
import pytest
from fake_engine import REPLY_PIECES
from gateway_helpers import FakeServer, exchange, request_bytes, split_response, tiny_model
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(120)

USAGE_KEYS = ["source", "cores", "mem_total_bytes", "mem_available_bytes", "swap_total_bytes", "swap_free_bytes",
              "rss_bytes", "cpu_percent", "interval_ms", "processes", "package_watts", "gpus", "gpu_limiter",
              "sampled_at", "package_energy_j", "unavailable"]
METRICS_KEYS = ["source", "kept", "keep", "prompt_tokens", "completion_tokens", "energy_j", "joules_per_token",
                "records"]
HI = {"messages": [{"role": "user", "content": "Say hello."}]}


@pytest.fixture(scope="module")
def pinned(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("monitor"))


@pytest.fixture(scope="module")
def server(pinned):
    s = FakeServer(*pinned)
    yield s
    s.stop()


def chat(server, body: dict) -> httpx.Response:
    return httpx.post(server.url("/v1/chat/completions"), json=body, timeout=30)


def prometheus(server) -> dict[str, dict[tuple, float]]:
    r = httpx.get(server.url("/metrics"), timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=")
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(v for k, v in sorted(s.labels.items()) if k != "le")] = s.value
    return out


def test_usage_has_the_original_keys_in_order_and_a_limiter(server):
    r = httpx.get(server.url("/bankml/usage"), timeout=10)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    u = r.json()
    assert list(u) == USAGE_KEYS and u["interval_ms"] == 250 and u["source"] == "bankml sys.rs (/proc)"
    assert [p["name"] for p in u["processes"]] == ["bankml serve"] and u["rss_bytes"] > 0
    for key in ("package_watts", "package_energy_j"):  # no RAPL here (or root-only): null, with the reason
        assert u[key] is not None or u["unavailable"][key]
    lim = u["gpu_limiter"]  # the engine runs in this process, so the limiter is not null
    assert (lim["limit"], lim["sequences_max"]) == (0.75, 1) and list(lim)[:2] == ["limit", "allocated_bytes"]
    assert "gpu_limiter" not in u["unavailable"]


def test_one_metrics_record_per_completed_answer(server):
    before = httpx.get(server.url("/bankml/metrics")).json()
    assert chat(server, HI).status_code == 200
    with httpx.stream("POST", server.url("/v1/chat/completions"), json={**HI, "stream": True}, timeout=30) as r:
        assert r.status_code == 200 and r.read().endswith(b"data: [DONE]\n\n")
    assert chat(server, {**HI, "max_tokens": 4}).json()["choices"][0]["finish_reason"] == "length"
    assert chat(server, {"messages": [{"role": "user", "content": "FAIL"}]}).status_code == 500
    r = httpx.get(server.url("/bankml/metrics"))
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    m = r.json()
    assert list(m) == METRICS_KEYS and m["keep"] == 256
    new = m["records"][before["kept"]:]
    assert [x["finish"] for x in new] == ["stop", "stop", "length"]  # the failed answer pushed nothing
    assert [x["completion_tokens"] for x in new] == [len(REPLY_PIECES), len(REPLY_PIECES), 4]
    assert m["completion_tokens"] == sum(x["completion_tokens"] for x in m["records"])
    rec = new[0]
    assert rec["model"] == "Tiny-Model.Q8_0" and rec["cached_tokens"] == 0 and rec["grammar_ms"] == 0.0
    assert rec["eval_tps"] == pytest.approx(rec["completion_tokens"] / (rec["eval_ms"] / 1e3), rel=0.02)
    assert rec["prompt_tps"] == pytest.approx(rec["prompt_tokens"] / (rec["prompt_ms"] / 1e3), rel=0.05)
    assert 0 < rec["ttft_ms"] <= rec["prompt_ms"] + rec["eval_ms"]
    if rec["energy_j"] is None:  # this machine: no RAPL counter the server can read
        assert rec["joules_per_token"] is None and m["energy_j"] is None
        assert rec["unavailable"]["energy_j"].startswith("the engine runs on the CPU and RAPL is unmeasured: ")


def test_prometheus_names_and_counters_move_after_an_answer(server):
    before = prometheus(server)
    for name in ("bankml_prompt_tokens_total", "bankml_completion_tokens_total", "bankml_ttft_seconds_bucket",
                 "bankml_request_duration_seconds_count", "bankml_requests_running", "bankml_requests_waiting",
                 "bankml_process_resident_memory_bytes",
                 "bankml_limiter_memory_fraction", "bankml_model_info"):
        assert name in before, name
    prompt_tokens = len(httpx.post(server.url("/apply-template"), json=HI).json()["prompt"].encode())
    assert chat(server, HI).status_code == 200
    after = prometheus(server)
    assert after["bankml_completion_tokens_total"][()] - before["bankml_completion_tokens_total"][()] == len(
        REPLY_PIECES)
    assert after["bankml_prompt_tokens_total"][()] - before["bankml_prompt_tokens_total"][()] == prompt_tokens
    assert after["bankml_answers_total"][("stop",)] == before.get("bankml_answers_total", {}).get(("stop",), 0) + 1
    assert after["bankml_ttft_seconds_count"][()] == before["bankml_ttft_seconds_count"][()] + 1
    assert not any(n.endswith("_created") for n in after)
    measured = httpx.get(server.url("/bankml/metrics")).json()["energy_j"] is not None
    assert ("bankml_answer_energy_joules_total" in after) == measured  # unmeasured: absent, never 0 J


def test_status_says_what_was_verified_with_usage_and_answers(server, pinned):
    chat(server, HI)
    r = httpx.get(server.url("/bankml/status"), timeout=10)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    s = r.json()
    bankml = httpx.get(server.url("/bankml")).json()
    n = 2 + len(bankml)
    assert list(s)[:2] == ["bankml", "at"] and list(s)[2:n] == list(bankml)
    assert s["verified"]["model_sha256"] == json.loads(pinned[1].read_text())["files"][0]["sha256"]
    assert list(s)[n:] == ["serve", "usage", "metrics", "dashboard"] and s["serve"]["mode"] == "native"
    assert list(s["usage"]) == USAGE_KEYS and list(s["metrics"]) == METRICS_KEYS
    assert 1 <= len(s["metrics"]["records"]) <= 20 and s["metrics"]["kept"] >= len(s["metrics"]["records"])


def test_root_is_a_page_for_browsers_and_a_line_for_api_clients(server):
    page = httpx.get(server.url("/"), headers={"Accept": "text/html,application/xhtml+xml;q=0.9,*/*;q=0.8"})
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert "/bankml/status" in page.text and "/*STATUS_JS*/" not in page.text and "/*STATUS_CSS*/" not in page.text
    assert "http://" not in page.text and "https://" not in page.text  # nothing outside this server
    for accept in ("*/*", "application/json", "text/html;q=0"):
        r = httpx.get(server.url("/"), headers={"Accept": accept})
        assert r.status_code == 200 and r.text == "bankml is running (Ollama's API at /api, native only)"
    status, headers, body = split_response(exchange(server.port, request_bytes("HEAD", "/")))
    assert status == 200 and body == b""
    assert httpx.get(server.url("/metrics?x=1")).status_code == 404  # exact targets, as every route


def test_a_foreign_host_cannot_reach_the_monitor(server):
    for path in ("/", "/bankml/status", "/metrics", "/bankml/usage"):
        status, _, _ = split_response(exchange(server.port, request_bytes(
            "GET", path, host="evil.example", headers={"Accept": "text/html"})))
        assert status == 403, path
