"""The Python generation API: load a verified GGUF, then serve many requests at once.

`add` checks a request and queues it; each `iterate` is one scheduler iteration (model/scheduler.py:
admit, a bounded chunk of prefill, one decode step for every running sequence) and returns one
`StepOutput` per sequence that produced a token, until each finishes: an end-of-generation token or a
stop string ("stop"), max_tokens or a full context ("length"), or `cancel` ("abort"). `generate`
wraps this for one sequence. The engine thread of the gateway drives it; nothing here blocks on I/O.

This module is the scheduler's runner: it owns the weights, the paged KV pool (model/kvcache.py;
`max_seqs` sequences at once, any of them up to `n_ctx` tokens, their sum bounded by the pool), the
token history the penalties read, and the compiled programs. Sampling runs on the device
(llama-server's chain, model/sampler_chain.py); text, stops and limits are the host side's, one
`model.completion.Completion` per request. The decode loop stays on the device: a step's input tokens
are gathered there from the history the last select wrote, DRY's bias is sent for DRY's rows alone,
and on a GPU the sampler has no data-dependent branch (`branchless`) and the scheduler dispatches
the next step before it reads this one's tokens (`lookahead`, model/scheduler.py).

Prompt reuse (llama-server's `cache_prompt`, on by default) is the scheduler's prefix cache: the full
pages of every sequence stay cached until the pool needs them, and a new prompt computes only what
follows the longest chain of pages it shares with any of them (`cached_tokens`).

Every compiled program comes from a fixed table of shapes (model/programs.py), so no temperature, token
or batch ever triggers a compilation. `warmup()` compiles the whole table; a server that wants to
bind sooner compiles `warmup(essential=True)` (what first short requests need), then the rest with
`compile_in_background()` while it serves. A program needed before the background got to it is
compiled on demand, once: the iteration waits for that program only, never for the others.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from bankml.errors import InvalidRequest
from bankml.progress import stderr_progress
from model import slots
from model.completion import Completion
from model.config import Config
from model.dry import PieceIndex, RestartCache, RestartSequences, dry_bias, dry_enabled, restart_sequences
from model.embed import Embedder
from model.forward import forward
from model.host_bias import host_bias
from model.kvcache import KVPool, cache_type_refusal, init_pool, page_bytes
from model.messages import EngineStats, GenerateRequest, Iteration, SamplingParams, StepOutput
from model.pages import PagePool
from model.pooling import pooling_of, resolve_pooling
from model.programs import MIN_PREFILL_BUCKET, MIN_WINDOW, ProgramTable, pow2_at_least
from model.sampler_chain import ChainArrays, chain_arrays
from model.sampling import N_PROBS_MAX, unsupported_sampling
from model.scheduler import Scheduler
from model.scheduler import Sequence as SchedSequence
from model.score import Scored, log_softmax, score
from model.slot_file import SlotResult
from model.steps import Sampled, put_row, run, select
from model.steps import decode as decode_step
from model.tokenizer_gguf import gguf_fields
from model.weights import Weights, device_bytes, file_tensor_bytes, layout_of, load_weights, matrix_types

log = logging.getLogger(__name__)

# One program is traced and lowered at a time (XLA's compile, the long part, still runs on many threads):
# lowering holds the GIL anyway, and on a GPU it compiles the Triton kernels, whose parse of their
# source breaks when several threads run it at once on CPython < 3.11.8 / 3.12.2 (gh-106905: "AST
# constructor recursion depth mismatch").
_LOWERING = threading.Lock()

PREFILL_CHUNK = 512  # the default largest prefill bucket; longer prompts run in chunks of this many tokens
PAGE_SIZE = 16  # tokens per KV page
DEVICE_BYTES_RATIO = 1.15  # the most the device layout may take over the file's tensor bytes


class EngineError(InvalidRequest, ValueError):
    """A request (or a configuration) the engine cannot take. The message is the reason, told to the
    client as it is; any other exception in the engine is a failure, named by its type."""


class Engine:
    """Holds the weights, the paged KV pool for up to `max_seqs` sequences, the scheduler and the
    compiled steps."""

    def __init__(self, config: Config, weights: Weights, tokenizer, *, n_ctx: int = 4096, max_seqs: int = 4,
                 prefill_chunk: int = PREFILL_CHUNK, page_size: int = PAGE_SIZE, n_pages: int | None = None,
                 lookahead: bool | None = None, cache_type: str = "f16"):
        if n_ctx < 2:
            raise EngineError(f"n_ctx must be at least 2, got {n_ctx}")
        if max_seqs < 1:
            raise EngineError(f"max_seqs must be at least 1, got {max_seqs}")
        if prefill_chunk < MIN_PREFILL_BUCKET or prefill_chunk & (prefill_chunk - 1):
            raise EngineError(f"the largest prefill bucket must be a power of two of at least {MIN_PREFILL_BUCKET},"
                              f" got {prefill_chunk}")
        if page_size < 1 or page_size & (page_size - 1) or page_size > MIN_WINDOW:
            raise EngineError(f"the page size must be a power of two up to {MIN_WINDOW}, got {page_size}")
        if why := cache_type_refusal(config, cache_type):
            raise EngineError(why)
        self.cache_type = cache_type  # the KV pool's: "f16" or "q8_0" (model/kvcache.py)
        self.prefill_chunk = prefill_chunk
        self.config = config
        self.weights = weights
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.max_seqs = max_seqs
        self.page_size = page_size
        self.max_pages = -(-n_ctx // page_size)
        n_pages = max_seqs * self.max_pages if n_pages is None else n_pages
        self.programs = ProgramTable(n_ctx, prefill_chunk, page_size, max_seqs)  # every shape a step takes
        self.eog_ids = frozenset(int(t) for t in getattr(tokenizer, "eog_ids", ()) or ())
        # the scheduler holds its runner weakly: an engine nobody else holds is freed at once
        self.scheduler = Scheduler(weakref.proxy(self), PagePool(n_pages, page_size), max_seqs=max_seqs,
                                   n_ctx=n_ctx, prefill_budget=prefill_chunk,
                                   lookahead=jax.default_backend() != "cpu" if lookahead is None else lookahead)
        self.pool: KVPool = init_pool(config, n_pages, page_size, cache_type)
        # each slot's tokens, for the penalties; the last row takes the padding rows' writes
        self._history = jnp.zeros((max_seqs + 1, n_ctx), jnp.int32)
        self._compiled: dict[tuple, object] = {}
        self._compiling: dict[tuple, Future] = {}  # programs being compiled, by whichever thread began
        self._compile_lock = threading.Lock()
        self._specs = _Specs.of(self)  # shapes only: a compile on another thread never reads device buffers
        self._stop_background = threading.Event()
        self._pieces: PieceIndex | None = None  # each token's text, for DRY's breakers
        self._dry_restarts = RestartCache()  # by breaker list, bounded: each request may name its own
        self.compile_s = 0.0
        self.file_bytes: int | None = None  # the GGUF's tensor bytes, when loaded from a file (`load`)
        # True: `warmup()` compiles only what a first request needs, and `compile_in_background` the rest
        self.lazy_compile = False
        # the sampler without data-dependent branches: on a GPU each `lax.cond` is a device->host sync,
        # on a CPU skipping the sorts no row needs is worth it
        self.branchless = jax.default_backend() != "cpu"
        self.gguf_pooling: int | None = None  # <arch>.pooling_type, when loaded from a file that has one
        self._embedder = None  # model/embed.py's programs, made on the first embedding request

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike, *, verified: bool, n_ctx: int = 4096, max_seqs: int = 4,
             tokenizer=None, warmup: bool = True, packed: bool | None = None, activations: str = "f32",
             prefill_chunk: int = PREFILL_CHUNK, compile_cache_dir: str | os.PathLike | None = None,
             kv_cache_bytes: int = 0, page_size: int = PAGE_SIZE, layout: str | None = None,
             lookahead: bool | None = None, cache_type: str = "f16") -> Engine:
        """Load a GGUF that `bankml.verify.verify` accepted (the caller says so with `verified=True`).

        layout: the weights' layout (model/weights.py): "packed" (the CPU default), "dense", or "device"
        (the GPU default: quantized blocks as they are, kernels chosen by kernels/ops.py).
        packed: the older switch (True: "packed", False: "dense").
        activations: "f32", or "ggml" for llama.cpp's activation rounding (model/actquant.py).
        prefill_chunk: the largest prefill bucket (a power of two); longer prompts run in such chunks.
        compile_cache_dir: JAX's persistent compilation cache (process-wide), so a restart reloads the
        compiled programs instead of compiling them again (SmolLM2 on 2 CPUs: 18.5 s -> 3.7 s).
        kv_cache_bytes: the KV pool's size (0: `kv_pool_pages` decides); page_size: tokens per page.
        cache_type: the KV cache's type, "f16" or "q8_0" (llama-server's --cache-type-k/v; about half
        the bytes, so the same kv_cache_bytes holds about twice the tokens).
        lookahead: dispatch a decode step before reading the last one's tokens (model/scheduler.py);
        default: on a GPU backend.
        """
        t0 = time.perf_counter()
        if compile_cache_dir is not None:
            jax.config.update("jax_compilation_cache_dir", os.fspath(compile_cache_dir))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        config, weights = load_weights(path, verified=verified, packed=packed, activations=activations,
                                       layout=layout)
        if tokenizer is None:
            from model.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_gguf(path)
        if why := cache_type_refusal(config, cache_type):
            raise EngineError(why)
        n_pages = kv_pool_pages(config, n_ctx=n_ctx, max_seqs=max_seqs, page_size=page_size,
                                kv_cache_bytes=kv_cache_bytes, cache_type=cache_type)
        engine = cls(config, weights, tokenizer, n_ctx=n_ctx, max_seqs=max_seqs, prefill_chunk=prefill_chunk,
                     page_size=page_size, n_pages=n_pages, lookahead=lookahead, cache_type=cache_type)
        engine.file_bytes = file_tensor_bytes(path)
        engine.gguf_pooling = pooling_of(gguf_fields(path, (f"{config.arch}.pooling_type",)), config.arch)
        log.info("loaded %s (%s, %d layers) in %.2f s; KV pool %d pages of %d tokens (%.0f MiB, %s), %d sequences "
                 "at once", os.fspath(path), config.arch, config.n_layer, time.perf_counter() - t0, n_pages,
                 page_size, engine.pool.nbytes / 2**20, cache_type, max_seqs)
        _log_weights(engine.weights_report())
        if warmup:
            engine.warmup()
        return engine

    def weights_report(self) -> dict:
        """What the weights take and which kernels run them: {"layout", "device_bytes", "file_bytes"
        (None unless loaded from a file), "ratio" (device over file bytes), "kernels" (kernels.ops.report
        for the device layout; the stacked layouts do not go through kernels.ops)}."""
        layout = layout_of(self.weights)
        device = device_bytes(self.weights)
        if layout == "device":
            from kernels import ops

            kernels = ops.report(matrix_types(self.weights))
        else:
            kernels = {"all": {"impl": "jnp", "why": f"the {layout} layout: stacked layers under lax.scan"
                                                     f"{' (model/packed.py)' if layout == 'packed' else ''}"}}
        return {"layout": layout, "device_bytes": device, "file_bytes": self.file_bytes,
                "ratio": round(device / self.file_bytes, 4) if self.file_bytes else None, "kernels": kernels}

    def memory_bytes(self) -> int:
        """What the engine holds: its weights' device bytes and its KV pool's (/api/ps "size")."""
        return int(device_bytes(self.weights)) + self.pool.nbytes

    # --- compiled programs ----------------------------------------------------------------------

    def _program(self, kind: str, t: int, window: int):
        """The compiled program for (kind, padded length, window), compiled on first use.

        kinds: "prefill" (t tokens of one slot), "decode" (one token per slot), "select" (sampling for
        t rows, `window` of them with DRY), "row" (a prompt into the token history). Safe from any
        thread: a program another thread is compiling is waited for, never compiled twice.
        """
        key = (kind, t, window)
        program = self._compiled.get(key)
        if program is not None:
            return program
        with self._compile_lock:
            if key in self._compiled:
                return self._compiled[key]
            future = self._compiling.get(key)
            mine = future is None
            if mine:
                future = self._compiling[key] = Future()
        if not mine:
            return future.result()
        try:
            t0 = time.perf_counter()
            with _LOWERING:
                lowered = self._lower(kind, t, window)
            program = lowered.compile()
            spent = time.perf_counter() - t0
        except BaseException as e:
            with self._compile_lock:
                del self._compiling[key]  # a later call tries again
            future.set_exception(e)
            raise
        with self._compile_lock:
            self._compiled[key] = program
            del self._compiling[key]
            self.compile_s += spent
        future.set_result(program)
        return program

    def _lower(self, kind: str, t: int, window: int):
        """Trace and lower one program from shapes alone (`_Specs`), never from the live arrays, which
        the engine thread donates and replaces while a background compile runs. For "prefill" t is
        the chunk's bucket, for "decode" and "select" the batch's; `window` is in pages."""
        sp, i32 = self._specs, jnp.int32
        if kind == "prefill":
            args = (jax.ShapeDtypeStruct((1, t), i32), jax.ShapeDtypeStruct((1, self.max_pages), i32),
                    jax.ShapeDtypeStruct((1,), i32), jax.ShapeDtypeStruct((1,), i32))
            return run.lower(sp.weights, sp.pool, *args, config=self.config, window_pages=window)
        if kind == "decode":
            vec = jax.ShapeDtypeStruct((t,), i32)
            args = (sp.history, vec, jax.ShapeDtypeStruct((t, self.max_pages), i32), vec, vec)
            return decode_step.lower(sp.weights, sp.pool, *args, config=self.config, window_pages=window)
        if kind == "row":
            return put_row.lower(sp.history, jax.ShapeDtypeStruct((), i32), jax.ShapeDtypeStruct((self.n_ctx,), i32))
        # "select": `window` is the DRY rows' bucket (0: no row uses DRY)
        sa = jax.tree.map(lambda a: jax.ShapeDtypeStruct((t,), a.dtype), sp.sa)
        logits = jax.ShapeDtypeStruct((t, self.config.n_vocab), jnp.float32)
        vec = jax.ShapeDtypeStruct((t,), i32)
        host = (jax.ShapeDtypeStruct((window, self.config.n_vocab), jnp.float32),
                jax.ShapeDtypeStruct((window,), i32),
                jax.ShapeDtypeStruct((window, self.config.n_vocab), jnp.float32)) if window else (None, None, None)
        return select.lower(logits, sa, sp.history, vec, vec, vec, *host, branchless=self.branchless)

    def warmup(self, threads: int | None = None, essential: bool | None = None) -> float:
        """Compile every program this engine can use, or with `essential` (default: `lazy_compile`)
        only `programs.essential_keys()`; returns the seconds spent (wall clock). A progress line shows on a
        terminal.

        XLA compiles outside the GIL, so programs compile in parallel on `threads` (default: CPUs).
        """
        t0 = time.perf_counter()
        essential = self.lazy_compile if essential is None else essential
        keys = self.programs.essential_keys() if essential else self.programs.keys()
        keys = [k for k in keys if k not in self._compiled]
        with (stderr_progress().step("bankml: compiling", len(keys), "programs", final=False) as step,
              ThreadPoolExecutor(max_workers=threads or os.cpu_count() or 1) as pool):
            for _ in pool.map(lambda key: self._program(*key), keys):
                step.advance()
        spent = time.perf_counter() - t0
        left = len(self.programs.keys()) - len(self._compiled)
        log.info("compiled %d programs in %.1f s%s", len(keys), spent, f" ({left} more compile later)" if left else "")
        _return_freed_memory()
        return spent

    def compile_in_background(self) -> threading.Thread | None:
        """Compile what `warmup(essential=True)` left, one program at a time on a daemon thread, while
        the engine serves (it runs beside decoding on the same CPUs), and log when it is done. None:
        nothing was left. The thread holds the engine only while it compiles a program, so an engine
        that is unloaded meanwhile is freed, and the rest of its programs are never compiled."""
        keys = self.programs.background_order(self._compiled)
        if not keys:
            return None
        engine_ref, stop = weakref.ref(self), self._stop_background

        def run() -> None:
            t0 = time.perf_counter()
            for key in keys:
                engine = engine_ref()
                if engine is None or stop.is_set():
                    return
                try:
                    engine._program(*key)
                except Exception:
                    log.exception("the background compile failed; the programs it left compile on first use")
                    return
                del engine
            engine = engine_ref()
            if engine is not None:
                log.info("compiled the other %d programs in the background in %.1f s: all %d ready", len(keys),
                         time.perf_counter() - t0, len(engine._compiled))
                _return_freed_memory()

        thread = threading.Thread(target=run, name="bankml-compile", daemon=True)
        atexit.register(stop.set)  # no new compile starts while the process exits
        thread.start()
        return thread

    # --- requests -----------------------------------------------------------------------------

    def add(self, request: GenerateRequest) -> int:
        """Check `request` and queue it for a sequence; returns its task id. EngineError: refused."""
        tokens = request.prompt_tokens
        params = request.params
        if not tokens:
            raise EngineError("the prompt is empty")
        if len(tokens) >= self.n_ctx:
            raise EngineError(f"the prompt has {len(tokens)} tokens, the context only {self.n_ctx}")
        if any(t < 0 or t >= self.config.n_vocab for t in tokens):
            raise EngineError("the prompt contains a token id outside the vocabulary")
        if params.n_probs > N_PROBS_MAX:
            raise EngineError(f"n_probs is at most {N_PROBS_MAX}, got {params.n_probs}")
        if (why := unsupported_sampling(params)) is not None:
            raise EngineError(why)
        # llama.cpp's LLAMA_DEFAULT_SEED (0xFFFFFFFF, i.e. -1) asks for a random seed
        seed = params.seed & 0xFFFFFFFF
        seed = secrets.randbits(32) if seed == 0xFFFFFFFF else seed
        completion = Completion(self.tokenizer, params, n_prompt=len(tokens), n_ctx=self.n_ctx,
                                eog_ids=self.eog_ids)
        return self.scheduler.add(request, seed, completion)

    def iterate(self) -> Iteration:
        """One scheduler iteration (model/scheduler.py)."""
        return self.scheduler.iterate()

    def cancel(self, task: int) -> StepOutput | None:
        """Drop the task, waiting or running; its final output ("abort"), or None if it is not live."""
        return self.scheduler.cancel(task)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def reset(self) -> list[int]:
        """After a failed iteration: the running tasks are dropped (returned), the waiting ones kept;
        a pool or history the failed program consumed (donated) is made again."""
        dropped = self.scheduler.reset()
        if self.pool.k.is_deleted() or self.pool.v.is_deleted():
            self.pool = init_pool(self.config, self.pool.n_pages, self.page_size, self.cache_type)
        if self._history.is_deleted():
            self._history = jnp.zeros((self.max_seqs + 1, self.n_ctx), jnp.int32)
        return dropped

    def stats(self) -> EngineStats:
        return self.scheduler.stats()

    def free_slots(self) -> int:
        return self.max_seqs - len(self.scheduler.running)

    def generate(self, prompt_tokens: Sequence[int], params: SamplingParams | None = None,
                 request_id: str = "generate") -> Iterator[StepOutput]:
        """One sequence, streamed (beside whatever else is queued): yields a StepOutput per token; the
        last has `finish_reason`. Tests and tools; the server drives `add` and `iterate` itself."""
        task = self.add(GenerateRequest(list(prompt_tokens), params or SamplingParams(), request_id))
        try:
            while True:
                for t, out in self.iterate().outputs:
                    if t == task:
                        yield out
                        if out.finish_reason is not None:
                            return
        finally:
            self.cancel(task)

    # --- the scheduler's runner -------------------------------------------------------------------

    def start_sequence(self, seq: SchedSequence) -> None:
        row = np.zeros(self.n_ctx, np.int32)
        row[:len(seq.tokens)] = seq.tokens
        self._history = self._program("row", 0, 0)(self._history, np.int32(seq.slot), row)

    def _table(self, seqs: list[SchedSequence], rows: int) -> np.ndarray:
        table = np.zeros((rows, self.max_pages), np.int32)
        for i, seq in enumerate(seqs):
            table[i, :len(seq.pages)] = seq.pages
        return table

    def prefill(self, seq: SchedSequence, n: int) -> jax.Array:
        start = seq.n_computed
        t, window = self.programs.prefill_shape(start, n)
        padded = np.zeros((1, t), np.int32)
        padded[0, :n] = seq.tokens[start:start + n]
        program = self._program("prefill", t, window)
        self.pool, logits = program(self.weights, self.pool, padded, self._table([seq], 1),
                                    np.array([start], np.int32), np.array([n], np.int32))
        return logits

    def decode(self, seqs: list[SchedSequence]) -> jax.Array:
        """One step for `seqs`, each at `n_computed`; its input token is read on the device, from
        the history row its last select (or its prompt) wrote, never from the host's `next_token`."""
        b = next(x for x in self.programs.batches if x >= len(seqs))
        slots = np.full(b, self.max_seqs, np.int32)  # padding rows read the spare row, write nothing
        starts, n_new = np.zeros(b, np.int32), np.zeros(b, np.int32)
        for i, seq in enumerate(seqs):
            slots[i], starts[i], n_new[i] = seq.slot, seq.n_computed, 1
        window = self.programs.window_pages(int(starts.max()), self.programs.decode_windows)
        self.pool, logits = self._program("decode", b, window)(
            self.weights, self.pool, self._history, slots, self._table(seqs, b), starts, n_new)
        return logits

    def sample(self, seqs: list[SchedSequence], logits: jax.Array) -> list[tuple[int, float | None, list]]:
        return self.read(seqs, self.sample_async(seqs, logits))

    def sample_async(self, seqs: list[SchedSequence], logits: jax.Array, ahead: int = 0) -> Sampled:
        """Dispatch the sampling of `seqs` from `logits` and start copying what it returns to the
        host; `read` waits for it. ahead 1: the step ahead's, one token past what the host holds
        (that token is in the history already: the previous select wrote it)."""
        b = logits.shape[0]
        params = [s.request.params for s in seqs] + [None] * (b - len(seqs))
        sa = chain_arrays(params, [s.seed for s in seqs] + [0] * (b - len(seqs)))
        rows = np.full(b, self.max_seqs, np.int32)  # padding rows write to the spare row
        lengths, steps = np.zeros(b, np.int32), np.zeros(b, np.int32)
        for i, seq in enumerate(seqs):
            rows[i], lengths[i], steps[i] = seq.slot, len(seq.tokens) + ahead, seq.completion.n_generated + ahead
        # filled while the device computes the step just dispatched (model/host_bias.py)
        host = host_bias(seqs, b, self.programs.dry_buckets(b), self.config.n_vocab, self.eog_ids, self._dry_row)
        if host is not None and ahead and self.needs_host(seqs):
            raise AssertionError("DRY's bias and grammars need the host's tokens: no step ahead (needs_host)")
        program = self._program("select", b, 0 if host is None else host[2].shape[0])
        post, at, pre = (None, None, None) if host is None else (host[1], host[2], host[0])
        out, self._history = program(logits, sa, self._history, rows, lengths, steps, post, at, pre)
        for leaf in jax.tree.leaves(out):
            leaf.copy_to_host_async()
        return out

    def read(self, seqs: list[SchedSequence], sampled: Sampled) -> list[tuple[int, float | None, list]]:
        out = jax.device_get(sampled)
        result = []
        for i, seq in enumerate(seqs):
            n_probs = seq.request.params.n_probs
            top = [(int(t), float(lp)) for t, lp in zip(out.top_ids[i, :n_probs], out.top_logprobs[i, :n_probs],
                                                        strict=True)]
            result.append((int(out.tokens[i]), float(out.logprob[i]) if n_probs > 0 else None, top))
        return result

    def needs_host(self, seqs: list[SchedSequence]) -> bool:
        """Whether any of `seqs` uses DRY or a grammar, which the host computes from its tokens."""
        return any(_wants_dry(s.request.params) or s.request.constraint is not None for s in seqs)

    def _dry_row(self, s: SchedSequence) -> np.ndarray | None:
        """DRY's penalties [V] for a sequence that asks for it, else None."""
        p = s.request.params
        if not _wants_dry(p):
            return None
        last_n = self.n_ctx if p.dry_penalty_last_n < 0 else p.dry_penalty_last_n
        return dry_bias(s.tokens, p.dry_multiplier, p.dry_base, p.dry_allowed_length, last_n,
                        self._restarts(tuple(p.dry_sequence_breakers)), self.config.n_vocab)

    def _restarts(self, breakers: tuple[str, ...]) -> RestartSequences:
        """The breakers' restart sequences, built once per breaker list (searches of the vocabulary's
        text) and kept while that list is among the recently used."""
        if self._pieces is None:
            self._pieces = PieceIndex([self.tokenizer.token_to_piece(t, True) for t in range(self.tokenizer.n_vocab)])
        return self._dry_restarts.get(breakers, lambda: restart_sequences(
            breakers, self._pieces, lambda text: self.tokenizer.encode(text, False, False)))

    # --- embeddings ---------------------------------------------------------------------------------

    @property
    def pooling(self) -> int:
        """The pooling llama-server --embeddings would use for this model (model/embed.py)."""
        return resolve_pooling(self.gguf_pooling)

    @property
    def n_embd(self) -> int:
        return self.config.n_embd

    @property
    def n_vocab(self) -> int:
        return self.config.n_vocab

    def embed(self, token_lists: Sequence[Sequence[int]], pooling: int | None = None) -> list[np.ndarray]:
        """Embeddings of `token_lists`, batched, no KV cache touched (model/embed.py); on the engine thread."""
        if self._embedder is None:
            self._embedder = Embedder(self.config, self.weights, self.cache_type, _LOWERING)
        return self._embedder.embed(token_lists, self.pooling if pooling is None else pooling)

    def prompt_logprobs(self, tokens: Sequence[int], n_probs: int = 0) -> list[Scored]:
        """Teacher-forced: each token's logprob after the ones before it, and the top `n_probs` there
        (model/score.py); OpenAI's echo with logprobs. On the engine thread, between iterations."""
        return score(self, tokens, n_probs)

    def prompt_log_softmax(self, tokens: Sequence[int]) -> np.ndarray:
        """The same pass, every position's whole distribution [len(tokens) - 1, V] (bench/fidelity.py)."""
        return log_softmax(self, tokens)

    # --- slot files (model/slots.py) -----------------------------------------------------------------

    def save_slot(self, slot: int, path: str, model_sha256: str) -> SlotResult:
        return slots.save(self, slot, path, model_sha256)

    def restore_slot(self, slot: int, path: str, model_sha256: str) -> SlotResult:
        return slots.restore(self, slot, path, model_sha256)

    def erase_slot(self, slot: int) -> int:
        return slots.erase(self, slot)

    # --- tests and tools ------------------------------------------------------------------------

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits [T, V] for every position of `tokens`, one full forward pass in a scratch pool."""
        n = len(tokens)
        t = pow2_at_least(n, MIN_PREFILL_BUCKET)
        padded = np.zeros((1, t), np.int32)
        padded[0, :n] = tokens
        n_pages = -(-t // self.page_size)
        scratch = init_pool(self.config, n_pages, self.page_size, self.cache_type)
        logits, _ = forward(self.weights, scratch, padded, np.arange(n_pages, dtype=np.int32)[None],
                            np.zeros(1, np.int32), np.array([n], np.int32), config=self.config, window_pages=0,
                            all_logits=True)
        return np.asarray(logits[0, :n])


def _log_weights(report: dict) -> None:
    ratio = report["ratio"]
    log.info("weights: %s layout, %.1f MiB on the device for %.1f MiB in the file (%sx)", report["layout"],
             report["device_bytes"] / 2**20, (report["file_bytes"] or 0) / 2**20,
             "?" if ratio is None else f"{ratio:.3f}")
    if report["layout"] == "device" and ratio is not None and ratio > DEVICE_BYTES_RATIO:
        log.warning("weights: the device layout takes %.3fx the file's bytes (more than %.2fx): some matrix is "
                    "held wider than its type", ratio, DEVICE_BYTES_RATIO)
    for op, rows in report["kernels"].items():
        if op in ("backend", "mode"):
            continue
        for name, row in (rows.items() if op == "qmatmul" else [("", rows)]):
            log.info("kernels: %s%s: %s (%s)", op, f" {name}" if name else "", row["impl"], row["why"])


def _wants_dry(p: SamplingParams) -> bool:
    return dry_enabled(p.dry_multiplier, p.dry_base, p.dry_penalty_last_n)


def kv_pool_pages(config: Config, *, n_ctx: int, max_seqs: int, page_size: int, kv_cache_bytes: int = 0,
                  cache_type: str = "f16") -> int:
    """The KV pool's pages. kv_cache_bytes > 0: as many as fit in it. 0: on a GPU, 80% of what the
    device's allocator has left after the weights (its limit is memory_fraction of the device); on a
    CPU (no allocator to ask), `max_seqs` whole contexts. Never fewer than one whole context."""
    per_page = page_bytes(config, page_size, cache_type)
    one_context = -(-n_ctx // page_size)
    if kv_cache_bytes > 0:
        n = kv_cache_bytes // per_page
        if n < one_context:
            raise EngineError(f"[engine] kv_cache_bytes = {kv_cache_bytes} holds {n} pages of {page_size} tokens; "
                              f"one sequence of the whole context ({n_ctx} tokens) needs {one_context} "
                              f"({one_context * per_page} bytes)")
        return n
    device = jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        left = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        return max(one_context, int(0.8 * left) // per_page)
    return max_seqs * one_context


@dataclass(frozen=True)
class _Specs:
    """The shapes, dtypes and placements of the engine's arrays: what lowering a program needs."""

    weights: Weights
    pool: KVPool
    history: jax.ShapeDtypeStruct
    sa: ChainArrays

    @classmethod
    def of(cls, engine: Engine) -> _Specs:
        def spec(a):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None),
                                        weak_type=getattr(a, "weak_type", False))

        return cls(*(jax.tree.map(spec, x) for x in (engine.weights, engine.pool, engine._history, _idle_arrays())))


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
