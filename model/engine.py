"""The Python generation API: load a verified GGUF, then prefill and decode requests in slots.

A request's life: `submit` puts its prompt in a free slot (chunked prefill, `steps.prefill`) and returns
the first sampled token; each `step` then runs one `steps.decode_step` for all slots at once (idle slots
masked) and returns one `StepOutput` per live request, until each finishes: an end-of-generation token
("stop"), max_tokens or a full context ("length"), or `cancel` ("abort"). `generate` wraps this for one
sequence. The engine thread of the gateway drives `submit`/`step`; nothing here blocks on I/O.

Every compiled program is built by `warmup` (or on first use) from a fixed table of shapes, so no
request, temperature or token ever triggers a compilation.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from model.config import Config
from model.detokenizer import IncrementalDetokenizer
from model.forward import forward
from model.kvcache import KVCache, init_cache
from model.messages import FinishReason, GenerateRequest, SamplingParams, StepOutput, TokenLogprob
from model.sampling import N_PROBS_MAX, SamplingArrays, sampling_arrays
from model.steps import Sampled, decode_step, prefill
from model.weights import Weights, load_weights

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512  # the largest prefill bucket; longer prompts run in chunks of this many tokens
MIN_PREFILL_BUCKET = 16
MIN_WINDOW = 256  # smallest attention-window bucket over cached cells


class EngineError(ValueError):
    """A request the engine cannot take. The message is the reason (the gateway renders it)."""


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


@dataclass
class _Slot:
    request: GenerateRequest
    seed: int
    n_prompt: int
    max_tokens: int  # 0: unlimited
    stream: IncrementalDetokenizer
    n_generated: int = 0


class Engine:
    """Holds the weights, the KV cache for `n_slots` sequences and the compiled steps."""

    def __init__(self, config: Config, weights: Weights, tokenizer, *, n_ctx: int = 4096, n_slots: int = 1):
        if n_ctx < 2:
            raise EngineError(f"n_ctx must be at least 2, got {n_ctx}")
        self.config = config
        self.weights = weights
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.n_slots = n_slots
        self.eog_ids = frozenset(int(t) for t in getattr(tokenizer, "eog_ids", ()) or ())
        self.cache: KVCache = init_cache(config, n_slots, n_ctx)
        self._slots: list[_Slot | None] = [None] * n_slots
        self._next_tokens = np.zeros(n_slots, np.int32)
        self._sa: SamplingArrays = sampling_arrays([None] * n_slots, [0] * n_slots)
        self._compiled: dict[tuple, object] = {}
        self.compile_s = 0.0

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike, *, verified: bool, n_ctx: int = 4096, n_slots: int = 1,
             tokenizer=None, warmup: bool = True) -> Engine:
        """Load a GGUF that `bankml.verify.verify` accepted (the caller says so with `verified=True`)."""
        t0 = time.perf_counter()
        config, weights = load_weights(path, verified=verified)
        if tokenizer is None:
            from model.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_gguf(path)
        engine = cls(config, weights, tokenizer, n_ctx=n_ctx, n_slots=n_slots)
        log.info("loaded %s (%s, %d layers) in %.2f s", os.fspath(path), config.arch, config.n_layer,
                 time.perf_counter() - t0)
        if warmup:
            engine.warmup()
        return engine

    # --- compiled programs ----------------------------------------------------------------------

    def prefill_buckets(self) -> list[int]:
        top = min(PREFILL_CHUNK, _pow2_at_least(self.n_ctx, MIN_PREFILL_BUCKET))
        return [b for b in (MIN_PREFILL_BUCKET << i for i in range(16)) if b <= top]

    def window_buckets(self) -> list[int]:
        """Attention windows over cached cells: powers of two, the last one the whole cache."""
        out, w = [], MIN_WINDOW
        while w < self.n_ctx:
            out.append(w)
            w *= 2
        return [*out, self.n_ctx]

    def _window(self, n_cells: int) -> int:
        return next(w for w in self.window_buckets() if w >= n_cells)

    def _program(self, kind: str, t: int, window: int):
        key = (kind, t, window)
        program = self._compiled.get(key)
        if program is None:
            t0 = time.perf_counter()
            b = self.n_slots
            rows = 1 if kind == "prefill" else b
            sa = jax.tree.map(lambda a: jax.ShapeDtypeStruct((rows,), a.dtype), self._sa)
            i32 = jax.ShapeDtypeStruct((), jnp.int32)
            if kind == "prefill":
                one = jax.ShapeDtypeStruct((1,), jnp.int32)
                args = (jax.ShapeDtypeStruct((1, t), jnp.int32), i32, i32, one, sa, one)
                program = prefill.lower(self.weights, self.cache, *args, config=self.config, window=window).compile()
            else:
                vec = jax.ShapeDtypeStruct((b,), jnp.int32)
                args = (vec, jax.ShapeDtypeStruct((b,), jnp.bool_), sa, vec)
                program = decode_step.lower(self.weights, self.cache, *args, config=self.config,
                                            window=window).compile()
            self._compiled[key] = program
            self.compile_s += time.perf_counter() - t0
        return program

    def warmup(self) -> float:
        """Compile every prefill and decode program this engine can use; returns the seconds spent."""
        t0 = time.perf_counter()
        for t in self.prefill_buckets():
            self._program("prefill", t, 0)
        for w in self.window_buckets():
            if self.n_ctx > PREFILL_CHUNK:
                self._program("prefill", PREFILL_CHUNK, w)
            self._program("decode", 1, w)
        spent = time.perf_counter() - t0
        log.info("compiled %d programs in %.1f s", len(self._compiled), spent)
        return spent

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
        if None not in self._slots:
            raise EngineError("all slots are busy")
        slot = self._slots.index(None)
        seed = params.seed if params.seed >= 0 else secrets.randbits(32)
        max_tokens = 1 if params.max_tokens == 0 else max(0, params.max_tokens)
        state = _Slot(request, seed, len(tokens), max_tokens, IncrementalDetokenizer(self.tokenizer))
        self._slots[slot] = state
        self._sa = sampling_arrays([s.request.params if s else None for s in self._slots],
                                   [s.seed if s else 0 for s in self._slots])
        row_sa = jax.tree.map(lambda a: a[slot:slot + 1], self._sa)

        start, out = 0, None
        while start < len(tokens):
            chunk = tokens[start:start + PREFILL_CHUNK]
            t = PREFILL_CHUNK if start else _pow2_at_least(len(chunk), MIN_PREFILL_BUCKET)
            padded = np.zeros((1, t), np.int32)
            padded[0, :len(chunk)] = chunk
            program = self._program("prefill", t, self._window(start) if start else 0)
            self.cache, out = program(self.weights, self.cache, padded, np.int32(slot), np.int32(start),
                                      np.array([len(chunk)], np.int32), row_sa, np.zeros(1, np.int32))
            start += len(chunk)
        return self._emit(slot, out, 0)

    def step(self) -> list[tuple[str, StepOutput]]:
        """One decode step for every live slot; returns (request_id, output) for each."""
        live = [i for i, s in enumerate(self._slots) if s is not None]
        if not live:
            return []
        active = np.array([s is not None for s in self._slots])
        steps = np.array([s.n_generated if s else 0 for s in self._slots], np.int32)
        n_cells = max(self._slots[i].n_prompt + self._slots[i].n_generated - 1 for i in live)
        program = self._program("decode", 1, self._window(n_cells))
        self.cache, out = program(self.weights, self.cache, self._next_tokens, active, self._sa, steps)
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

    def _emit(self, slot: int, out: Sampled, row: int) -> StepOutput:
        """Turn row `row` of a step's result into the slot's StepOutput; finish and free it if done."""
        s = self._slots[slot]
        token = int(np.asarray(out.tokens)[row])
        s.n_generated += 1
        self._next_tokens[slot] = token
        n_probs = s.request.params.n_probs
        step = StepOutput(token=token, prompt_tokens=s.n_prompt, completion_tokens=s.n_generated)
        if n_probs > 0:
            step.logprob = float(np.asarray(out.logprob)[row])
            ids, lps = np.asarray(out.top_ids)[row, :n_probs], np.asarray(out.top_logprobs)[row, :n_probs]
            step.top_logprobs = [TokenLogprob(int(i), float(lp)) for i, lp in zip(ids, lps, strict=True)]
        if token in self.eog_ids:  # not rendered (llama-server); counts as a completion token
            step.finish_reason = FinishReason.STOP
        else:
            step.text = s.stream.push(token)
            if s.max_tokens and s.n_generated >= s.max_tokens or s.n_prompt + s.n_generated >= self.n_ctx:
                step.finish_reason = FinishReason.LENGTH
        if step.finish_reason is not None:
            step.text += s.stream.flush()
            self._slots[slot] = None
        return step

    # --- tests and tools ------------------------------------------------------------------------

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
