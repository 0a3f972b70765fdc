"""The status page in a real browser: headless Chromium loads GET /, its script polls /bankml/status,
and the rendered DOM shows the verified model's sha256, a usage table and the last answers. A
screenshot is left in tests/artifacts/status_page.png (gitignored) for a person to look at.

Skipped without Chromium (Debian: `apt-get install chromium`), except in CI, where it must run.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import threading
from html.parser import HTMLParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from gateway_helpers import EdgeServer, FakeServer, tiny_model
from gpu_monitor_fakes import MEMINFO, FakeGpu, add_card, make_pynvml, write, write_proc

from bankml import jstr
from gateway.monitor.monitoring import Monitoring
from gateway.monitor.routes import status_page
from gpu_monitor.sample import Monitor

pytestmark = pytest.mark.timeout(180)

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
HI = {"messages": [{"role": "user", "content": "Say hello."}]}


def chromium() -> str:
    exe = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed (CI must have it: apt-get install chromium)")
        pytest.skip("chromium is not installed")
    return exe


def browse(exe: str, profile: Path, url: str, *what: str) -> subprocess.CompletedProcess:
    # --virtual-time-budget lets the page's timers and fetches run for 4 s of page time, then dumps
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--virtual-time-budget=4000", "--window-size=1280,1250", *what, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


class Cells(HTMLParser):
    """The text of each element with an id, and the rows (lists of cell texts) of each table's tbody."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, str] = {}
        self.rows: dict[str, list[list[str]]] = {}
        self._open: list[str | None] = []
        self._table: str | None = None
        self._in_cell = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self._table = a.get("id")
            self.rows.setdefault(self._table or "", [])
        elif tag == "tr" and self._table is not None:
            self.rows[self._table].append([])
        elif tag == "td" and self._table is not None:
            self.rows[self._table][-1].append("")
            self._in_cell = True
        self._open.append(a.get("id"))
        if a.get("id"):
            self.by_id.setdefault(a["id"], "")

    def handle_endtag(self, tag):
        if self._open:
            self._open.pop()
        if tag == "table":
            self._table = None
        self._in_cell = self._in_cell and tag != "td"

    def handle_data(self, data):
        for i in self._open:
            if i:
                self.by_id[i] += data
        if self._in_cell and self._table is not None:
            self.rows[self._table][-1][-1] += data


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model, fork = tiny_model(tmp_path_factory.mktemp("status"))
    s = FakeServer(model, fork)
    yield s, json.loads(fork.read_text())["files"][0]["sha256"]
    s.stop()


def test_the_page_renders_the_model_usage_and_answers(served, tmp_path):
    exe = chromium()
    server, sha = served
    for body in (HI, {**HI, "max_tokens": 3}):
        assert httpx.post(server.url("/v1/chat/completions"), json=body, timeout=30).status_code == 200
    r = browse(exe, tmp_path / "profile", server.url("/"), "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    page = Cells()
    page.feed(r.stdout)
    assert page.by_id["model-sha256"].strip() == sha
    assert page.by_id["live"].startswith("updated ")  # the script fetched /bankml/status and rendered it
    usage = page.rows["usage-table"]
    assert len(usage) >= 5 and all(len(row) == 2 and row[0].strip() for row in usage)
    assert dict((k, v) for k, v in usage)["CPU cores"].isdigit()
    processes = page.rows["process-table"]
    assert processes[1][0] == "bankml serve" and re.fullmatch(r"[\d.]+ [KMG]iB", processes[1][2])
    answers = page.rows["answers-table"][1:]  # the header row has no cells
    assert [row[7] for row in answers[:2]] == ["length", "stop"]  # newest first
    assert answers[0][3] == "3"  # completion tokens of the max_tokens=3 answer
    assert answers[0][8] == "not measured" or re.fullmatch(r"\d+\.\d{3}", answers[0][8])  # energy J
    assert page.rows["limiter-table"][-1] == ["sequences decoding", "0 of 1"]

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "status_page.png"
    shot.unlink(missing_ok=True)
    r = browse(exe, tmp_path / "profile", server.url("/"), f"--screenshot={shot}")
    assert r.returncode == 0 and shot.stat().st_size > 10_000, r.stderr[-2000:]


def test_with_an_api_key_the_page_reads_it_from_its_fragment(tmp_path):
    """--api-key: the page itself is public, its /bankml/status fetch needs the key, which the page takes
    from /#key=KEY (a fragment never reaches the server); without it the page says what to do. The page
    is served without the state it carries otherwise (what /bankml/status would say without a key)."""
    exe = chromium()
    model, fork = tiny_model(tmp_path / "m")
    server = EdgeServer(model, fork, "--api-key", "s3cret-key")
    try:
        served = httpx.get(server.url("/"), headers={"Accept": "text/html"}).text
        assert '<script type="application/json" id="initial">null</script>' in served
        assert json.loads(fork.read_text())["files"][0]["sha256"] not in served
        bare = Cells()
        bare.feed(browse(exe, tmp_path / "p1", server.url("/"), "--dump-dom").stdout)
        assert "HTTP 401" in bare.by_id["live"] and "#key=" in bare.by_id["live"]
        keyed = Cells()
        keyed.feed(browse(exe, tmp_path / "p2", server.url("/#key=s3cret-key"), "--dump-dom").stdout)
        assert keyed.by_id["live"].startswith("updated ")
        assert keyed.by_id["model-sha256"].strip() == json.loads(fork.read_text())["files"][0]["sha256"]
    finally:
        server.stop()


def test_gpu_rows_render_from_a_machine_with_gpus(tmp_path):
    """The GPU branch of the page, on a fake machine (an amdgpu card and an NVML GPU without a card),
    served by a plain HTTP server: no GPU here, and a script error there would blank the whole page."""
    exe = chromium()
    s = tmp_path / "sys"
    add_card(s, "card0", driver="amdgpu", pci="0000:03:00.0", files={
        "gpu_busy_percent": "42\n", "mem_info_vram_used": "1073741824\n", "mem_info_vram_total": "4294967296\n",
        "mem_info_gtt_used": "0\n", "mem_info_gtt_total": "8589934592\n"})
    write(tmp_path / "proc" / "meminfo", MEMINFO)
    write_proc(tmp_path / "proc", 100, "bankml serve", 10, 5, 2048)
    monitor = Monitor(proc_root=tmp_path / "proc", sys_root=s, nvml=make_pynvml([FakeGpu()]), amdsmi=None,
                      processes=[("bankml serve", 100)], window_s=0.01)
    monitoring = Monitoring(monitor, whoami=lambda: {"verified": {"model_sha256": "ab" * 32}, "model": "/m.gguf"},
                            mode="p0", root_text="x")
    state = asyncio.run(monitoring.status())
    monitoring.close()
    state["usage"]["gpu_limiter"] = {  # as an engine on a GPU reports it (gpu_monitor/limiter.py)
        "limit": 0.75, "allocated_bytes": 2 << 30, "heap_bytes": None, "limit_bytes": 100 << 30, "peak_bytes": None,
        "sequences_max": 4, "sequences_in_use": 1, "device": "cuda:0", "source": "jax memory_stats",
        "unavailable": {}}
    status = jstr.dumps(state).encode()

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):
            body, kind = (status, "application/json") if self.path == "/bankml/status" else (
                status_page(), "text/html; charset=utf-8")
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/"
    try:
        r = browse(exe, tmp_path / "profile", url, "--dump-dom")
        ARTIFACTS.mkdir(exist_ok=True)
        browse(exe, tmp_path / "profile", url, f"--screenshot={ARTIFACTS / 'status_page_gpus.png'}")
    finally:
        httpd.shutdown()
    page = Cells()
    page.feed(r.stdout)
    gpus = page.rows["gpu-table"][1:]
    assert [row[0] for row in gpus] == ["card0 (amdgpu)", "nvml0 (nvidia)"]
    assert gpus[0][2:5] == ["42", "1.0 GiB / 4.0 GiB", "0 B / 8.0 GiB"]
    assert gpus[1][1:4] == ["NVIDIA H200", "37", "10.0 GiB / 140 GiB"]
    assert (gpus[1][5], gpus[1][7], gpus[1][8]) == ("250.0", "41", "sw_power_cap")
    assert gpus[0][5] == "not measured" and page.by_id["mode"] == "in front of llama-server"
    assert page.rows["limiter-table"][:2] == [["device", "cuda:0"], ["GPU memory share allowed", "75 %"]]
    # the charts: a memory line per GPU pool, a power line per GPU, the card without a power reading says why
    legend = " ".join(re.sub(r"<[^>]+>", "", li) for li in re.findall(r"<li>(.*?)</li>", r.stdout))
    for shown in ("card0 VRAM: 1.0 GiB", "card0 GTT: 0 B", "nvml0 VRAM: 10.0 GiB", "nvml0: 250.0 W",
                  "card0: not measured here, because ", "running: not measured here, because no engine runs in "
                  "this process", "generated: not measured here, because llama-server answers here and measures "
                  "its answers itself"):
        assert shown in legend, shown
