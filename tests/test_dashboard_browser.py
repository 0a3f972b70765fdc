"""The dashboard at / in headless Chromium while answers are being made: the page's first paint is the
state it was served with (no "–" where the server has a value), its charts gather points as it polls,
and what it shows agrees with /bankml/metrics and /bankml/usage read around the same moment. A
screenshot is left for a person: its path is printed, and it is copied to $BANKML_ARTIFACTS/dashboard.png
when that is set.

Skipped without Chromium (Debian: `apt-get install chromium`), except in CI, where it must run.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from gateway_helpers import CliServer, FakeServer, tiny_model
from test_status_page import Cells, browse, chromium

from gateway.monitor.routes import status_page

pytestmark = pytest.mark.timeout(240)

HTML = {"Accept": "text/html"}
HI = {"messages": [{"role": "user", "content": "Say hello."}]}
PLACEHOLDER = ("", "–", "-")
INITIAL = re.compile(r'<script type="application/json" id="initial">(.*?)</script>', re.S)
FIGURE = re.compile(r'<figure class="chart" id="chart-(\w+)" data-points="(\d+)"')


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model, fork = tiny_model(tmp_path_factory.mktemp("dashboard"))
    # two sequences at 20 ms a step: answers overlap and last long enough to be seen running
    s = FakeServer(model, fork, step_ms=20, engine={"max_seqs": 2})
    yield s, json.loads(fork.read_text())["files"][0]["sha256"]
    s.stop()


class Traffic:
    """Chat completions posted from two threads until stopped, as clients would."""

    def __init__(self, server: FakeServer):
        self.server, self.done, self.stop = server, 0, threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(2)]

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                assert client.post(self.server.url("/v1/chat/completions"), json=HI).status_code == 200
                self.done += 1
                time.sleep(0.05)

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + 60
        while self.done < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.done >= 4, "no answers came"
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def read(server: FakeServer) -> tuple[dict, dict]:
    return httpx.get(server.url("/bankml/metrics")).json(), httpx.get(server.url("/bankml/usage")).json()


def to_bytes(text: str) -> float:
    value, unit = text.split()
    return float(value) * 1024 ** ["B", "KiB", "MiB", "GiB", "TiB"].index(unit)


def legend(dom: str, chart: str) -> dict[str, str]:
    """The legend of one chart: series label -> the value or reason beside it."""
    figure = dom.split(f'id="chart-{chart}"', 1)[1].split("</figure>", 1)[0]
    items = (html.unescape(re.sub(r"<[^>]+>", "", li)).strip() for li in re.findall(r"<li>(.*?)</li>", figure, re.S))
    return dict(item.split(": ", 1) for item in items)


def keep_screenshot(exe: str, tmp_path: Path, url: str, name: str) -> None:
    """A screenshot of the page under pytest's tmp_path, copied to $BANKML_ARTIFACTS when that is set."""
    shot = tmp_path / name
    taken = browse(exe, tmp_path / "profile", url, f"--screenshot={shot}", "--window-size=1280,1500")
    assert taken.returncode == 0 and shot.stat().st_size > 10_000, taken.stderr[-2000:]
    print(f"dashboard screenshot: {shot}")
    if os.environ.get("BANKML_ARTIFACTS"):
        kept = Path(os.environ["BANKML_ARTIFACTS"]) / name
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, kept)
        print(f"dashboard screenshot kept: {kept}")


def rate(record: dict) -> str:
    """The answers table's prompt tok/s cell, as the page words it (status.js promptRate)."""
    uncached = record["prompt_tokens"] - record["cached_tokens"]
    if record["cached_tokens"] > 0 and uncached <= 4:
        return f"cached, {uncached} new" if uncached else "cached"
    if record["prompt_tps"] is None:
        return "not measured"
    return f"{record['prompt_tps']:.2f}" + (f" ({uncached} new)" if record["cached_tokens"] else "")


def test_the_page_carries_the_state_it_was_served_with(served):
    server, sha = served
    httpx.post(server.url("/v1/chat/completions"), json=HI, timeout=30)
    page = httpx.get(server.url("/"), headers=HTML)
    initial = json.loads(INITIAL.search(page.text).group(1))
    assert initial["verified"]["model_sha256"] == sha and initial["dashboard"]["totals"]["answers"] >= 1
    assert initial["metrics"]["records"] and "http://" not in page.text and "https://" not in page.text


def test_the_state_cannot_end_its_script_element():
    hostile = {"model": "</script><script>alert(1)</script><!--", "serve": {}}
    page = status_page(hostile).decode()
    text = INITIAL.search(page).group(1)
    assert json.loads(text) == hostile and "<" not in text
    assert page.count("<script") == 2  # the state's and the page's own, nothing more


def test_the_first_paint_shows_what_the_server_has(served, tmp_path):
    """#poll=0: the page draws the state it was served with and never asks for more."""
    exe = chromium()
    server, sha = served
    r = browse(exe, tmp_path / "profile", server.url("/#poll=0"), "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    page = Cells()
    page.feed(r.stdout)
    assert page.by_id["live"].startswith("as served at ") and page.by_id["model-sha256"].strip() == sha
    for field in ("version", "mode", "uptime", "model-name", "model-guard", "model-path", "model-engine",
                  "model-hashed", "totals", "answers-summary", "usage-sampled"):
        assert page.by_id[field].strip() not in PLACEHOLDER, field
    for table in ("usage-table", "process-table", "answers-table", "limiter-table"):
        cells = [c.strip() for row in page.rows[table] for c in row]
        assert cells and not set(cells) & set(PLACEHOLDER), (table, cells)
    points = dict(FIGURE.findall(r.stdout))
    assert points["memory"] == points["requests"] == "1"  # one point: the served state
    assert points["tokens"] == "0"  # a rate needs two polls
    assert legend(r.stdout, "tokens")["generated"] == "a rate needs two polls: at the next one"
    limiter = dict(page.rows["limiter-table"])
    assert "memory share allowed" not in str(limiter)  # on a CPU it does not apply, and says so
    assert limiter["GPU memory share"].startswith("applies to a GPU only: ")


def test_a_one_token_answer_shows_no_decode_rate(served, tmp_path):
    """Its token came with the prompt's pass: the record's eval_tps (1 over the microseconds after it,
    as the spec defines it) would read as thousands of tokens a second."""
    exe = chromium()
    server, _ = served
    assert httpx.post(server.url("/v1/chat/completions"), json={**HI, "max_tokens": 1}, timeout=30).status_code == 200
    r = browse(exe, tmp_path / "profile", server.url("/#poll=0"), "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    page = Cells()
    page.feed(r.stdout)
    newest = page.rows["answers-table"][1]
    assert newest[3] == "1" and newest[6] == "one token, no decode", newest


def test_charts_fill_while_answers_are_made_and_agree_with_the_server(served, tmp_path):
    exe = chromium()
    server, _ = served
    url = server.url("/#poll_ms=250")
    with Traffic(server):
        before, _ = read(server)
        r = browse(exe, tmp_path / "profile", url, "--dump-dom")
        after, usage = read(server)
        keep_screenshot(exe, tmp_path, url, "dashboard.png")
    assert r.returncode == 0, r.stderr[-2000:]

    dom = r.stdout
    page = Cells()
    page.feed(dom)
    assert page.by_id["live"].startswith("updated ")
    points = {k: int(v) for k, v in FIGURE.findall(dom)}
    assert min(points[c] for c in ("tokens", "ttft", "requests", "memory")) >= 3, points

    # the totals line: lifetime sums, between what /bankml/metrics said before and after (the ring keeps
    # every answer of this module: fewer than its 256)
    assert after["kept"] < after["keep"]
    m = re.fullmatch(r"since start: (\d+) answers · (\d+) prompt tokens \((\d+) from the cache\) · (\d+) generated",
                     page.by_id["totals"].strip())
    answers, prompt, _, generated = map(int, m.groups())
    assert before["kept"] <= answers <= after["kept"]
    assert before["prompt_tokens"] <= prompt <= after["prompt_tokens"]
    assert before["completion_tokens"] <= generated <= after["completion_tokens"]

    # the newest answer row is one of the server's records, value for value
    newest = page.rows["answers-table"][1]
    records = {(str(x["prompt_tokens"]), str(x["cached_tokens"]), str(x["completion_tokens"]), f"{x['ttft_ms']:.1f}",
                rate(x), x["finish"]) for x in after["records"]}
    assert (newest[1], newest[2], newest[3], newest[4], newest[5], newest[7]) in records

    # the charts' latest values: TTFT percentiles among the recorded TTFTs, requests within max_seqs,
    # the RSS line as the usage table and /bankml/usage (sampled once a second: within 25 %)
    ttfts = {f"{x['ttft_ms']:.1f} ms" for x in after["records"]}
    ttft = legend(dom, "ttft")
    assert ttft["p95"] in ttfts and next(v for k, v in ttft.items() if k.startswith("p50")) in ttfts
    requests = legend(dom, "requests")
    assert 0 <= int(requests["running"]) <= 2 and int(requests["waiting"]) >= 0
    tokens = legend(dom, "tokens")
    assert re.fullmatch(r"[\d.]+ tok/s", tokens["generated"]) and re.fullmatch(r"[\d.]+ tok/s", tokens["prompt, uncached"])
    rss = to_bytes(legend(dom, "memory")["server RSS"])
    assert rss == to_bytes(dict(page.rows["usage-table"])["server RSS (all processes)"])
    assert abs(rss - usage["rss_bytes"]) <= 0.25 * usage["rss_bytes"]
    # where a source is absent the chart says so, in the server's words
    why = usage["unavailable"]
    if usage["package_watts"] is None:
        assert legend(dom, "power")["CPU package"] == "not measured here, because " + why["package_watts"]
    assert legend(dom, "cache")["pool in use"] == "not measured here, because this engine keeps no paged KV pool"


def test_the_dashboard_block_adds_up_as_the_metrics_do(served):
    """/bankml/status' dashboard: lifetime totals as Prometheus' counters and the ring's sums (fewer than
    256 answers here), TTFT p50/p95 by nearest rank over the last minute's records."""
    server, _ = served
    for _ in range(3):
        httpx.post(server.url("/v1/chat/completions"), json=HI, timeout=30)
    status = httpx.get(server.url("/bankml/status")).json()
    d = status["dashboard"]
    m, _ = read(server)
    prom = httpx.get(server.url("/metrics")).text
    counter = {name: float(v) for name, v in re.findall(r"^(bankml_\w+_total) (\S+)$", prom, re.M)}
    t = d["totals"]
    assert (t["answers"], t["prompt_tokens"], t["completion_tokens"]) == (m["kept"], m["prompt_tokens"],
                                                                         m["completion_tokens"])
    assert (t["prompt_tokens"], t["cached_tokens"], t["completion_tokens"]) == (
        counter["bankml_prompt_tokens_total"], counter["bankml_prompt_cached_tokens_total"],
        counter["bankml_completion_tokens_total"])
    assert t["energy_j"] == m["energy_j"]  # null here: nothing measured, nothing summed
    ttfts = sorted(r["ttft_ms"] for r in m["records"] if r["at"] >= status["at"] - 60 and r["ttft_ms"] is not None)
    assert d["ttft"]["answers"] == len(ttfts) >= 3 and d["ttft"]["window_s"] == 60
    assert d["ttft"]["p50_ms"] == ttfts[(len(ttfts) + 1) // 2 - 1] and d["ttft"]["p95_ms"] == ttfts[-(len(ttfts) // 20) - 1]
    assert d["kv_cache"]["unavailable"] == "this engine keeps no paged KV pool"  # the fake engine's


def test_a_real_engine_charts_its_kv_pool_and_prefix_cache(bankml_cmd, tmp_path):
    """The native engine on a tiny GGUF: a prompt asked again is served from the prefix cache (whole
    pages), so where its length is a page and a token or few, the answers table says "cached" (not a
    rate of 1-4 tok/s), and the KV chart draws the pool's use and the hit rate as /bankml/status has them."""
    exe = chromium()
    model, fork = tiny_model(tmp_path / "m")
    server = CliServer(bankml_cmd, str(model), "--fork", str(fork), "--ctx", "256", "--config", "cpu")
    try:
        def ask(words: int, max_tokens: int) -> int:
            body = {"messages": [{"role": "user", "content": "hello " * words}], "max_tokens": max_tokens}
            r = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=120)
            assert r.status_code == 200
            return r.json()["usage"]["prompt_tokens"]

        ask(1, 1)
        page_size = httpx.get(server.url("/bankml/status")).json()["dashboard"]["kv_cache"]["page_size"]
        words = next(n for n in range(1, 64) if page_size < (k := ask(n, 1)) and 1 <= k % page_size <= 4)
        ask(words, 4)  # the same prompt again: all but its last page's token(s) from the cache
        r = browse(exe, tmp_path / "profile", server.url("/#poll_ms=250"), "--dump-dom")
        keep_screenshot(exe, tmp_path, server.url("/#poll_ms=250"), "dashboard_engine.png")
        status = httpx.get(server.url("/bankml/status")).json()
    finally:
        server.stop()
    kv = status["dashboard"]["kv_cache"]
    assert kv["pages_total"] > 0 and kv["prefix_hits_tokens"] > 0 and "unavailable" not in kv
    last = status["metrics"]["records"][-1]
    assert 0 < last["prompt_tokens"] - last["cached_tokens"] <= 4  # the engine recomputes the last token(s)
    page = Cells()
    page.feed(r.stdout)
    newest = page.rows["answers-table"][1]
    assert newest[5] == rate(last) and newest[5].startswith("cached")
    cache = legend(r.stdout, "cache")
    assert cache["pool in use"] == f"{kv['usage_ratio'] * 100:.1f} %"
    # no prompt between the polls: the hit rate is idle, not absent
    assert cache["prefix-cache hit rate"] == "no prompt looked up in the last 10 s"
