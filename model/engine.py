"""The Python generation API: load a verified GGUF, then prefill and decode requests in slots.

A request's life: `submit` puts its prompt in a free slot (chunked prefill, `steps.prefill`) and returns
the first sampled token; each `step` then runs one `steps.decode_step` for all slots at once (idle slots
masked) and returns one `StepOutput` per live request, until each finishes: an end-of-generation token
or a stop string ("stop"), max_tokens or a full context ("length"), or `cancel` ("abort"). Sampling
runs on the device (llama-server's chain, model/sampler_chain.py, with each slot's token row there for
the penalties); text, stops and limits are the host side's, one `model.completion.Completion` per
request. `generate` wraps this for one sequence. The engine thread of the gateway drives it; nothing
here blocks on I/O.

Prompt reuse (llama-server's `cache_prompt`, on by default): a slot keeps the KV of the tokens it
last held (prompt and answer, less the last token, which is never decoded). A new prompt goes to the
free slot sharing the longest prefix with it, and only the rest is prefilled; when the whole prompt
matches, its last token is computed again for its logits. The prefix is reported as `cached_tokens`.

Every compiled program comes from a fixed table of shapes (`program_keys`), so no temperature or token
ever triggers a compilation. `warmup()` compiles the whole table; a server that wants to bind sooner
compiles `warmup(essential=True)` (what a first short request needs), then the rest with
`compile_in_background()` while it serves. A program needed before the background got to it is
compiled on demand, once: the request waits for that program only, never for the others.
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
from model.completion import Completion
from model.config import Config
from model.dry import PieceIndex, RestartCache, RestartSequences, dry_bias, dry_enabled, restart_sequences
from model.forward import forward
from model.kvcache import KVCache, init_cache
from model.messages import FinishReason, GenerateRequest, SamplingParams, StepOutput
from model.sampler_chain import ChainArrays, chain_arrays
from model.sampling import N_PROBS_MAX, unsupported_sampling
from model.steps import Sampled, decode_step, prefill, put_row, select
from model.weights import Weights, load_weights

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512  # the default largest prefill bucket; longer prompts run in chunks of this many tokens
MIN_PREFILL_BUCKET = 16
CONTINUE_BUCKET = 64  # a short rest of a prompt after a reused prefix runs in this bucket
MIN_WINDOW = 256  # smallest attention-window bucket over cached cells
# What a first request needs (`essential_keys`): a prompt of up to this many tokens from position 0,
# then an answer while prompt and answer fit in ESSENTIAL_CELLS; larger shapes compile in the background
ESSENTIAL_PROMPT = 256
ESSENTIAL_CELLS = 512


class EngineError(InvalidRequest, ValueError):
    """A request (or a configuration) the engine cannot take. The message is the reason, told to the
    client as it is; any other exception in the engine is a failure, named by its type."""


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class _Slot:
    request: GenerateRequest
    seed: int
    completion: Completion  # the host side of the sequence: text, stops, logprob entries, limits

    @property
    def n_prompt(self) -> int:
        return self.completion.n_prompt

    @property
    def n_generated(self) -> int:
        return self.completion.n_generated


class Engine:
    """Holds the weights, the KV cache for `n_slots` sequences and the compiled steps."""

    def __init__(self, config: Config, weights: Weights, tokenizer, *, n_ctx: int = 4096, n_slots: int = 1,
                 prefill_chunk: int = PREFILL_CHUNK):
        if n_ctx < 2:
            raise EngineError(f"n_ctx must be at least 2, got {n_ctx}")
        if prefill_chunk < MIN_PREFILL_BUCKET or prefill_chunk & (prefill_chunk - 1):
            raise EngineError(f"the largest prefill bucket must be a power of two of at least {MIN_PREFILL_BUCKET},"
                              f" got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.config = config
        self.weights = weights
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.n_slots = n_slots
        self._prefill_windows = self.window_buckets()  # fixed by n_ctx: looked up on every step
        self._decode_windows = self.decode_window_buckets()
        self.eog_ids = frozenset(int(t) for t in getattr(tokenizer, "eog_ids", ()) or ())
        self.cache: KVCache = init_cache(config, n_slots, n_ctx)
        self._slots: list[_Slot | None] = [None] * n_slots
        self._next_tokens = np.zeros(n_slots, np.int32)
        self._sa: ChainArrays = chain_arrays([None] * n_slots, [0] * n_slots)
        self._history = jnp.zeros((n_slots, n_ctx), jnp.int32)  # each slot's tokens, for the penalties
        self._held: list[list[int]] = [[] for _ in range(n_slots)]  # tokens whose KV each slot holds
        self._compiled: dict[tuple, object] = {}
        self._compiling: dict[tuple, Future] = {}  # programs being compiled, by whichever thread began
        self._compile_lock = threading.Lock()
        self._specs = _Specs.of(self)  # shapes only: a compile on another thread never reads device buffers
        self._stop_background = threading.Event()
        self._pieces: PieceIndex | None = None  # each token's text, for DRY's breakers
        self._dry_restarts = RestartCache()  # by breaker list, bounded: each request may name its own
        self.compile_s = 0.0
        # True: `warmup()` compiles only what a first request needs, and `compile_in_background` the rest
        self.lazy_compile = False

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike, *, verified: bool, n_ctx: int = 4096, n_slots: int = 1,
             tokenizer=None, warmup: bool = True, packed: bool | None = None, activations: str = "f32",
             prefill_chunk: int = PREFILL_CHUNK, compile_cache_dir: str | os.PathLike | None = None) -> Engine:
        """Load a GGUF that `bankml.verify.verify` accepted (the caller says so with `verified=True`).

        packed: keep quantized matrices as integer codes (model/packed.py); default: on the CPU backend.
        activations: "f32", or "ggml" for llama.cpp's activation rounding (model/actquant.py).
        prefill_chunk: the largest prefill bucket (a power of two); longer prompts run in such chunks.
        compile_cache_dir: JAX's persistent compilation cache (process-wide), so a restart reloads the
        compiled programs instead of compiling them again (SmolLM2 on 2 CPUs: 18.5 s -> 3.7 s).
        """
        t0 = time.perf_counter()
        if compile_cache_dir is not None:
            jax.config.update("jax_compilation_cache_dir", os.fspath(compile_cache_dir))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        config, weights = load_weights(path, verified=verified, packed=packed, activations=activations)
        if tokenizer is None:
            from model.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_gguf(path)
        engine = cls(config, weights, tokenizer, n_ctx=n_ctx, n_slots=n_slots, prefill_chunk=prefill_chunk)
        log.info("loaded %s (%s, %d layers) in %.2f s", os.fspath(path), config.arch, config.n_layer,
                 time.perf_counter() - t0)
        if warmup:
            engine.warmup()
        return engine

    # --- compiled programs ----------------------------------------------------------------------

    def prefill_buckets(self) -> list[int]:
        top = min(self.prefill_chunk, _pow2_at_least(self.n_ctx, MIN_PREFILL_BUCKET))
        return [b for b in (MIN_PREFILL_BUCKET << i for i in range(16)) if b <= top]

    def window_buckets(self) -> list[int]:
        """Attention windows over cached cells: powers of two, the last one the whole cache."""
        out, w = [], MIN_WINDOW
        while w < self.n_ctx:
            out.append(w)
            w *= 2
        return [*out, self.n_ctx]

    def decode_window_buckets(self) -> list[int]:
        """Decode's windows: the powers of two and 1.5x each. A decode step reads its whole window of
        cells, so the finer steps cut up to a quarter of its attention reads; prefill keeps the powers."""
        between = [w * 3 // 2 for w in self.window_buckets() if w * 3 // 2 < self.n_ctx]
        return sorted({*self.window_buckets(), *between})

    @staticmethod
    def _window(n_cells: int, buckets: list[int]) -> int:
        return next(w for w in buckets if w >= n_cells)

    def _program(self, kind: str, t: int, window: int):
        """The compiled program for (kind, padded length, window), compiled on first use.

        kinds: "prefill" (t tokens of one slot), "decode" (one token per slot), "select" (sampling for
        t rows), "row" (a prompt into the token history). Safe from any thread: a program another
        thread is compiling is waited for, never compiled twice.
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
            program = self._lower(kind, t, window).compile()
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
        the engine thread donates and replaces while a background compile runs."""
        sp, b, i32 = self._specs, self.n_slots, jax.ShapeDtypeStruct((), jnp.int32)
        if kind == "prefill":
            one = jax.ShapeDtypeStruct((1,), jnp.int32)
            args = (jax.ShapeDtypeStruct((1, t), jnp.int32), i32, i32, one)
            return prefill.lower(sp.weights, sp.cache, *args, config=self.config, window=window)
        if kind == "decode":
            args = (jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.bool_))
            return decode_step.lower(sp.weights, sp.cache, *args, config=self.config, window=window)
        if kind == "row":
            return put_row.lower(sp.history, i32, jax.ShapeDtypeStruct((self.n_ctx,), jnp.int32))
        sa = jax.tree.map(lambda a: jax.ShapeDtypeStruct((t,), a.dtype), sp.sa)
        logits = jax.ShapeDtypeStruct((t, self.config.n_vocab), jnp.float32)
        vec = jax.ShapeDtypeStruct((t,), jnp.int32)
        return select.lower(logits, sa, sp.history, vec, vec, vec, logits)

    def program_keys(self) -> list[tuple[str, int, int]]:
        """Every program this engine can run: what `warmup` compiles."""
        keys = [("prefill", t, 0) for t in self.prefill_buckets()]
        for w in self.window_buckets():
            keys += [("prefill", t, w) for t in sorted({CONTINUE_BUCKET, self._chunk()})]
        keys += [("decode", 1, w) for w in self.decode_window_buckets()]
        keys += [("row", 0, 0), ("select", 1, 0)]
        return keys + ([("select", self.n_slots, 0)] if self.n_slots > 1 else [])

    def essential_keys(self) -> list[tuple[str, int, int]]:
        """The programs a first request needs when its prompt has at most ESSENTIAL_PROMPT tokens and
        prompt and answer fit in ESSENTIAL_CELLS: the smallest prefill buckets from position 0, the
        smallest decode windows, the samplers and the history row."""
        keys = [("prefill", t, 0) for t in self.prefill_buckets() if t <= ESSENTIAL_PROMPT]
        keys += [("decode", 1, w) for w in self.decode_window_buckets() if w <= ESSENTIAL_CELLS]
        keys += [("row", 0, 0), ("select", 1, 0)]
        return keys + ([("select", self.n_slots, 0)] if self.n_slots > 1 else [])

    def _background_order(self) -> list[tuple[str, int, int]]:
        """The programs not compiled yet, the likeliest next needs first: small windows (a longer answer,
        a second turn reusing its prefix) before large ones, then the larger chunks."""
        rest = [k for k in self.program_keys() if k not in self._compiled]
        return sorted(rest, key=lambda k: (k[2], k[0] != "decode", k[1]))

    def _chunk(self) -> int:
        """The bucket of a prompt chunk that starts after cached cells."""
        return self.prefill_buckets()[-1]

    def warmup(self, threads: int | None = None, essential: bool | None = None) -> float:
        """Compile every program this engine can use, or with `essential` (default: `lazy_compile`)
        only `essential_keys`; returns the seconds spent (wall clock). A progress line shows on a
        terminal.

        XLA compiles outside the GIL, so programs compile in parallel on `threads` (default: CPUs).
        """
        t0 = time.perf_counter()
        essential = self.lazy_compile if essential is None else essential
        keys = [k for k in (self.essential_keys() if essential else self.program_keys()) if k not in self._compiled]
        with (stderr_progress().step("bankml: compiling", len(keys), "programs", final=False) as step,
              ThreadPoolExecutor(max_workers=threads or os.cpu_count() or 1) as pool):
            for _ in pool.map(lambda key: self._program(*key), keys):
                step.advance()
        spent = time.perf_counter() - t0
        left = len(self.program_keys()) - len(self._compiled)
        log.info("compiled %d programs in %.1f s%s", len(keys), spent, f" ({left} more compile later)" if left else "")
        _return_freed_memory()
        return spent

    def compile_in_background(self) -> threading.Thread | None:
        """Compile what `warmup(essential=True)` left, one program at a time on a daemon thread, while
        the engine serves (it runs beside decoding on the same CPUs), and log when it is done. None:
        nothing was left. The thread holds the engine only while it compiles a program, so an engine
        that is unloaded meanwhile is freed, and the rest of its programs are never compiled."""
        keys = self._background_order()
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

    def free_slots(self) -> int:
        return sum(s is None for s in self._slots)

    def active_requests(self) -> list[str]:
        return [s.request.request_id for s in self._slots if s is not None]

    def submit(self, request: GenerateRequest) -> StepOutput:
        """Prefill `request` into a free slot; returns its first token (which may already finish it)."""
        tokens = [int(t) for t in request.prompt_tokens]
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
        if None not in self._slots:
            raise EngineError("all slots are busy")
        slot, n_past = self._pick_slot(tokens, params.cache_prompt)
        # llama.cpp's LLAMA_DEFAULT_SEED (0xFFFFFFFF, i.e. -1) asks for a random seed
        seed = params.seed & 0xFFFFFFFF
        seed = secrets.randbits(32) if seed == 0xFFFFFFFF else seed
        completion = Completion(self.tokenizer, params, n_prompt=len(tokens), n_ctx=self.n_ctx,
                                eog_ids=self.eog_ids, n_cached=n_past)
        self._slots[slot] = _Slot(request, seed, completion)
        self._sa = chain_arrays([s.request.params if s else None for s in self._slots],
                                [s.seed if s else 0 for s in self._slots])
        row_sa = jax.tree.map(lambda a: a[slot:slot + 1], self._sa)
        try:
            return self._prefill(slot, tokens, n_past, row_sa)
        except BaseException:
            self._slots[slot] = None
            self._held[slot] = []
            raise

    def _pick_slot(self, tokens: list[int], reuse: bool) -> tuple[int, int]:
        """The free slot holding the longest prefix of `tokens`, and how many of them to keep."""
        best, n_best = -1, -1
        for i, s in enumerate(self._slots):
            if s is None:
                n = _common_prefix(self._held[i], tokens) if reuse else 0
                if n > n_best:
                    best, n_best = i, n
        # the whole prompt held: its last token runs again, for the logits of the next one
        return best, min(n_best, len(tokens) - 1)

    def _prefill(self, slot: int, tokens: list[int], n_past: int, row_sa: ChainArrays) -> StepOutput:
        row = np.zeros(self.n_ctx, np.int32)
        row[:len(tokens)] = tokens
        self._history = self._program("row", 0, 0)(self._history, np.int32(slot), row)
        self._held[slot] = tokens[:n_past]
        start, logits = n_past, None
        while start < len(tokens):
            if start == 0:
                t = min(self.prefill_chunk, _pow2_at_least(len(tokens), MIN_PREFILL_BUCKET))
            else:
                t = CONTINUE_BUCKET if len(tokens) - start <= CONTINUE_BUCKET else self._chunk()
            chunk = tokens[start:start + t]
            padded = np.zeros((1, t), np.int32)
            padded[0, :len(chunk)] = chunk
            program = self._program("prefill", t, self._window(start, self._prefill_windows) if start else 0)
            self.cache, logits = program(self.weights, self.cache, padded, np.int32(slot), np.int32(start),
                                         np.array([len(chunk)], np.int32))
            start += len(chunk)
            self._held[slot] = tokens[:start]
        out, self._history = self._program("select", 1, 0)(
            logits, row_sa, self._history, np.array([slot], np.int32), np.array([len(tokens)], np.int32),
            np.zeros(1, np.int32), self._dry_bias([slot]))
        return self._emit(slot, jax.device_get(out), 0)

    def step(self) -> list[tuple[str, StepOutput]]:
        """One decode step for every live slot; returns (request_id, output) for each."""
        live = [i for i, s in enumerate(self._slots) if s is not None]
        if not live:
            return []
        active = np.array([s is not None for s in self._slots])
        steps = np.array([s.n_generated if s else 0 for s in self._slots], np.int32)
        n_cells = max(self._slots[i].n_prompt + self._slots[i].n_generated - 1 for i in live)
        self.cache, logits = self._program("decode", 1, self._window(n_cells, self._decode_windows))(
            self.weights, self.cache, self._next_tokens, active)
        for i in live:
            self._held[i].append(int(self._next_tokens[i]))
        lengths = np.array([s.n_prompt + s.n_generated if s else 0 for s in self._slots], np.int32)
        out, self._history = self._program("select", self.n_slots, 0)(
            logits, self._sa, self._history, np.arange(self.n_slots, dtype=np.int32), lengths, steps,
            self._dry_bias(range(self.n_slots)))
        out = jax.device_get(out)
        return [(self._slots[i].request.request_id, self._emit(i, out, i)) for i in live]

    def cancel(self, request_id: str) -> StepOutput | None:
        """Free the request's slot; returns its final output ("abort"), or None if it is not live."""
        for i, s in enumerate(self._slots):
            if s is not None and s.request.request_id == request_id:
                self._slots[i] = None
                return StepOutput(token=None, finish_reason=FinishReason.ABORT, prompt_tokens=s.n_prompt,
                                  completion_tokens=s.n_generated)
        return None

    def generate(self, prompt_tokens: Sequence[int], params: SamplingParams | None = None,
                 request_id: str = "generate") -> Iterator[StepOutput]:
        """One sequence, streamed: yields a StepOutput per token; the last has `finish_reason`."""
        request = GenerateRequest(list(prompt_tokens), params or SamplingParams(), request_id)
        out = self.submit(request)
        try:
            yield out
            while out.finish_reason is None:
                out = next(o for rid, o in self.step() if rid == request_id)
                yield out
        finally:
            self.cancel(request_id)

    def _dry_bias(self, slots) -> np.ndarray:
        """[len(slots), V] f32: DRY's penalties for the slots that ask for it, zeros elsewhere."""
        slots = list(slots)
        bias = np.zeros((len(slots), self.config.n_vocab), np.float32)
        for row, i in enumerate(slots):
            s = self._slots[i]
            if s is None:
                continue
            p = s.request.params
            if not dry_enabled(p.dry_multiplier, p.dry_base, p.dry_penalty_last_n):
                continue
            last_n = self.n_ctx if p.dry_penalty_last_n < 0 else p.dry_penalty_last_n
            bias[row] = dry_bias(self._held[i], p.dry_multiplier, p.dry_base, p.dry_allowed_length, last_n,
                                 self._restarts(tuple(p.dry_sequence_breakers)), self.config.n_vocab)
        return bias

    def _restarts(self, breakers: tuple[str, ...]) -> RestartSequences:
        """The breakers' restart sequences, built once per breaker list (searches of the vocabulary's
        text) and kept while that list is among the recently used."""
        if self._pieces is None:
            self._pieces = PieceIndex([self.tokenizer.token_to_piece(t, True) for t in range(self.tokenizer.n_vocab)])
        return self._dry_restarts.get(breakers, lambda: restart_sequences(
            breakers, self._pieces, lambda text: self.tokenizer.encode(text, False, False)))

    def _emit(self, slot: int, out: Sampled, row: int) -> StepOutput:
        """Turn row `row` of a step's result into the slot's StepOutput; free the slot when it finishes."""
        s = self._slots[slot]
        token = int(out.tokens[row])
        self._next_tokens[slot] = token
        n_probs = s.request.params.n_probs
        top = [(int(i), float(lp)) for i, lp in zip(out.top_ids[row, :n_probs], out.top_logprobs[row, :n_probs],
                                                    strict=True)]
        step = s.completion.push(token, float(out.logprob[row]) if n_probs > 0 else None, top)
        if step.finish_reason is not None:
            self._slots[slot] = None
        return step

    # --- tests and tools ------------------------------------------------------------------------

    def held_tokens(self, slot: int = 0) -> list[int]:
        """The tokens whose KV slot `slot` holds (what the next prompt can reuse)."""
        return list(self._held[slot])

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits [T, V] for every position of `tokens`, one full forward pass in a scratch cache."""
        n = len(tokens)
        t = _pow2_at_least(n, MIN_PREFILL_BUCKET)
        padded = np.zeros((1, t), np.int32)
        padded[0, :n] = tokens
        scratch = init_cache(self.config, 1, t)
        logits, _ = forward(self.weights, scratch, padded, jnp.int32(0), np.array([n], np.int32),
                            config=self.config, window=0, all_logits=True)
        return np.asarray(logits[0, :n])


@dataclass(frozen=True)
class _Specs:
    """The shapes, dtypes and placements of the engine's arrays: what lowering a program needs."""

    weights: Weights
    cache: KVCache
    history: jax.ShapeDtypeStruct
    sa: ChainArrays

    @classmethod
    def of(cls, engine: Engine) -> _Specs:
        def spec(a):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None),
                                        weak_type=getattr(a, "weak_type", False))

        return cls(*(jax.tree.map(spec, x) for x in (engine.weights, engine.cache, engine._history, engine._sa)))


def _return_freed_memory() -> None:
    """Hand the heap that loading and compiling freed back to the OS (glibc keeps it otherwise):
    SmolLM2 at n_ctx 2048 goes from 970 to 700 MiB resident after warmup."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
