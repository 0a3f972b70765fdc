"""The engine's compiled programs: every shape of its table (model/programs.py), compiled once.

`get(kind, t, window)` hands the step runner (model/runner.py) the program for a key, compiling it on
first use; `warmup` compiles the whole table, or only what first short requests need, and
`compile_in_background` the rest on a daemon thread while the engine serves. A program needed before
the background got to it is compiled on demand, once: whichever thread began it, the others wait for
that program only, never for the others.

Programs are traced and lowered from shapes alone (`Specs`), never from the live arrays, which the
engine thread donates and replaces while a background compile runs.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from bankml.progress import stderr_progress
from model.config import Config
from model.kvcache import KVPool
from model.programs import Key, ProgramTable
from model.sampler_chain import ChainArrays, chain_arrays
from model.steps import decode as decode_step
from model.steps import put_row, run, select, select_drafted, verify
from model.weights import Weights

log = logging.getLogger(__name__)

# One program is traced and lowered at a time (XLA's compile, the long part, still runs on many threads):
# lowering holds the GIL anyway, and on a GPU it compiles the Triton kernels, whose parse of their
# source breaks when several threads run it at once on CPython < 3.11.8 / 3.12.2 (gh-106905: "AST
# constructor recursion depth mismatch"). model/embed.py lowers under it too.
LOWERING = threading.Lock()


@dataclass(frozen=True)
class Specs:
    """The shapes, dtypes and placements of the runner's arrays: what lowering a program needs."""

    weights: Weights
    pool: KVPool
    history: jax.ShapeDtypeStruct
    sa: ChainArrays

    @classmethod
    def of(cls, weights: Weights, pool: KVPool, history: jax.Array) -> Specs:
        def spec(a):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None),
                                        weak_type=getattr(a, "weak_type", False))

        return cls(*(jax.tree.map(spec, x) for x in (weights, pool, history, _idle_arrays())))


class ProgramCache:
    """The compiled programs of one engine, by key (kind, padded length, window): `ready` holds those
    compiled so far, `compile_s` the seconds their compiles took."""

    def __init__(self, table: ProgramTable, config: Config, specs: Specs, *, branchless: bool):
        self.table = table
        self.config = config
        self.specs = specs  # shapes only: a compile on another thread never reads device buffers
        self.max_pages = -(-table.n_ctx // table.page_size)
        # the sampler without data-dependent branches: on a GPU each `lax.cond` is a device->host sync,
        # on a CPU skipping the sorts no row needs is worth it
        self.branchless = branchless
        self.ready: dict[Key, object] = {}
        self.compile_s = 0.0
        self._compiling: dict[Key, Future] = {}  # programs being compiled, by whichever thread began
        self._lock = threading.Lock()
        self._stop_background = threading.Event()
        self._soon: list[Key] = []  # `compile_soon`'s queue, and whether its thread is running
        self._soon_running = False

    def get(self, kind: str, t: int, window: int):
        """The compiled program for (kind, padded length, window), compiled on first use.

        kinds: "prefill" (t tokens of one slot), "decode" (one token per slot), "select" (sampling for
        t rows, `window` of them with DRY), "row" (a prompt into the token history), "verify{T}" and
        "vselect{T}" (speculation's: t rows of T tokens, and their sampler). Safe from any
        thread: a program another thread is compiling is waited for, never compiled twice.
        """
        key = (kind, t, window)
        program = self.ready.get(key)
        if program is not None:
            return program
        with self._lock:
            if key in self.ready:
                return self.ready[key]
            future = self._compiling.get(key)
            mine = future is None
            if mine:
                future = self._compiling[key] = Future()
        if not mine:
            return future.result()
        try:
            t0 = time.perf_counter()
            with LOWERING:
                lowered = self.lower(kind, t, window)
            program = lowered.compile()
            spent = time.perf_counter() - t0
        except BaseException as e:
            with self._lock:
                del self._compiling[key]  # a later call tries again
            future.set_exception(e)
            raise
        with self._lock:
            self.ready[key] = program
            del self._compiling[key]
            self.compile_s += spent
        future.set_result(program)
        return program

    def lower(self, kind: str, t: int, window: int):
        """Trace and lower one program from `specs`. For "prefill" t is the chunk's bucket, for
        "decode" and "select" the batch's; `window` is in pages."""
        sp, i32 = self.specs, jnp.int32
        if kind == "prefill":
            args = (jax.ShapeDtypeStruct((1, t), i32), jax.ShapeDtypeStruct((1, self.max_pages), i32),
                    jax.ShapeDtypeStruct((1,), i32), jax.ShapeDtypeStruct((1,), i32))
            return run.lower(sp.weights, sp.pool, *args, config=self.config, window_pages=window)
        if kind == "decode":
            vec = jax.ShapeDtypeStruct((t,), i32)
            args = (sp.history, vec, jax.ShapeDtypeStruct((t, self.max_pages), i32), vec, vec)
            return decode_step.lower(sp.weights, sp.pool, *args, config=self.config, window_pages=window)
        if kind == "row":
            return put_row.lower(sp.history, jax.ShapeDtypeStruct((), i32),
                                 jax.ShapeDtypeStruct((self.table.n_ctx,), i32))
        vec = jax.ShapeDtypeStruct((t,), i32)
        if kind.startswith("verify"):  # verify{T}: t rows of T tokens
            n = int(kind.removeprefix("verify"))
            args = (jax.ShapeDtypeStruct((t, n), i32), jax.ShapeDtypeStruct((t, self.max_pages), i32), vec, vec)
            return verify.lower(sp.weights, sp.pool, *args, config=self.config, window_pages=window)
        # "select" and "vselect{T}": `window` is the DRY rows' bucket (0: no row uses DRY)
        sa = jax.tree.map(lambda a: jax.ShapeDtypeStruct((t,), a.dtype), sp.sa)
        host = (jax.ShapeDtypeStruct((window, self.config.n_vocab), jnp.float32),
                jax.ShapeDtypeStruct((window,), i32),
                jax.ShapeDtypeStruct((window, self.config.n_vocab), jnp.float32)) if window else (None, None, None)
        if kind.startswith("vselect"):
            n = int(kind.removeprefix("vselect"))
            logits = jax.ShapeDtypeStruct((t, n, self.config.n_vocab), jnp.float32)
            drafts = jax.ShapeDtypeStruct((t, n), i32)
            return select_drafted.lower(logits, sa, sp.history, vec, vec, vec, drafts, vec, *host,
                                        branchless=self.branchless)
        logits = jax.ShapeDtypeStruct((t, self.config.n_vocab), jnp.float32)
        return select.lower(logits, sa, sp.history, vec, vec, vec, *host, branchless=self.branchless)

    def warmup(self, essential: bool, threads: int | None = None) -> float:
        """Compile every program of the table, or with `essential` only `table.essential_keys()`; returns
        the seconds spent (wall clock). A progress line shows on a terminal.

        XLA compiles outside the GIL, so programs compile in parallel on `threads` (default: CPUs).
        """
        t0 = time.perf_counter()
        keys = self.table.essential_keys() if essential else self.table.keys()
        keys = [k for k in keys if k not in self.ready]
        with (stderr_progress().step("bankml: compiling", len(keys), "programs", final=False) as step,
              ThreadPoolExecutor(max_workers=threads or os.cpu_count() or 1) as pool):
            for _ in pool.map(lambda key: self.get(*key), keys):
                step.advance()
        spent = time.perf_counter() - t0
        left = len(self.table.keys()) - len(self.ready)
        log.info("compiled %d programs in %.1f s%s", len(keys), spent, f" ({left} more compile later)" if left else "")
        _return_freed_memory()
        return spent

    def compile_in_background(self) -> threading.Thread | None:
        """Compile what `warmup(essential=True)` left, one program at a time on a daemon thread, while
        the engine serves (it runs beside decoding on the same CPUs), and log when it is done. None:
        nothing was left. The thread holds the cache only while it compiles a program, so an engine
        that is unloaded meanwhile is freed, and the rest of its programs are never compiled."""
        keys = self.table.background_order(self.ready)
        if not keys:
            return None
        cache_ref, stop = weakref.ref(self), self._stop_background

        def compile_rest() -> None:
            t0 = time.perf_counter()
            for key in keys:
                cache = cache_ref()
                if cache is None or stop.is_set():
                    return
                try:
                    cache.get(*key)
                except Exception:
                    log.exception("the background compile failed; the programs it left compile on first use")
                    return
                del cache
            cache = cache_ref()
            if cache is not None:
                later = sum(1 for k in cache.table.keys() if k not in cache.ready)
                log.info("compiled the other %d programs in the background in %.1f s: %s", len(keys),
                         time.perf_counter() - t0, f"all {len(cache.ready)} ready" if not later else
                         f"{len(cache.ready)} ready, {later} verify programs when a step first wants them")
                _return_freed_memory()

        thread = threading.Thread(target=compile_rest, name="bankml-compile", daemon=True)
        thread.start()

        def at_exit() -> None:  # no new compile starts, and the one under way ends before the process does:
            stop.set()  # a daemon thread cut off inside XLA's compile aborts the process ("exception not rethrown")
            thread.join(timeout=60)

        atexit.register(at_exit)
        return thread


    def stop_background(self) -> None:
        """No background or `compile_soon` compile starts from now on (one under way finishes)."""
        self._stop_background.set()

    def compile_soon(self, keys: list[Key]) -> None:
        """Compile `keys` (the table's `on_demand` programs a step wants) on a daemon thread, once each,
        without waiting: the step runs without them meanwhile. The thread ends when its queue is empty
        and holds the cache only while it compiles a program, as the background compile does."""
        with self._lock:
            new = [k for k in keys if k not in self.ready and k not in self._compiling and k not in self._soon]
            self._soon += new
            if not new or self._soon_running:
                return
            self._soon_running = True
        cache_ref, stop = weakref.ref(self), self._stop_background

        def drain() -> None:
            while True:
                cache = cache_ref()
                if cache is None:
                    return
                with cache._lock:
                    if not cache._soon or stop.is_set():
                        cache._soon.clear()
                        cache._soon_running = False
                        return
                    key = cache._soon[0]
                try:
                    t0 = time.perf_counter()
                    cache.get(*key)
                    log.info("compiled %s %d x %d (window %d pages) when a step first wanted it, in %.1f s",
                             key[0], key[1], key[0].removeprefix("verify").removeprefix("vselect") or 1, key[2],
                             time.perf_counter() - t0)
                except Exception:
                    log.exception("compiling %s failed; a later step asks again", key)
                with cache._lock:
                    cache._soon.remove(key)
                del cache

        threading.Thread(target=drain, name="bankml-compile-soon", daemon=True).start()


def _idle_arrays() -> ChainArrays:
    """A one-row ChainArrays: its dtypes are what lowering `select` needs."""
    return chain_arrays([None], [0])


def _return_freed_memory() -> None:
    """Hand the heap that loading and compiling freed back to the OS (glibc keeps it otherwise):
    SmolLM2 at n_ctx 2048 goes from 970 to 700 MiB resident after warmup."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
