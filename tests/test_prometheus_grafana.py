"""configs/grafana-bankml.json against a real Prometheus (Debian's `prometheus`; `.ci/run` installs it):
Prometheus scrapes a running server (a tiny model on the native engine) every second while requests
run, and every query of every panel of the dashboard is evaluated through Prometheus's HTTP API and
returns data. A panel whose every series this machine cannot measure (GPU boards, energy counters) is
the exception: its series are absent from /metrics (never written as 0), its description says "Not measured where ...",
and /bankml/usage gives the reason.

Also the histograms: time to first token, inter-token latency and request duration, with vLLM's
buckets.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from importlib import resources

import httpx
import pytest
from gateway_helpers import CliServer, free_port, tiny_model
from prometheus_client.parser import text_string_to_metric_families

from gateway.monitor.prometheus import ITL_BUCKETS_S, LATENCY_BUCKETS_S, TTFT_BUCKETS_S

PROMETHEUS = shutil.which("prometheus")
SYSTEM = "You are a careful assistant. Answer briefly and plainly, in one short sentence, and never more. " * 3
pytestmark = pytest.mark.timeout(600)


def dashboard() -> dict:
    return json.loads(resources.files("configs").joinpath("grafana-bankml.json").read_text())


def test_the_dashboard_is_grafana_json_over_our_metrics():
    d = dashboard()
    assert d["uid"] == "bankml-serve" and d["schemaVersion"] >= 36
    assert [v["type"] for v in d["templating"]["list"]] == ["datasource"]  # the Prometheus to read, chosen on import
    titles = [p["title"] for p in d["panels"]]
    assert len(set(titles)) == len(titles)
    exprs = [t["expr"] for p in d["panels"] for t in p["targets"]]
    for want in ("bankml_ttft_seconds_bucket", "bankml_inter_token_latency_seconds_bucket",
                 "bankml_request_duration_seconds_bucket", "bankml_requests_waiting", "bankml_kv_cache_usage_ratio",
                 "bankml_prefix_cache_hits_total", "bankml_answer_energy_joules_total",
                 "bankml_device_memory_in_use_bytes"):
        assert any(want in e for e in exprs), want
    for p in d["panels"]:
        assert p["fieldConfig"]["defaults"]["unit"], p["title"]  # each with its unit


@pytest.fixture(scope="module")
def server(tmp_path_factory, bankml_cmd):
    model, fork = tiny_model(tmp_path_factory.mktemp("grafana"))
    s = CliServer(bankml_cmd, str(model), "--fork", str(fork), "--ctx", "512", "--quiet")
    yield s
    s.stop()


def _traffic(server, stop: threading.Event) -> None:
    i = 0
    while not stop.is_set():
        i += 1
        try:
            httpx.post(server.url("/v1/chat/completions"), timeout=60, json={
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}"}],
                "max_tokens": 6 + i % 5, "temperature": 0})
        except httpx.HTTPError:
            pass


def _names(expr: str) -> set[str]:
    """The metric names an expression reads (without a histogram's or counter's suffix)."""
    return {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in re.findall(r"\bbankml_[a-z_]+", expr)}


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (Debian's package `prometheus`; .ci/run "
                                               "installs it)")
def test_every_dashboard_query_returns_data_from_a_real_prometheus(server, tmp_path):
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(f"""global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: bankml
    static_configs:
      - targets: ["127.0.0.1:{server.port}"]
""")
    stop = threading.Event()
    load = threading.Thread(target=_traffic, args=(server, stop), daemon=True)
    load.start()
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        deadline = time.monotonic() + 180
        scrapes = 0.0
        while time.monotonic() < deadline:  # until it has scraped a while with answers completing
            time.sleep(1)
            try:
                r = httpx.get(f"{api}/query", params={"query": "count_over_time(bankml_completion_tokens_total[1m])"},
                              timeout=10).json()
            except httpx.HTTPError:
                continue
            result = r.get("data", {}).get("result", [])
            scrapes = float(result[0]["value"][1]) if result else 0.0
            if scrapes >= 6:
                break
        assert scrapes >= 6, "Prometheus did not scrape the server"
        exposition = httpx.get(server.url("/metrics"), timeout=30).text
        present = {f.name for f in text_string_to_metric_families(exposition) if f.samples}
        usage = httpx.get(server.url("/bankml/usage"), timeout=30).json()
        unmeasured = []
        for panel in dashboard()["panels"]:
            for target in panel["targets"]:
                expr = target["expr"].replace("$__rate_interval", "30s")
                if not _names(expr) & present:  # nothing of it measured here: said so, with a reason
                    assert "Not measured where" in panel["description"], panel["title"]
                    unmeasured.append(panel["title"])
                    continue
                r = httpx.get(f"{api}/query", params={"query": expr}, timeout=30).json()
                assert r["status"] == "success", (panel["title"], r)
                values = [s["value"][1] for s in r["data"]["result"]]
                assert values and any(v not in ("NaN", "+Inf", "-Inf") for v in values), (panel["title"], expr, r)
        assert "Generation tokens/s" not in unmeasured and "Inter-token latency" not in unmeasured
        if unmeasured:  # the reason is the server's: no GPU board here, no energy counter readable
            assert usage.get("unavailable") or usage.get("gpus") == [] or "energy" in json.dumps(usage), usage
    finally:
        stop.set()
        prom.terminate()
        prom.wait(30)
        load.join(120)


def test_the_latency_histograms_have_vllms_buckets(server):
    httpx.post(server.url("/v1/chat/completions"), timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url("/metrics"), timeout=30).text)}
    for name, buckets in (("bankml_ttft_seconds", TTFT_BUCKETS_S), ("bankml_request_duration_seconds",
                                                                    LATENCY_BUCKETS_S),
                          ("bankml_inter_token_latency_seconds", ITL_BUCKETS_S)):
        samples = families[name].samples
        bounds = [float(s.labels["le"]) for s in samples if s.name == name + "_bucket"]
        assert bounds == [*buckets, float("inf")], name
        count = next(s.value for s in samples if s.name == name + "_count")
        assert count >= 1, name
    itl = {s.name: s.value for s in families["bankml_inter_token_latency_seconds"].samples
           if not s.name.endswith("_bucket")}
    records = httpx.get(server.url("/bankml/metrics"), timeout=30).json()["records"]
    gaps = sum(r["completion_tokens"] - 1 for r in records if r["completion_tokens"] > 1)
    assert itl["bankml_inter_token_latency_seconds_count"] >= gaps  # every gap of every answer kept
    assert 0 < itl["bankml_inter_token_latency_seconds_sum"] < 600

