"""The monitor's gateway side, in process: records, the ring, energy per answer, Prometheus, the limiter.

No HTTP and no GPU: a real EngineThread runs the fake engine, the energy counters are a fake RAPL
tree whose package draws 100 W of wall time, and GPUs are the fake pynvml and DRM cards.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from fake_engine import REPLY_PIECES, FakeEngine
from gpu_monitor_fakes import MEMINFO, FakeGpu, add_card, add_rapl, make_pynvml, write, write_proc
from prometheus_client.parser import text_string_to_metric_families

from bankml.errors import ConfigInvalid
from gateway.monitor.answer_metrics import KEEP, SOURCE, MetricsRing, answer_record
from gateway.monitor.monitoring import Monitoring
from gateway.monitor.prometheus import PromMetrics
from gateway.serving.engine_client import EngineClient
from gpu_monitor.energy import EnergyReading
from gpu_monitor.readings import read_text
from gpu_monitor.sample import Monitor
from model import device_budget
from model.engine_thread import EngineThread
from model.messages import EngineStats, FinishReason, GenerateRequest, SamplingParams, StepOutput, Timeline

pytestmark = pytest.mark.timeout(60)

RECORD_KEYS = ["at", "model", "prompt_tokens", "cached_tokens", "completion_tokens", "prompt_ms", "ttft_ms",
               "eval_ms", "prompt_tps", "eval_tps", "finish", "grammar_ms", "resampled", "energy_j",
               "joules_per_token"]
WATTS = 100.0


def timeline(prompt_ms: float = 500.0, predicted_ms: float = 2500.0, ttft_ms: float | None = 512.34) -> Timeline:
    started_s = 100.0
    first_token_s = started_s + prompt_ms / 1e3
    first_text_s = None if ttft_ms is None else started_s + ttft_ms / 1e3
    return Timeline(started_s - 1.0, started_s, first_token_s, first_text_s, first_token_s + predicted_ms / 1e3)


def last_output(times: Timeline | None = None, **kw) -> StepOutput:
    base = dict(token=2, finish_reason=FinishReason.STOP, prompt_tokens=120, cached_tokens=20,
                completion_tokens=50, timeline=times or timeline())
    return StepOutput(**{**base, **kw})


def reading(j: float | None) -> EnergyReading:
    return EnergyReading(j, j, None, 3.0, False, {} if j is not None else {"energy_j": "RAPL unread"})


# --- the record and the ring (/bankml/metrics) ------------------------------------------------


def test_record_rates_energy_and_key_order():
    r = answer_record("SmolLM2", last_output(energy=reading(10.0)))
    assert list(r)[: len(RECORD_KEYS)] == RECORD_KEYS
    assert list(r)[len(RECORD_KEYS):] == ["queue_ms", "package_energy_j", "gpu_energy_j", "energy_overlapped",
                                          "unavailable"]
    assert r["queue_ms"] == 1000.0  # queued 1 s before its turn (timeline())
    assert (r["prompt_tps"], r["eval_tps"], r["joules_per_token"]) == (200.0, 20.0, 0.2)
    assert (r["ttft_ms"], r["prompt_ms"], r["eval_ms"], r["energy_j"]) == (512.3, 500.0, 2500.0, 10.0)
    assert (r["grammar_ms"], r["resampled"], r["finish"]) == (0.0, 0, "stop")


def test_no_completion_no_rates_and_unmeasured_energy_is_null_with_its_reason():
    r = answer_record("m", last_output(timeline(predicted_ms=0.0, ttft_ms=None), completion_tokens=0,
                                       prompt_tokens=20, energy=reading(None)))
    assert r["prompt_tps"] is None and r["eval_tps"] is None  # 20 prompt, 20 cached: nothing prefilled
    assert r["energy_j"] is None and r["joules_per_token"] is None
    assert r["unavailable"]["energy_j"] == "RAPL unread" and r["unavailable"]["ttft_ms"]
    r = answer_record("m", last_output(energy=None, energy_why="no energy meter"))
    assert r["energy_j"] is None and r["unavailable"]["energy_j"] == "no energy meter"


def test_ring_keeps_256_newest_last_and_energy_totals_over_measured_records_only():
    ring = MetricsRing()
    for i in range(KEEP + 3):
        ring.append(answer_record("m", last_output(completion_tokens=i + 1, energy=reading(None if i % 2 else 2.0)),
                                  at=float(i)))
    body = ring.json_dict()
    assert list(body) == ["source", "kept", "keep", "prompt_tokens", "completion_tokens", "energy_j",
                          "joules_per_token", "records"]
    assert body["source"] == SOURCE and (body["kept"], body["keep"]) == (256, 256)
    assert [r["at"] for r in body["records"]][:2] == [3.0, 4.0] and body["records"][-1]["at"] == 258.0
    measured = [r for r in body["records"] if r["energy_j"] is not None]
    assert body["energy_j"] == 2.0 * len(measured)
    assert body["joules_per_token"] == round(body["energy_j"] / sum(r["completion_tokens"] for r in measured), 4)
    assert body["completion_tokens"] == sum(range(4, 260))
    assert MetricsRing().json_dict()["energy_j"] is None


# --- answers through the engine thread, measured there ------------------------------------------------


def rapl_machine(root: Path) -> Monitor:
    """A fake machine whose one CPU package has used WATTS since the epoch of time.perf_counter()."""
    proc, sys_root = root / "proc", root / "sys"
    write(proc / "meminfo", MEMINFO)
    write_proc(proc, os.getpid(), "bankml serve", 10, 5, 4096)
    zone = add_rapl(sys_root, "intel-rapl:0", "package-0", 0, 2**62)

    def reader(path: Path) -> str:
        if path == zone / "energy_uj":
            return f"{int(time.perf_counter() * WATTS * 1e6)}\n"
        return read_text(path)

    return Monitor(proc_root=proc, sys_root=sys_root, nvml=None, amdsmi=None, reader=reader)


@pytest.fixture
def engine_side(tmp_path):
    thread = EngineThread()
    engine = FakeEngine(step_s=0.01)
    thread.call(lambda: thread.set_engine(engine)).result()
    monitoring = Monitoring(rapl_machine(tmp_path), whoami=lambda: {}, mode="native", root_text="x",
                            engine_thread=thread)
    yield EngineClient(thread), monitoring
    monitoring.close()
    thread.stop()


def job(text: str, **params) -> GenerateRequest:
    return GenerateRequest(list(text.encode()), SamplingParams(**params), request_id=text[:8])


async def answer(monitoring, client, request, *, seen: list | None = None):
    """As the chat route reads an answer: the engine client directly, the record to the monitor."""
    last = None
    with monitoring.answer() as a:
        async with client.generate(request) as generation:
            async for out in generation:
                last = out
                if seen is not None:
                    seen.append(monitoring.flights())
        if last.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            return a.record("Fake", last)
    return None


def test_one_record_per_answer_with_its_own_energy_span(engine_side):
    client, monitoring = engine_side

    seen: list = []

    async def both():
        a = asyncio.create_task(answer(monitoring, client, job("LONG", max_tokens=40), seen=seen))
        b = asyncio.create_task(answer(monitoring, client, job("two")))
        return await a, await b

    a, b = asyncio.run(both())
    assert monitoring.ring.json_dict()["kept"] == 2
    assert (1, 1) in seen  # while the first ran, the second was waiting
    # ... and its record says how long: at least the first one's 40 steps of 10 ms
    assert a["queue_ms"] < 100 and b["queue_ms"] >= 0.9 * 400
    assert monitoring.flights() == (0, 0)
    assert (a["completion_tokens"], b["completion_tokens"]) == (40, len(REPLY_PIECES))
    for r in (a, b):
        assert r["energy_overlapped"] is False
        span_s = (r["prompt_ms"] + r["eval_ms"]) / 1e3
        # the package's 100 W over the answer's own span on the engine; the second answer's wait
        # behind the first (40 steps of 10 ms: 40 J) is not in it
        assert r["energy_j"] == pytest.approx(WATTS * span_s, abs=WATTS * 0.05)
        assert r["joules_per_token"] == pytest.approx(r["energy_j"] / r["completion_tokens"], abs=1e-4)
        assert 0 < r["ttft_ms"] < r["prompt_ms"] + r["eval_ms"]
    prom = scrape(monitoring)
    assert prom["bankml_answers_total"] == {("length",): 1, ("stop",): 1}
    assert prom["bankml_completion_tokens_total"][()] == 40 + len(REPLY_PIECES)
    assert prom["bankml_answer_energy_joules_total"][()] == pytest.approx(a["energy_j"] + b["energy_j"], abs=1e-3)
    assert prom["bankml_answer_energy_tokens_total"][()] == 40 + len(REPLY_PIECES)
    assert prom["bankml_ttft_seconds_count"][()] == 2 and prom["bankml_request_duration_seconds_count"][()] == 2


def test_failed_and_abandoned_answers_push_no_record(engine_side):
    client, monitoring = engine_side

    async def abandon():
        task = asyncio.create_task(answer(monitoring, client, job("LONG LONG")))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(answer(monitoring, client, job("FAIL now")))
    asyncio.run(abandon())
    asyncio.run(answer(monitoring, client, job("ok", max_tokens=3)))
    assert [r["finish"] for r in monitoring.ring.json_dict()["records"]] == ["length"]
    prom = scrape(monitoring)
    assert prom["bankml_answers_total"] == {("error",): 1, ("abort",): 1, ("length",): 1}
    assert monitoring.flights() == (0, 0)


def test_a_dead_engine_thread_leaves_no_request_counted(tmp_path):
    thread = EngineThread()
    engine = FakeEngine()
    thread.call(lambda: thread.set_engine(engine)).result()
    monitoring = Monitoring(rapl_machine(tmp_path), whoami=lambda: {}, mode="native", root_text="x",
                            engine_thread=thread)
    try:
        asyncio.run(answer(monitoring, EngineClient(thread), job("DIE")))
        asyncio.run(answer(monitoring, EngineClient(thread), job("after")))
        assert monitoring.flights() == (0, 0) and monitoring.ring.json_dict()["kept"] == 0
    finally:
        monitoring.close()
        thread.stop()


# --- Prometheus -----------------------------------------------------------------------------------------


def scrape(monitoring: Monitoring, usage: dict | None = None) -> dict[str, dict[tuple, float]]:
    body, content_type = monitoring.prom.exposition(usage or {}, None)
    assert content_type.startswith("text/plain; version=")
    return scrape_text(body)


def scrape_text(body: bytes) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(v for k, v in sorted(s.labels.items()) if k != "le")] = s.value
    return out


def test_usage_series_from_a_machine_with_gpus_and_nulls_left_out(tmp_path):
    s = tmp_path / "sys"
    add_card(s, "card0", driver="amdgpu", pci="0000:03:00.0", files={
        "gpu_busy_percent": "42\n", "mem_info_vram_used": "1024\n", "mem_info_vram_total": "4096\n",
        "mem_info_gtt_used": "garbage\n", "mem_info_gtt_total": "8192\n"})
    write(tmp_path / "proc" / "meminfo", MEMINFO)
    write_proc(tmp_path / "proc", 100, "bankml serve", 10, 5, 2048)
    monitor = Monitor(proc_root=tmp_path / "proc", sys_root=s, nvml=make_pynvml([FakeGpu()]), amdsmi=None,
                      processes=[("bankml serve", 100)], window_s=0.01)
    monitoring = Monitoring(monitor, whoami=lambda: {"model": "/m/SmolLM2.gguf", "engine": "e",
                                                     "verified": {"model_sha256": "ab" * 32, "arch": "llama"}},
                            mode="native", root_text="x")
    try:
        prom = scrape(monitoring, monitor.get_usage_sync())
    finally:
        monitoring.close()
    assert prom["bankml_gpu_busy_percent"] == {("card0",): 42, ("nvml0",): 37}
    assert prom["bankml_gpu_memory_used_bytes"] == {("card0", "vram"): 1024, ("nvml0", "vram"): 10 << 30}
    assert prom["bankml_gpu_memory_total_bytes"][("card0", "gtt")] == 8192  # used gtt unreadable: absent
    assert prom["bankml_gpu_power_watts"] == {("nvml0",): 250.0}
    assert prom["bankml_gpu_energy_joules_total"] == {("nvml0",): 5000.0}
    assert prom["bankml_process_resident_memory_bytes"] == {("bankml serve", "100"): 2048 * 1024}
    assert "bankml_package_energy_joules_total" not in prom  # no RAPL on this fake machine
    assert prom["bankml_model_info"] == {("llama", "e", "SmolLM2.gguf", "ab" * 32): 1}
    # no engine thread in this process (as in P0): its series are absent, not 0
    for name in ("bankml_requests_running", "bankml_requests_waiting", "bankml_kv_cache_usage_ratio",
                 "bankml_prefix_cache_queries_total"):
        assert name not in prom, name


def test_the_schedulers_series_are_read_from_its_snapshot_at_scrape_time():
    snapshot = EngineStats(max_seqs=4, running=2, waiting=1, page_size=16, pages_total=100, pages_used=25,
                           pages_cached=10, prefix_queries_tokens=1000, prefix_hits_tokens=640, preemptions=3)
    now = {"stats": snapshot}
    prom = PromMetrics(lambda: (now["stats"].running, now["stats"].waiting), lambda: {}, lambda: now["stats"])
    body, _ = prom.exposition({}, None)
    got = scrape_text(body)
    assert (got["bankml_requests_running"][()], got["bankml_requests_waiting"][()]) == (2, 1)
    assert got["bankml_kv_cache_usage_ratio"][()] == 0.25
    assert got["bankml_kv_cache_pages"] == {("cached",): 10, ("free",): 65, ("used",): 25}
    assert (got["bankml_prefix_cache_queries_total"][()], got["bankml_prefix_cache_hits_total"][()]) == (1000, 640)
    assert got["bankml_num_preemptions_total"][()] == 3
    # cumulative in the engine, so the counters follow it: never inc()'d here, never double counted
    now["stats"] = replace(snapshot, prefix_queries_tokens=1500, prefix_hits_tokens=900, preemptions=4)
    got = scrape_text(prom.exposition({}, None)[0])
    assert (got["bankml_prefix_cache_queries_total"][()], got["bankml_prefix_cache_hits_total"][()]) == (1500, 900)
    assert got["bankml_num_preemptions_total"][()] == 4
    # an engine without a paged pool has no KV series; no snapshot yet: no scheduler series at all
    now["stats"] = EngineStats(max_seqs=1, running=1)
    got = scrape_text(prom.exposition({}, None)[0])
    assert "bankml_kv_cache_usage_ratio" not in got and got["bankml_prefix_cache_hits_total"][()] == 0
    got = scrape_text(PromMetrics(lambda: (0, 0), lambda: {}, lambda: None).exposition({}, None)[0])
    assert "bankml_prefix_cache_queries_total" not in got and got["bankml_requests_running"][()] == 0


def test_each_app_has_its_own_registry(engine_side):
    client, monitoring = engine_side
    other = Monitoring(Monitor(nvml=None, amdsmi=None), whoami=lambda: {}, mode="native", root_text="x")
    asyncio.run(answer(monitoring, client, job("hi")))
    assert scrape(monitoring)["bankml_answers_total"] == {("stop",): 1}
    assert "bankml_answers_total" not in scrape(other)  # no child series: nothing ended there
    other.close()


# --- the limiter (spec/README.md §7) --------------------------------------------------------------------


class FakeDevice:
    platform, id = "gpu", 0

    @staticmethod
    def memory_stats():
        return {"bytes_in_use": 3 << 30, "bytes_limit": 100 << 30, "peak_bytes_in_use": 4 << 30}


def test_limiter_reads_the_allocator_and_the_running_sequences(monkeypatch):
    engine = FakeEngine()
    engine.max_seqs = 4
    monkeypatch.setattr(device_budget, "_device", lambda: FakeDevice)
    snapshot = EngineStats(max_seqs=4, running=3, waiting=2)
    status = device_budget.limiter_provider(lambda: engine, memory_fraction=0.85, max_seqs=8,
                                            stats=lambda: snapshot)().to_json()
    assert (status["limit"], status["allocated_bytes"], status["limit_bytes"]) == (0.85, 3 << 30, 100 << 30)
    assert (status["sequences_max"], status["sequences_in_use"], status["device"]) == (4, 3, "gpu:0")
    assert "sequences_in_use" not in status["unavailable"]
    # no snapshot yet: the engine's own count of free slots
    status = device_budget.limiter_provider(lambda: engine, memory_fraction=0.85, max_seqs=8,
                                            stats=lambda: None)().to_json()
    assert (status["sequences_max"], status["sequences_in_use"]) == (4, 0)
    monkeypatch.setattr(device_budget, "_device", lambda: None)
    status = device_budget.limiter_provider(lambda: None, memory_fraction=0.75, max_seqs=2,
                                            stats=lambda: snapshot)().to_json()
    assert status["allocated_bytes"] is None and "no JAX device memory" in status["unavailable"]["allocated_bytes"]
    assert (status["sequences_max"], status["sequences_in_use"]) == (2, 0)  # unloaded: a stale snapshot is not read
    assert status["unavailable"]["sequences_in_use"] == "no model is resident"


def test_limiter_counts_the_sequences_the_engine_thread_runs(tmp_path):
    thread = EngineThread()
    engine = FakeEngine(step_s=0.005)
    engine.max_seqs = 2
    thread.call(lambda: thread.set_engine(engine)).result()
    client = EngineClient(thread)
    provider = device_budget.limiter_provider(lambda: thread.engine, memory_fraction=0.75, max_seqs=2,
                                              stats=client.stats)
    seen: set[tuple[int, int]] = set()

    async def three():
        async def one(text):
            async with client.generate(job(text, max_tokens=30)) as generation:
                async for _ in generation:
                    status = provider()
                    seen.add((status.sequences_max, status.sequences_in_use))

        await asyncio.gather(one("LONG a"), one("LONG b"), one("LONG c"))

    try:
        asyncio.run(three())
        assert (2, 2) in seen and max(n for _, n in seen) == 2  # two run at once, the third waits
        assert provider().sequences_in_use == 0
    finally:
        thread.stop()


def test_memory_fraction_goes_to_jax_unless_the_operator_set_it(monkeypatch):
    monkeypatch.delitem(sys.modules, "jax", raising=False)  # as in `bankml serve`, before the engine loads
    env: dict[str, str] = {}
    assert device_budget.apply_memory_fraction(0.85, env) == (0.85, None)
    assert env == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.85"}
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    fraction, note = device_budget.apply_memory_fraction(0.85, env)
    assert fraction == 0.5 and "wins over [engine] memory_fraction 0.85" in note
    with pytest.raises(ConfigInvalid, match="memory_fraction"):
        device_budget.apply_memory_fraction(1.5, {})
