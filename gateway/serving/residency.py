"""Which models are resident, each on its own engine thread; checked before each answer, verified on each load.

A request holds its model with `async with residency.lease(pin) as held:` for its whole answer:
- resident, with the file identity (device, inode, size, mtime) that was verified: reused (load_ns 0);
- resident, but the file changed: dropped at once, no receipt, and the pin is unusable: 503 "<file>
  changed since bankml verified it: unloaded, and refused; the next request verifies it again"
  (ModelUnusable). Until the file verifies again, every answer for that pin is that same 503 (why the
  gate refused goes to the log); a file put back as it was verifies and serves again;
- not resident: a pin not on this machine is a 404, one this engine cannot play a 400 with its reason;
  else room is made (the least recently used models that no answer holds are dropped until fewer than
  `max_loaded` remain and the new one's estimate fits `budget_bytes`; when nothing can go, the request
  waits for a lease to end, as Ollama's scheduler queues), the file is verified (guard, then sha256
  against its FORK.json text: a refusal is a 400 "refuse: ...") and loaded and warmed on a new engine
  thread of its own, so answers from the resident models go on meanwhile. A failed load is a 500
  (EngineFailed). Requests for a pin that is loading share that one load.
Every model has an expiry (`touch`, Ollama's keep_alive): the startup model starts kept forever, a model
loaded for a request the default keep-alive. The reaper (`reap`, once a second) drops expired models no
answer holds; a keep_alive of 0 drops a model as soon as its last lease ends. Dropping stops the
model's engine thread, which lets go of its engine (weights, KV pool).
All bookkeeping runs on the event loop (nothing here awaits between a check and its change; one
asyncio lock makes the loads decide what to evict one at a time, in arrival order); verification runs
on a worker thread, loads on the model's engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from bankml import __version__
from bankml.errors import (
    BankmlError,
    EngineFailed,
    FileChanged,
    InvalidRequest,
    ModelNotFound,
    ModelUnusable,
)
from bankml.serve_files import ChatTemplateFile
from bankml.verify import FileIdentity, GatedModel, Verified, gate_model
from gateway.serving.constraints import prebuild_tokenizer
from gateway.serving.engine_client import EngineClient
from gateway.serving.engine_handle import EngineHandle, EngineLoad, ServedEngine
from gateway.serving.native_model import NativeModel
from gateway.serving.registry import Pin, Registry, model_name

log = logging.getLogger("bankml.gateway")

# Loader: the verified canonical path -> (engine, a few words on the backend). Runs on the model's engine thread.
Loader = Callable[[str], tuple[ServedEngine, str]]
# Estimate: a path -> the bytes its load will hold (weights and KV pool); runs off the loop.
Estimate = Callable[[str], int]

FOREVER = math.inf
REAP_EVERY_S = 1.0
# Go's longest time.Duration (2**63 - 1 ns, about 292 years): a keep_alive longer than that is forever (and
# an expiry that far out would not even be a date /api/ps can write)
LONGEST_S = (2**63 - 1) / 1e9

__all__ = ["Held", "Loaded", "Loader", "PsRecord", "Residency", "model_name"]


@dataclass(frozen=True)
class Loaded:
    """A model behind the gate, as a request holds it."""

    name: str
    file_name: str  # the basename as pinned: /v1/models' id and the answers' "model"
    path: str  # canonical, as hashed
    verified: Verified
    identity: FileIdentity
    hashed_at: int  # unix seconds, when it was loaded
    backend: str  # the receipt's "engine": the inference backend, not the guard's rule set
    model: NativeModel
    compile_s: float
    client: EngineHandle  # this model's own engine, on a thread of its own
    pin: Pin
    size_bytes: int  # memory it holds (weights + KV pool): /api/ps "size"
    vram_bytes: int  # of which on an accelerator (0 on a CPU): /api/ps "size_vram"


@dataclass(frozen=True)
class Held:
    loaded: Loaded
    load_ns: int  # verify + load + warm time this request waited for (0: it was resident)
    reloaded: bool  # the weights were (re)loaded for this request


@dataclass(frozen=True)
class PsRecord:
    loaded: Loaded
    shown_as: str  # the tag recorded by the last request (record_shown), else the pin's tag
    context_length: int  # recorded num_ctx, else --ctx
    expires_at: float | None  # unix seconds; None: kept forever


@dataclass(eq=False)
class _Resident:
    """One model resident or loading: its engine handle, its leases, its expiry."""

    pin: Pin
    client: EngineHandle
    estimate_bytes: int = 0
    loaded: Loaded | None = None
    loading: asyncio.Future | None = None  # set while it loads; what a second request for it awaits
    leases: int = 0
    used_s: float = field(default_factory=time.monotonic)  # the LRU order
    expires_at: float | None = None  # unix seconds; None: forever
    drop_when_idle: bool = False  # a keep_alive 0 while an answer held it
    placed: bool = False  # room was made for it: it counts against max_loaded and the budget
    shown: tuple[str, int] | None = None  # (shown_as, num_ctx) of the last request that recorded one
    dropped: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def bytes(self) -> int:
        return self.loaded.size_bytes if self.loaded is not None else self.estimate_bytes


def _copy(e: BankmlError) -> BankmlError:
    """A fresh copy of a standing error (one raised instance would collect every request's traceback)."""
    return type(e)(e.message, **e.extra)


class Residency:
    def __init__(self, registry: Registry, startup_gated: GatedModel, loader: Loader, *, max_loaded: int = 3,
                 budget_bytes: int = 0, default_keep_alive_s: float = 300.0, ctx: int = 4096,
                 max_waiting: int = 256, estimate: Estimate | None = None,
                 chat_template: ChatTemplateFile | None = None, max_seqs: int = 4):
        """budget_bytes 0: no memory budget (only max_loaded bounds the count). `chat_template`: the
        --chat-template-file, which replaces the startup model's template, and only its: llama-server
        serves one model, and a template is written for one model's special tokens."""
        self.registry = registry
        self.startup_gated = startup_gated
        self.loader = loader
        self.max_loaded = max_loaded
        self.budget_bytes = budget_bytes
        self.default_keep_alive_s = default_keep_alive_s
        self.ctx = ctx
        self.max_waiting = max_waiting
        self.max_seqs = max_seqs  # [engine] max_seqs: each engine thread's sequences (llama-server's n_parallel)
        self.estimate = estimate or os.path.getsize
        self.chat_template = chat_template
        self.last: Loaded | None = None  # the most recent verification, for GET /bankml
        self.unusable: dict[str, BankmlError] = {}  # per pin name: what every answer gets until it verifies
        self._residents: dict[str, _Resident] = {}
        self._change = asyncio.Event()  # set (and replaced) when a lease ends or a model goes
        self._lock: asyncio.Lock | None = None  # orders the loads' room-making
        self._tasks: set[asyncio.Task] = set()
        self._meter: Any = None
        self._reaper: asyncio.Task | None = None
        # a model split across processes (model/distributed.py): the others hold its shares and follow
        # this engine's steps, so it stays loaded whatever a keep_alive says
        self.pinned = False

    # --- what the routes read --------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return self.registry.names()

    @property
    def max_sequences(self) -> int:
        """The most sequences one request may hand an engine at once: an idle engine's sequences plus its
        queue's room (engine_thread.submit_all takes no more), so a bigger request is a 400 at once,
        never a 503 that no retry can cure."""
        return self.max_seqs + self.max_waiting

    @property
    def meter(self) -> Any:
        return self._meter

    @meter.setter
    def meter(self, meter: Any) -> None:
        """The energy meter every engine thread reads (the monitor's); later threads get it too."""
        self._meter = meter
        for resident in self._residents.values():
            resident.client.set_meter(meter)

    def resident(self) -> list[Loaded]:
        """The loaded models, most recently used first (the monitor's threads read it too)."""
        return [loaded for loaded in (s.loaded for s in self._by_recency()) if loaded is not None]

    def most_recent(self) -> Loaded | None:
        r = self.resident()
        return r[0] if r else None

    def threads(self) -> list[EngineHandle]:
        """Every model's engine handle, loading ones included: the monitor sums their `in_flight` counts
        (gateway/monitor/monitoring.py's `Engines` names this method)."""
        return [s.client for s in self._residents.values()]

    def ps(self) -> list[PsRecord]:
        out = []
        for s in self._by_recency():
            if s.loaded is None:
                continue
            shown_as, num_ctx = s.shown or (s.pin.tag, self.ctx)
            out.append(PsRecord(s.loaded, shown_as, num_ctx, s.expires_at))
        return out

    def _by_recency(self) -> list[_Resident]:
        return sorted(self._residents.values(), key=lambda s: s.used_s, reverse=True)

    # --- loading (the model's own engine thread) --------------------------------------------------

    def _new_resident(self, pin: Pin) -> _Resident:
        client = EngineClient.start(f"bankml-engine-{pin.name}"[:60], max_waiting=self.max_waiting)
        client.set_meter(self._meter)
        return _Resident(pin, client)

    def _loaded(self, resident: _Resident, gated: GatedModel, load: EngineLoad) -> Loaded:
        """The model as requests hold it, once its engine is installed and warm (reads the GGUF's header:
        off the loop)."""
        vram = load.memory_bytes if load.on_accelerator else 0
        pin = resident.pin
        template = self.chat_template if pin.name == self.registry.startup.name else None
        loaded = Loaded(pin.name, pin.file_name, gated.path, gated.verified, gated.identity, int(time.time()),
                        f"bankML {__version__} native: its own forward pass ({load.backend})",
                        NativeModel.of(load, gated.path, template), load.compile_s, resident.client, pin,
                        load.memory_bytes, vram)
        prebuild_tokenizer(loaded)  # llguidance's vocabulary, in the background, for constrained requests
        return loaded

    def load_startup(self) -> Loaded:
        """Load and warm the startup model, kept forever; blocks (before the event loop runs). Raises what
        the load raises (its engine thread stopped)."""
        pin = self.registry.startup
        resident = self._new_resident(pin)
        try:
            resident.estimate_bytes = self.estimate(self.startup_gated.path)
            load = resident.client.load_blocking(partial(self.loader, self.startup_gated.path))
            loaded = self._loaded(resident, self.startup_gated, load)
        except BaseException:
            resident.client.stop()
            raise
        resident.loaded = self.last = loaded
        resident.placed = True
        self._residents[pin.name] = resident
        return loaded

    def compile_rest(self, loaded: Loaded) -> None:
        """The rest of a model's programs, in the background (the load warmed what a first answer needs)."""
        loaded.client.compile_rest()

    # --- per request -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lease(self, pin: Pin) -> AsyncIterator[Held]:
        """The pin's model, resident and checked, held for one answer (see the module doc)."""
        resident, load_ns, reloaded = await self._acquire(pin)
        try:
            yield Held(resident.loaded, load_ns, reloaded)
        finally:
            self._release(resident)

    async def current(self) -> Loaded:
        """llama-server's routes: the most recently used resident model, or the startup model acquired
        (and kept forever)."""
        loaded = self.most_recent()
        if loaded is not None:
            return loaded
        startup = self.registry.startup
        async with self.lease(startup) as held:
            self.touch(startup.name, FOREVER)
            return held.loaded

    async def _acquire(self, pin: Pin) -> tuple[_Resident, int, bool]:
        """The resident with one more lease on it, loaded; (resident, load_ns, reloaded)."""
        while True:
            resident = self._residents.get(pin.name)
            if resident is not None and resident.loaded is not None:
                self._check_identity(resident)
                resident.leases += 1
                resident.used_s = time.monotonic()
                return resident, 0, False
            if resident is None:
                if pin.path is None:
                    raise ModelNotFound(f"{pin.file_name} is pinned but not on this machine")
                if not pin.native:
                    raise InvalidRequest(pin.reason or f"{pin.file_name} cannot be played by this engine")
                resident = self._new_resident(pin)
                self._residents[pin.name] = resident  # a second request for it shares this load
                resident.loading = asyncio.get_running_loop().create_task(self._load(resident))
                resident.loading.add_done_callback(_retrieved)
            t0 = time.perf_counter_ns()
            resident.leases += 1  # held from now: a load that ends before this request resumes is not idle
            try:
                await asyncio.shield(resident.loading)
            except BankmlError as e:
                resident.leases -= 1
                raise _copy(e) from None
            except BaseException:
                self._release(resident)
                raise
            if resident.loaded is not None and self._residents.get(pin.name) is resident:
                resident.used_s = time.monotonic()
                return resident, time.perf_counter_ns() - t0, True
            resident.leases -= 1  # it went again before this request got it: look again

    def _release(self, resident: _Resident) -> None:
        resident.leases -= 1
        resident.used_s = time.monotonic()
        if resident.leases == 0 and resident.drop_when_idle:
            self._drop_soon(resident, "keep_alive 0")
        self._notify()

    def _check_identity(self, resident: _Resident) -> None:
        r = resident.loaded
        try:
            now = FileIdentity.of(r.path)
        except OSError:
            now = None
        if now == r.identity:
            return
        log.warning("%s changed since it was verified: unloaded", r.path)
        self._forget(resident)
        self._spawn(self._stop(resident))
        self.unusable[r.name] = ModelUnusable(f"{r.file_name} changed since bankml verified it: unloaded, and "
                                              "refused; the next request verifies it again")
        raise _copy(self.unusable[r.name])

    async def _load(self, resident: _Resident) -> None:
        """Make room, verify, load and warm `resident`'s pin (a task of its own: a requester that goes away
        does not cancel a load others wait for)."""
        pin = resident.pin
        try:
            try:
                resident.estimate_bytes = await asyncio.to_thread(self.estimate, pin.path)
            except Exception:  # the header says nothing usable (verifying will say why): the file's size
                resident.estimate_bytes = pin.size
            async with self._room_lock():  # one load at a time decides what goes, in arrival order
                await self._make_room(resident)
                resident.placed = True
            gated = await self._verify(pin)
            log.info("%s verified (sha256 %s); loading it", gated.path, gated.verified.model_sha256)
            try:
                load = await resident.client.load(partial(self.loader, gated.path))
                loaded = await asyncio.to_thread(self._loaded, resident, gated, load)
            except Exception as e:
                self.unusable[pin.name] = EngineFailed(f"cannot load {gated.path}: {e}")
                raise _copy(self.unusable[pin.name]) from None
        except BaseException:
            self._forget(resident)
            await self._stop(resident)
            raise
        finally:
            resident.loading = None
        resident.loaded = self.last = loaded
        resident.used_s = time.monotonic()
        resident.expires_at = self._expiry(self.default_keep_alive_s)
        self.unusable.pop(pin.name, None)
        self._notify()  # idle now if its requesters went away meanwhile: a load waiting for room may drop it
        self.compile_rest(loaded)
        log.info("%s loaded (%.0f MiB; resident: %s)", pin.file_name, loaded.size_bytes / 2**20,
                 ", ".join(r.name for r in self.resident()))

    async def _verify(self, pin: Pin) -> GatedModel:
        startup = self.startup_gated
        given = (startup.given or startup.path) if pin is self.registry.startup else pin.path
        try:
            return await asyncio.to_thread(gate_model, given, pin.fork_text, startup.verified.rule_set,
                                           pin.fork_path)
        except BankmlError as e:  # Unreadable, Refused, FileChanged: not the verified file
            log.warning("%s does not verify: %s", given, e)
            standing = self.unusable.get(pin.name)
            if standing is not None:
                raise _copy(standing) from None
            if isinstance(e, FileChanged):
                raise
            raise InvalidRequest(f"refuse: {e}") from None

    async def _make_room(self, resident: _Resident) -> None:
        """Drop least recently used idle models until `resident` fits (count and bytes); wait while none can go."""
        while True:
            others = [s for s in self._residents.values() if s is not resident and s.placed]
            used = sum(s.bytes for s in others)
            over_count = len(others) >= self.max_loaded
            over_bytes = self.budget_bytes > 0 and used + resident.estimate_bytes > self.budget_bytes
            if not others or not (over_count or over_bytes):
                return
            idle = [s for s in others if s.loaded is not None and s.leases == 0]
            if idle:
                victim = min(idle, key=lambda s: s.used_s)
                await self._drop(victim, "to make room for " + resident.pin.file_name)
                continue
            await self._wait_for_change()

    # --- keep-alive and dropping -----------------------------------------------------------------

    def touch(self, name: str, keep_alive_s: float) -> None:
        """Only if `name` is resident: 0 drops it (now, or once no answer holds it), inf keeps it
        forever, anything else expires it keep_alive_s from now."""
        resident = self._residents.get(name)
        if resident is None or resident.loaded is None:
            return
        if self.pinned:
            return
        if keep_alive_s <= 0:
            if resident.leases == 0:
                self._drop_soon(resident, "keep_alive 0")
            else:
                resident.drop_when_idle = True
            return
        if resident.drop_when_idle:
            resident.drop_when_idle = False
            self._notify()  # an unload waiting for it to go: it stays
        resident.expires_at = self._expiry(keep_alive_s)

    @staticmethod
    def _expiry(keep_alive_s: float) -> float | None:
        return None if keep_alive_s >= LONGEST_S else time.time() + keep_alive_s

    def record_shown(self, name: str, shown_as: str, num_ctx: int, reloaded: bool) -> None:
        """What /api/ps shows for a resident model: changed only when its weights were (re)loaded for the
        request, nothing is recorded yet, or num_ctx differs (spec §1.5)."""
        resident = self._residents.get(name)
        if resident is None or resident.loaded is None:
            return
        if reloaded or resident.shown is None or resident.shown[1] != num_ctx:
            resident.shown = (shown_as, num_ctx)

    async def unload(self, name: str) -> bool:
        """Drop a resident pin now, after the answers that hold it; False: it is not resident."""
        resident = self._residents.get(name)
        if resident is None or resident.loaded is None:
            return False
        if self.pinned:
            log.info("%s stays loaded: it is split across processes, which follow its engine",
                     resident.pin.file_name)
            return True
        if resident.leases == 0:
            await self._drop(resident, "unloaded")
        else:
            resident.drop_when_idle = True
            # until it goes, or a later request's keep_alive keeps it (touch clears the flag): not forever
            while resident.drop_when_idle and not resident.dropped.is_set():
                await self._wait_for_change()
        return True

    async def reap(self) -> None:
        """Drop every expired model that no answer holds (the reaper's one round)."""
        now = time.time()
        for resident in [] if self.pinned else list(self._residents.values()):
            expired = resident.expires_at is not None and resident.expires_at <= now
            if resident.loaded is not None and resident.leases == 0 and (expired or resident.drop_when_idle):
                await self._drop(resident, "its keep_alive expired")

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(REAP_EVERY_S)
            try:
                await self.reap()
            except Exception:  # one bad round never ends the reaper
                log.exception("the reaper failed")

    def start_reaper(self) -> None:
        """Start the reaper on the running loop (the server's start)."""
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    def stop_reaper(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None

    async def close(self) -> None:
        """Stop the reaper and every engine thread."""
        self.stop_reaper()
        for resident in list(self._residents.values()):
            self._forget(resident)
            await self._stop(resident)

    def stop_all(self) -> None:
        """Stop every engine thread, blocking (after the loop has ended)."""
        for resident in list(self._residents.values()):
            self._forget(resident)
            resident.client.stop()

    async def _drop(self, resident: _Resident, why: str) -> None:
        if self._residents.get(resident.pin.name) is not resident:
            return
        log.info("%s unloaded: %s", resident.pin.file_name, why)
        self._forget(resident)
        await self._stop(resident)

    def _drop_soon(self, resident: _Resident, why: str) -> None:
        """Gone from the resident models now (/api/ps says so at once); its thread stops in the background."""
        if self._residents.get(resident.pin.name) is resident:
            log.info("%s unloaded: %s", resident.pin.file_name, why)
            self._forget(resident)
            self._spawn(self._stop(resident))

    def _forget(self, resident: _Resident) -> None:
        if self._residents.get(resident.pin.name) is resident:
            del self._residents[resident.pin.name]
        resident.loaded = None
        resident.dropped.set()
        self._notify()

    async def _stop(self, resident: _Resident) -> None:
        """End the resident's engine thread (after its running iteration), which drops its engine. Answers it
        still runs (only a changed file drops a held model) end with "the model was unloaded while it
        answered"."""
        await resident.client.unload()
        self._notify()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- waiting for room ---------------------------------------------------------------------------

    def _room_lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def _notify(self) -> None:
        """A lease ended or a model went: wake whoever waits for room."""
        self._change.set()
        self._change = asyncio.Event()

    async def _wait_for_change(self) -> None:
        await self._change.wait()


def _retrieved(task: asyncio.Task) -> None:
    """A load's failure is raised to each request that waited for it; none left: nothing to log."""
    if not task.cancelled():
        task.exception()

