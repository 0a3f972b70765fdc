"""/metrics carries what an inference router's endpoint picker scrapes (the Gateway API Inference Extension's
model-server protocol), under vLLM's exact names, beside our bankml_* series and agreeing with them:
on the in-process registry, and scraped from a tiny model's server while requests run and wait."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from gateway_helpers import CliServer, tiny_model
from prometheus_client.parser import text_string_to_metric_families

from gateway.monitor.prometheus import PromMetrics
from model.messages import EngineStats

GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
          "vllm:lora_requests_info", "vllm:cache_config_info")


def samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(found: dict[str, list], name: str) -> float:
    (s,) = found[name]
    return s.value


def stats(**kw) -> EngineStats:
    base = dict(max_seqs=4, running=2, waiting=3, page_size=16, pages_total=64, pages_used=24, pages_cached=8,
                prefix_queries_tokens=0, prefix_hits_tokens=0, preemptions=0, iterations=1, spec_steps=0,
                spec_drafts=0, spec_draft_tokens=0, spec_accepted_tokens=0, sequences=())
    return EngineStats(**{**base, **kw})


def test_the_names_the_picker_reads_are_in_the_text_with_vllms_labels():
    prom = PromMetrics(lambda: (2, 3), lambda: {"model": "SmolLM2.gguf"}, lambda: stats())
    text = prom.exposition({}, None)[0].decode()
    for name in GAUGES:
        assert f"\n# TYPE {name} gauge\n" in text  # the colon survives: GaugeMetricFamily takes it as is
    assert 'vllm:num_requests_waiting{engine="0",model_name="SmolLM2.gguf"} 3.0' in text
    assert 'vllm:num_requests_running{engine="0",model_name="SmolLM2.gguf"} 2.0' in text
    found = samples(text)
    assert value(found, "vllm:kv_cache_usage_perc") == value(found, "bankml_kv_cache_usage_ratio") == 24 / 64
    (cache,) = found["vllm:cache_config_info"]
    assert cache.labels == {"block_size": "16", "num_gpu_blocks": "64", "engine": "0"} and cache.value == 1
    (lora,) = found["vllm:lora_requests_info"]
    assert lora.labels == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert abs(lora.value - time.time()) < 60  # the scrape's time, as vLLM's set_to_current_time


def test_openmetrics_keeps_the_names_when_the_scraper_allows_them():
    """prometheus_client (0.26) escapes a sample's ':' to '_' in OpenMetrics unless the scraper's Accept
    allows UTF-8 names (Prometheus 3 does), as it does for vLLM's own /metrics; the text format, which
    the endpoint picker reads, keeps them always."""
    prom = PromMetrics(lambda: (0, 0), lambda: {}, lambda: stats(running=0, waiting=0, pages_used=0))
    body, content_type = prom.exposition({}, "application/openmetrics-text; version=1.0.0; escaping=allow-utf-8")
    assert content_type.startswith("application/openmetrics-text")
    assert b'vllm:num_requests_waiting{engine="0",model_name=""} 0.0' in body
    body, content_type = prom.exposition({}, "text/plain;version=0.0.4;q=0.9,*/*;q=0.1")
    assert content_type.startswith("text/plain") and b'\nvllm:num_requests_waiting{engine="0",model_name=""} 0.0' in body


def test_without_an_engine_here_there_is_nothing_to_route_on():
    prom = PromMetrics(lambda: None, lambda: {}, lambda: None)  # P0: llama-server's own /metrics has its own
    assert not [n for n in samples(prom.exposition({}, None)[0].decode()) if n.startswith("vllm:")]


def test_no_paged_pool_no_kv_usage():
    prom = PromMetrics(lambda: (1, 0), lambda: {}, lambda: stats(pages_total=0, pages_used=0, pages_cached=0))
    found = samples(prom.exposition({}, None)[0].decode())
    assert "vllm:num_requests_running" in found and "vllm:kv_cache_usage_perc" not in found


@pytest.fixture(scope="module")
def server(tmp_path_factory, bankml_cmd):
    d = tmp_path_factory.mktemp("gaie")
    model, fork = tiny_model(d)
    config = d / "one.toml"
    config.write_text("[engine]\nmax_seqs = 1\nmax_prefill_bucket = 256\n")  # one runs, the others wait
    s = CliServer(bankml_cmd, str(model), "--fork", str(fork), "--ctx", "256", "--config", str(config))
    yield s
    s.stop()


def test_scraped_while_requests_run_and_wait_the_gauges_agree_with_ours(server):
    def ask(i: int) -> None:
        httpx.post(server.url("/completion"), json={"prompt": f"request {i}: tell a long story", "n_predict": 200,
                                                   "ignore_eos": True, "temperature": 0}, timeout=300)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    seen = {"running": 0.0, "waiting": 0.0, "kv": 0.0}
    scrapes = 0
    while any(t.is_alive() for t in threads):
        found = samples(httpx.get(server.url("/metrics"), timeout=30).text)
        scrapes += 1
        running, waiting = value(found, "vllm:num_requests_running"), value(found, "vllm:num_requests_waiting")
        assert running == value(found, "bankml_requests_running")
        assert waiting == value(found, "bankml_requests_waiting")
        if "bankml_kv_cache_usage_ratio" in found:  # once the engine has a snapshot
            kv = value(found, "vllm:kv_cache_usage_perc")
            assert kv == value(found, "bankml_kv_cache_usage_ratio") and 0.0 <= kv <= 1.0
            seen["kv"] = max(seen["kv"], kv)
        seen["running"] = max(seen["running"], running)
        seen["waiting"] = max(seen["waiting"], waiting)
        assert {s.labels["model_name"] for s in found["vllm:num_requests_running"]} == {"Tiny-Model.Q8_0.gguf"}
    for t in threads:
        t.join()
    assert scrapes > 1 and seen["running"] == 1 and seen["waiting"] >= 1 and seen["kv"] > 0, seen
    found = samples(httpx.get(server.url("/metrics"), timeout=30).text)
    assert value(found, "vllm:num_requests_running") == value(found, "vllm:num_requests_waiting") == 0
    assert value(found, "vllm:kv_cache_usage_perc") == value(found, "bankml_kv_cache_usage_ratio") == 0
