"""Residency: many models resident, each on its own engine thread; LRU eviction under max_loaded and a
memory budget; leases that keep a model from going; shared loads; keep-alive and the reaper; the file
checked before each answer. Over the fake engine (real registry, real gate), fast."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import threading
import time
import weakref
from pathlib import Path

import httpx
import pytest
from fake_engine import REPLY, fake_estimate, fake_loader
from gateway_helpers import FakeServer, connect, registry_dir, request_bytes, status_of, tiny_model

from bankml.errors import EngineFailed, InvalidRequest, ModelNotFound, ModelUnusable
from bankml.pin import fork_record
from bankml.verify import gate_model
from gateway.serving.registry import Registry
from gateway.serving.residency import FOREVER, Residency
from model.messages import GenerateRequest, SamplingParams

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
STARTUP = "tiny-model.q8_0"
A, B, C = "model-a.q8_0", "model-b.q8_0", "model-c.q8_0"


class World:
    """A startup model, a registry directory of pins, and a Residency over the fake engine."""

    def __init__(self, tmp_path: Path, names=("Model-A.Q8_0.gguf", "Model-B.Q8_0.gguf", "Model-C.Q8_0.gguf"),
                 *, max_loaded: int = 3, budget_bytes: int = 0, keep_alive_s: float = 300.0,
                 load_s: dict | None = None, sizes: dict | None = None, fail: tuple[str, ...] = ()):
        self.startup_file, fork = tiny_model(tmp_path / "startup")
        self.dir = registry_dir(tmp_path / "reg", list(names))
        self.gated = gate_model(str(self.startup_file), fork.read_text())
        self.registry = Registry(self.gated, str(self.dir))
        self.loads: list[str] = []
        self.engines: dict[str, list[weakref.ref]] = {}
        base = fake_loader(step_s=0.002, load_s=load_s, size_bytes=sizes)

        def loader(path: str):
            name = os.path.basename(path).lower().removesuffix(".gguf")
            self.loads.append(name)
            if name in fail:
                raise RuntimeError("the fake engine cannot load this")
            engine, backend = base(path)
            self.engines.setdefault(name, []).append(weakref.ref(engine))
            return engine, backend

        self.res = Residency(self.registry, self.gated, loader, max_loaded=max_loaded, budget_bytes=budget_bytes,
                             default_keep_alive_s=keep_alive_s, estimate=fake_estimate(sizes))
        self.res.load_startup()

    def pin(self, name: str):
        return self.registry.pin(name)

    async def use(self, name: str):
        """One answer's lease: load if needed, hold, let go."""
        async with self.res.lease(self.pin(name)) as held:
            return held

    def resident(self) -> list[str]:
        return [r.name for r in self.res.resident()]


@pytest.fixture
def world_of(tmp_path):
    made: list[World] = []

    def make(**kw) -> World:
        w = World(tmp_path, **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.res.stop_all()


async def answer(loaded, prompt: str = "hi") -> tuple[str, list[float]]:
    """One generation on the model's own engine thread: its text and when each piece came."""
    pieces, at = [], []
    request = GenerateRequest(list(prompt.encode()), SamplingParams(max_tokens=-1), request_id=prompt)
    async with loaded.client.generate(request) as generation:
        async for out in generation:
            pieces.append(out.text)
            at.append(time.monotonic())
    return "".join(pieces), at


def test_each_model_has_its_own_engine_thread_and_answers(world_of):
    w = world_of()

    async def run():
        a = await w.use(A)
        assert a.reloaded and a.load_ns > 0 and a.loaded.name == A and a.loaded.file_name == "Model-A.Q8_0.gguf"
        again = await w.use(A)
        assert not again.reloaded and again.load_ns == 0 and again.loaded is a.loaded
        assert w.res.most_recent().name == A  # the most recently used
        s = (await w.use(STARTUP)).loaded
        assert s.client.thread is not a.loaded.client.thread
        text_a, _ = await answer(a.loaded)
        text_s, _ = await answer(s)
        assert text_a == text_s == REPLY
        assert a.loaded.size_bytes == MiB and a.loaded.vram_bytes == 0  # the fake engine: 1 MiB on a CPU

    asyncio.run(run())
    assert w.loads == [STARTUP, A]


def test_the_least_recently_used_idle_model_goes_first_and_max_loaded_holds(world_of):
    w = world_of(max_loaded=2)

    async def run():
        await w.use(A)
        assert w.resident() == [A, STARTUP]
        await w.use(B)  # the startup model is the least recently used: it goes
        assert w.resident() == [B, A]
        await w.use(A)  # A is now the most recent; B goes for C
        await w.use(C)
        assert w.resident() == [C, A]
        await w.use(STARTUP)
        assert w.resident() == [STARTUP, C]

    asyncio.run(run())
    assert w.loads == [STARTUP, A, B, C, STARTUP]


def test_the_memory_budget_evicts_until_the_estimate_fits(world_of):
    sizes = {STARTUP: 1 * MiB, A: 1 * MiB, B: 1 * MiB, C: 3 * MiB}
    w = world_of(max_loaded=10, budget_bytes=4 * MiB, sizes=sizes)

    async def run():
        await w.use(A)
        await w.use(B)
        assert w.resident() == [B, A, STARTUP]  # 3 MiB of 4
        await w.use(C)  # 3 MiB more: the two least recently used go (STARTUP, then A)
        assert w.resident() == [C, B]
        assert sum(r.size_bytes for r in w.res.resident()) <= 4 * MiB

    asyncio.run(run())


def test_a_model_an_answer_holds_is_never_evicted_the_load_waits_for_it(world_of):
    w = world_of(max_loaded=1)

    async def run():
        async with w.res.lease(w.pin(STARTUP)):
            waiting = asyncio.create_task(w.use(A))
            await asyncio.sleep(0.5)
            assert not waiting.done() and w.resident() == [STARTUP]  # queued, as Ollama's scheduler queues
            assert w.loads == [STARTUP]
        held = await asyncio.wait_for(waiting, 10)
        assert held.loaded.name == A and w.resident() == [A]

    asyncio.run(run())


def test_two_requests_for_an_absent_model_share_one_load(world_of):
    w = world_of(load_s={A: 0.5})

    async def run():
        one, two = await asyncio.gather(w.use(A), w.use(A))
        assert one.loaded is two.loaded and one.reloaded and two.reloaded

    asyncio.run(run())
    assert w.loads.count(A) == 1


def test_a_load_whose_requesters_went_away_lets_a_waiting_load_drop_it(world_of):
    # max_loaded 1: B's load makes room (the startup model goes); its only requester is cancelled while
    # it loads; C's load waits for room. B's load ending with no lease on it used to wake nobody: C
    # waited until B's keep-alive expired (5 minutes)
    w = world_of(max_loaded=1, load_s={B: 0.4})

    async def run():
        wanting_b = asyncio.create_task(w.use(B))
        await asyncio.sleep(0.1)
        wanting_b.cancel()
        held = await asyncio.wait_for(w.use(C), 5)
        assert held.loaded.name == C and w.resident() == [C]

    asyncio.run(run())


def test_a_load_does_not_stall_another_models_answers(world_of):
    w = world_of(load_s={A: 1.5})

    async def run():
        startup = w.res.most_recent()
        t0 = time.monotonic()
        loading = asyncio.create_task(w.use(A))
        await asyncio.sleep(0.1)
        texts = []
        for _ in range(3):  # answered one after the other while A loads on its own thread
            text, at = await answer(startup)
            texts.append(text)
        done_answering = time.monotonic() - t0
        assert not loading.done()
        assert texts == [REPLY] * 3 and done_answering < 1.2
        held = await loading
        assert held.loaded.name == A and time.monotonic() - t0 >= 1.5

    asyncio.run(run())


def test_keep_alive_expiry_drops_the_model_and_frees_its_engine(world_of):
    w = world_of(keep_alive_s=0.2)

    async def run():
        await w.use(A)  # loaded with the default keep-alive
        assert w.resident() == [A, STARTUP]
        await asyncio.sleep(0.3)
        await w.res.reap()
        assert w.resident() == [STARTUP]  # the startup model is kept forever
        await asyncio.sleep(0.2)  # its engine thread ends

    asyncio.run(run())
    gc.collect()
    assert [ref() for ref in w.engines[A]] == [None]  # the engine (weights, pool) is unreachable


def test_the_reaper_runs_by_itself_and_skips_a_leased_model(world_of):
    w = world_of()

    async def run():
        w.res.start_reaper()
        async with w.res.lease(w.pin(A)):
            w.res.touch(A, 0.1)
            await asyncio.sleep(1.5)  # expired, and the reaper has been round: held, so it stays
            assert A in w.resident()
        await asyncio.sleep(1.5)
        assert w.resident() == [STARTUP]
        await w.res.close()

    asyncio.run(run())


def test_touch_sets_expiry_forever_or_unloads(world_of):
    w = world_of()

    async def run():
        await w.use(A)
        w.res.touch(A, 60)
        (rec_a,) = [r for r in w.res.ps() if r.loaded.name == A]
        assert rec_a.expires_at == pytest.approx(time.time() + 60, abs=2)
        w.res.touch(A, FOREVER)
        assert [r.expires_at for r in w.res.ps() if r.loaded.name == A] == [None]
        w.res.touch(B, 0)  # not resident: nothing happens, nothing loads
        w.res.touch(A, 0)
        await asyncio.sleep(0.1)
        assert w.resident() == [STARTUP] and B not in w.loads

    asyncio.run(run())


def test_a_keep_alive_past_gos_longest_duration_is_forever_and_ps_still_answers(world_of):
    # keep_alive 1e17 (or "1e17", or "99999999999h") once stored an expiry no date can write:
    # every /api/ps was a 500 while the model stayed resident
    from gateway.ollama.models import ps_entry

    w = world_of()

    async def run():
        await w.use(A)
        for long_s in (1e17, 1e300, 10.0**10):
            w.res.touch(A, long_s)
            (rec,) = [r for r in w.res.ps() if r.loaded.name == A]
            assert rec.expires_at is None, long_s
            assert ps_entry(w.registry, rec, time.time())["expires_at"][:2] == "23"  # now + 292 years
        w.res.touch(A, 9e9)  # just under 292 years: a real expiry
        (rec,) = [r for r in w.res.ps() if r.loaded.name == A]
        assert rec.expires_at == pytest.approx(time.time() + 9e9, abs=2)

    asyncio.run(run())


def test_touch_0_while_an_answer_holds_the_model_unloads_it_once_idle(world_of):
    w = world_of()

    async def run():
        async with w.res.lease(w.pin(A)) as held:
            w.res.touch(A, 0)
            text, _ = await answer(held.loaded)  # the answer goes on
            assert text == REPLY and A in w.resident()
        await asyncio.sleep(0.1)
        assert w.resident() == [STARTUP]

    asyncio.run(run())


def test_unload_waits_for_the_answers_in_flight(world_of):
    w = world_of()

    async def run():
        assert not await w.res.unload(A)  # not resident
        held_cm = w.res.lease(w.pin(A))
        held = await held_cm.__aenter__()
        unloading = asyncio.create_task(w.res.unload(A))
        await asyncio.sleep(0.2)
        assert not unloading.done() and A in w.resident()
        assert (await answer(held.loaded))[0] == REPLY
        await held_cm.__aexit__(None, None, None)
        assert await asyncio.wait_for(unloading, 5)
        assert w.resident() == [STARTUP]

    asyncio.run(run())


def test_an_unload_waiting_for_an_answer_ends_when_a_later_request_keeps_the_model(world_of):
    # /api/generate {"keep_alive": 0} while A streams waits for the answer; a later request for A with
    # keep_alive 5m cleared the drop, and the unload then waited until A expired (or forever, keep_alive -1)
    w = world_of()

    async def run():
        await w.use(A)
        async with w.res.lease(w.pin(A)):
            unloading = asyncio.create_task(w.res.unload(A))
            await asyncio.sleep(0.05)
            await w.use(A)  # a later answer, then its keep_alive
            assert not unloading.done()  # the first answer still holds A
            w.res.touch(A, FOREVER)
            assert await asyncio.wait_for(unloading, 5) is True  # nothing will drop A now: it ends
        assert A in w.resident()  # the later keep_alive won, as in Ollama

    asyncio.run(run())


def test_a_changed_file_is_a_503_then_verified_again(world_of):
    w = world_of()
    path = w.dir / "Model-A.Q8_0.gguf"

    async def run():
        first = (await w.use(A)).loaded
        os.utime(path, (time.time() + 5, time.time() + 5))  # same bytes, another mtime
        with pytest.raises(ModelUnusable) as e:
            await w.use(A)
        assert e.value.message == ("Model-A.Q8_0.gguf changed since bankml verified it: unloaded, and refused; "
                                   "the next request verifies it again")
        assert A not in w.resident()
        again = await w.use(A)  # the same bytes: it verifies, and loads again
        assert again.reloaded and again.loaded is not first and A in w.resident()
        # now the bytes change: the standing 503 until it verifies
        data = path.read_bytes()
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
        for _ in range(2):
            with pytest.raises(ModelUnusable):
                await w.use(A)
        path.write_bytes(data)  # put back as it was
        assert (await w.use(A)).reloaded

    asyncio.run(run())
    assert w.loads.count(A) == 3


def test_what_cannot_load_is_refused_with_its_reason(world_of, tmp_path):
    w = world_of(fail=(B,))
    # a pin whose file is not here, one the guard refuses, one whose bytes are not the pinned ones
    gone, gone_fork = tiny_model(tmp_path / "elsewhere", "Gone.Q8_0.gguf")
    (w.dir / gone_fork.name).write_text(gone_fork.read_text())
    gone.unlink()
    junk = w.dir / "Junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    (w.dir / "Junk.gguf.FORK.json").write_text(json.dumps(fork_record(junk)))
    data = (w.dir / "Model-C.Q8_0.gguf").read_bytes()
    w.registry = w.res.registry = Registry(w.gated, str(w.dir))
    (w.dir / "Model-C.Q8_0.gguf").write_bytes(data + b"\0")

    async def run():
        with pytest.raises(ModelNotFound, match=r"^Gone.Q8_0.gguf is pinned but not on this machine$"):
            await w.use("gone.q8_0")
        with pytest.raises(InvalidRequest, match="guard refused"):
            await w.use("junk")
        with pytest.raises(InvalidRequest, match=r"^refuse: Model-C.Q8_0.gguf sha256 .* != pinned"):
            await w.use(C)
        with pytest.raises(EngineFailed, match="cannot load .*Model-B.Q8_0.gguf: the fake engine cannot load this"):
            await w.use(B)
        assert w.resident() == [STARTUP]
        assert w.res.unusable[B].message.startswith("cannot load")

    asyncio.run(run())
    assert "gone.q8_0" not in w.loads and "junk" not in w.loads and C not in w.loads


def test_ps_lists_resident_models_most_recent_first_with_what_was_shown(world_of):
    w = world_of()

    async def run():
        await w.use(A)
        w.res.record_shown(A, "persona:latest", 2048, reloaded=True)
        w.res.record_shown(A, "model-a.q8_0:latest", 2048, reloaded=False)  # same weights, same ctx: kept
        records = w.res.ps()
        assert [r.loaded.name for r in records] == [A, STARTUP]
        assert (records[0].shown_as, records[0].context_length) == ("persona:latest", 2048)
        assert (records[1].shown_as, records[1].context_length, records[1].expires_at) == (
            "tiny-model.q8_0:latest", 4096, None)
        w.res.record_shown(A, "model-a.q8_0:latest", 1024, reloaded=False)  # num_ctx differs: changed
        assert w.res.ps()[0].shown_as == "model-a.q8_0:latest"
        assert (await w.res.current()).name == A
        assert w.res.last.name == A  # the most recent verification

    asyncio.run(run())


def test_the_server_serves_several_models_and_a_load_does_not_stall_the_others(tmp_path):
    model, fork = tiny_model(tmp_path / "startup")
    reg = registry_dir(tmp_path / "reg", ["Model-A.Q8_0.gguf"])
    server = FakeServer(model, fork, registry=reg, max_loaded=2, load_s={A: 3.0})
    try:
        def chat(name: str | None) -> httpx.Response:
            return httpx.post(server.url("/v1/chat/completions"), timeout=30,
                              json={"model": name, "messages": [{"role": "user", "content": "hi"}]})

        with httpx.Client(timeout=30) as c:
            models = c.get(server.url("/v1/models")).json()["data"]
        assert [m["id"] for m in models] == ["Tiny-Model.Q8_0.gguf", "Model-A.Q8_0.gguf"]
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            t0 = time.monotonic()
            slow = pool.submit(chat, "model-a.q8_0")
            assert server.wait_for_log("fake-engine: loading model-a.q8_0", 10)
            fast = chat(None)
            fast_s = time.monotonic() - t0
            assert fast.status_code == 200 and fast.json()["model"] == "Tiny-Model.Q8_0.gguf"
            assert fast_s < 2.5 and not slow.done()  # answered while A loads
            r = slow.result()
        assert r.status_code == 200 and r.json()["model"] == "Model-A.Q8_0.gguf"
        assert r.json()["choices"][0]["message"]["content"] == REPLY
        info = httpx.get(server.url("/bankml")).json()
        assert info["models"] == [STARTUP, A] and info["loaded"] == [A, STARTUP] and info["resident"] == A
        assert httpx.get(server.url("/health")).status_code == 200
    finally:
        server.stop()


def test_with_several_pins_each_engine_gets_whole_contexts_and_says_what_it_holds(tmp_path):
    # the real engine over a tiny GGUF: its pool is max_seqs whole contexts, not most of the device
    from bankml.config import EngineConfig
    from gateway.app import native_estimate
    from model.loading import load_engine, whole_contexts_bytes

    model, _ = tiny_model(tmp_path)
    engine, _ = load_engine(str(model), n_ctx=256, max_seqs=2, prefill_chunk=64, compile_cache_dir=None,
                            whole_contexts=True)
    pool = whole_contexts_bytes(str(model), n_ctx=256, max_seqs=2)
    assert engine.pool.k.nbytes + engine.pool.v.nbytes == pool > 0
    assert engine.memory_bytes() == engine.weights_report()["device_bytes"] + pool
    estimate = native_estimate(256, EngineConfig(max_seqs=2))(str(model))
    assert estimate == os.path.getsize(model) + pool


def test_a_file_changed_under_an_answer_ends_that_answer_with_why(world_of):
    w = world_of()
    path = w.dir / "Model-A.Q8_0.gguf"

    async def run():
        async with w.res.lease(w.pin(A)) as held:
            request = GenerateRequest(list(b"LONG"), SamplingParams(max_tokens=-1), request_id="long")
            outs = []
            async with held.loaded.client.generate(request) as generation:
                async for out in generation:
                    outs.append(out)
                    if len(outs) == 1:
                        os.utime(path, (time.time() + 5, time.time() + 5))
                        with pytest.raises(ModelUnusable):  # the next request sees the change
                            await w.use(A)
        assert len(outs) < 100 and outs[-1].error == "the model was unloaded while it answered"

    asyncio.run(run())


def test_a_real_engine_dropped_by_the_residency_is_freed(tmp_path):
    """The real engine over a tiny GGUF: once its model is dropped nothing the residency keeps (Loaded,
    its NativeModel, the stopped engine thread, /bankml's `last`) holds the engine, its weights or pool."""
    from bankml.config import EngineConfig
    from gateway.app import native_estimate, native_loader

    engine_cfg = EngineConfig(max_seqs=1, compile_cache_dir="")
    model, fork = tiny_model(tmp_path / "startup")
    reg = registry_dir(tmp_path / "reg", ["Model-A.Q8_0.gguf"])
    gated = gate_model(str(model), fork.read_text())
    registry = Registry(gated, str(reg))
    res = Residency(registry, gated, native_loader(256, engine_cfg, whole_contexts=True), ctx=256,
                    estimate=native_estimate(256, engine_cfg))
    res.load_startup()
    try:
        async def run():
            async with res.lease(registry.pin(A)) as held:
                engine = held.loaded.client.thread.engine
                assert held.loaded.size_bytes == engine.memory_bytes() > 0
                text, _ = await answer(held.loaded)
                freed = weakref.ref(engine)
                del engine
            assert await res.unload(A)
            return freed, text

        freed, text = asyncio.run(run())
        for t in threading.enumerate():  # a background compile holds the engine until its program is done
            if t.name == "bankml-compile":
                t.join(120)
        gc.collect()
        assert freed() is None and isinstance(text, str)
        assert res.last.name == A and [r.name for r in res.resident()] == [STARTUP]
    finally:
        res.stop_all()


def test_the_monitor_counts_the_answers_running_on_every_resident_model(tmp_path):
    model, fork = tiny_model(tmp_path / "startup")
    reg = registry_dir(tmp_path / "reg", ["Model-A.Q8_0.gguf"])
    server = FakeServer(model, fork, registry=reg, step_ms=20)
    streams = []
    try:
        for name in (STARTUP, A):  # one LONG stream on each model's own engine (one sequence each)
            s = connect(server.port, timeout_s=20)
            body = json.dumps({"model": name, "stream": True, "messages": [{"role": "user", "content": "LONG"}]})
            s.sendall(request_bytes("POST", "/v1/chat/completions", body=body.encode()))
            assert status_of(s.recv(65536)) == 200
            streams.append(s)
        serve = httpx.get(server.url("/bankml/status"), timeout=10).json()["serve"]
        assert (serve["requests_running"], serve["requests_waiting"]) == (2, 0)
        prom = httpx.get(server.url("/metrics"), timeout=10).text
        assert "bankml_requests_running 2" in prom
    finally:
        for s in streams:
            s.close()
        server.stop()
