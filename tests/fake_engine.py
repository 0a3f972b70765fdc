"""A fake engine with the real one's surface, for the gateway's protocol tests (fast, no JAX).

Its tokenizer is one token per UTF-8 byte. What it generates is steered by the last words of the
prompt, so one server serves every test:
- "LONG": 5000 pieces (a stream a client can walk away from); "HUGE": 5000 pieces of 8 KiB;
- "FAIL": raises after 3 pieces (an engine failure mid-answer);
- "DIE": raises a BaseException that kills the engine thread;
- otherwise the fixed REPLY, piece by piece, each step `step_s` long; `max_tokens` gives "length".
It serves `max_seqs` generations at once (one by default), each advanced a step per iteration
(tests/batch_adapter.py). Every generation it ends (finished or aborted) is logged on stderr as `fake-engine: <id> <how> after
<n> steps`, so a test can see that an abandoned stream really stopped.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
from batch_adapter import FakeTokenizer as FakeTokenizer  # re-exported: the tests' byte tokenizer
from batch_adapter import GeneratorBatch
from batch_adapter import fake_embedding as fake_embedding  # re-exported: the vectors the fake embeds

from model.messages import EngineStats, FinishReason, SamplingParams, SequenceState, StepOutput
from model.slot_file import Expect, Slot, SlotBusy

SLOT_LAYOUT = (1, 32, "f16", 1 << 16)  # the fake's slot files: n_layers, width, cache type, n_vocab
REPLY_PIECES = ["Sav", "ante", " knows", ".", " Ça", " va", " ✓", " 😀", "!"]
REPLY = "".join(REPLY_PIECES)


class EngineDeath(BaseException):
    pass


class FakeEngine(GeneratorBatch):
    """The rest of the engine's surface (embeddings, a prompt's logprobs...) is GeneratorBatch's
    (tests/batch_adapter.py). Its slots keep what a restore gave them, in a tiny layout (`SLOT_LAYOUT`:
    one layer of width 32, f16), so the slot route's file handling runs against it."""

    def __init__(self, n_ctx: int = 4096, step_s: float = 0.002, max_seqs: int = 1, size_bytes: int = 1 << 20):
        super().__init__()
        self.n_ctx = n_ctx
        self.step_s = step_s
        self.max_seqs = max_seqs
        self.size_bytes = size_bytes
        self._kept: dict[int, Slot] = {}  # what a restore put in each slot

    def memory_bytes(self) -> int:
        return self.size_bytes

    def slot_expect(self, model_sha256: str) -> Expect:
        return Expect(model_sha256, self.n_ctx, *SLOT_LAYOUT)

    def save_slot(self, slot: int) -> Slot:
        if self.slot_busy(slot):
            raise SlotBusy(slot)
        width = SLOT_LAYOUT[1]
        return self._kept.get(slot) or Slot(np.zeros(0, np.int64), *(np.zeros((1, 0, width), np.float16),) * 2)

    def restore_slot(self, slot: int, restored: Slot | None) -> int:
        if self.slot_busy(slot):
            raise SlotBusy(slot)
        self._kept.pop(slot, None)
        if restored is not None:
            self._kept[slot] = restored
        return 0 if restored is None else len(restored.tokens)

    def erase_slot(self, slot: int) -> int:
        kept = self._kept.pop(slot, None)
        return 0 if kept is None else len(kept.tokens)

    def stats(self) -> EngineStats:
        """The adapter's counts, and one SequenceState per slot as the scheduler gives them (a
        request's slot is its place among the running ones, in admission order)."""
        running = list(self._running.items())
        states = []
        for slot in range(self.max_seqs):
            if slot >= len(running):
                kept = self._kept.get(slot)
                states.append(SequenceState(id=slot, id_task=-1, is_processing=False, n_ctx=self.n_ctx,
                                            n_kept=None if kept is None else len(kept.tokens)))
                continue
            task, (request, _, count) = running[slot]
            max_tokens = request.params.max_tokens
            states.append(SequenceState(
                id=slot, id_task=task, is_processing=True, n_ctx=self.n_ctx, n_prompt=len(request.prompt_tokens),
                n_decoded=count[0], n_remain=-1 if max_tokens < 0 else max(0, max_tokens - count[0]),
                params=request.params))
        return replace(super().stats(), sequences=tuple(states))

    def warmup(self) -> float:
        return 0.25

    def generate(self, prompt_tokens: list[int], params: SamplingParams | None = None,
                 request_id: str = "generate") -> Iterator[StepOutput]:
        params = params or SamplingParams()
        tail = bytes(prompt_tokens[-80:]).decode("utf-8", "replace")
        if "DIE" in tail:
            raise EngineDeath("the fake engine thread was told to die")
        pieces = ["tick "] * 5000 if "LONG" in tail else ["x" * 8192] * 5000 if "HUGE" in tail else REPLY_PIECES
        n, how = 0, "aborted"
        try:
            for i, piece in enumerate(pieces):
                if "FAIL" in tail and i == 3:
                    how = "failed"
                    raise RuntimeError("the fake engine failed on purpose")
                time.sleep(self.step_s)
                n += 1
                last = i == len(pieces) - 1
                length = params.max_tokens > 0 and n >= params.max_tokens
                finish = FinishReason.STOP if last else FinishReason.LENGTH if length else None
                if finish is not None:
                    how = finish.value
                yield StepOutput(token=1000 + i, text=piece, finish_reason=finish,
                                 prompt_tokens=len(prompt_tokens), completion_tokens=n)
                if finish is not None:
                    return
        finally:
            print(f"fake-engine: {request_id} {how} after {n} steps", file=sys.stderr, flush=True)


def fake_loader(n_ctx: int = 4096, step_s: float = 0.002, max_seqs: int = 1,
                load_s: dict[str, float] | None = None, size_bytes: dict[str, int] | None = None):
    """load_s: seconds a load of the model NAME sleeps (on its engine thread), by pin name; size_bytes:
    the bytes it says it holds (1 MiB unless named)."""
    def load(path: str):
        name = model_name(path)
        delay = (load_s or {}).get(name, 0.0)
        if delay:
            print(f"fake-engine: loading {name} for {delay} s", file=sys.stderr, flush=True)
            time.sleep(delay)
        engine = FakeEngine(n_ctx, step_s, max_seqs, (size_bytes or {}).get(name, 1 << 20))
        print(f"fake-engine: loaded {name}", file=sys.stderr, flush=True)
        return engine, "a fake engine for tests"

    return load


def fake_estimate(size_bytes: dict[str, int] | None = None):
    """What a fake load will hold, as the fake loader makes it (for the residency's budget)."""
    def estimate(path: str) -> int:
        return (size_bytes or {}).get(model_name(path), 1 << 20)

    return estimate


def model_name(path: str) -> str:
    name = path.rsplit("/", 1)[-1].lower()
    return name[:-5] if name.endswith(".gguf") else name


class StubHandle:
    """The engine handle's whole surface (gateway/serving/engine_handle.py `EngineHandle`), for a test that
    hands a route its own outputs without an engine thread: it overrides what the route should use, and
    anything else the route asks for fails the test by name."""

    def _unexpected(self, name: str):
        raise AssertionError(f"the route asked the engine handle for {name}, which this test does not stub")

    def generate(self, request):
        self._unexpected("generate")

    def generate_all(self, requests):
        self._unexpected("generate_all")

    @property
    def failure(self) -> str | None:
        return None  # the thread runs

    def stats(self):
        self._unexpected("stats")

    def in_flight(self) -> tuple[int, int]:
        self._unexpected("in_flight")

    def stalled_s(self) -> float:
        return 0.0  # never wedged

    @property
    def max_seqs(self) -> int:
        return 1

    def free_slots(self) -> int:
        self._unexpected("free_slots")

    @property
    def has_engine(self) -> bool:
        return True

    def set_meter(self, meter) -> None:
        self._unexpected("set_meter")

    async def prompt_logprobs(self, ids: list[int], n_probs: int) -> list:
        self._unexpected("prompt_logprobs")

    async def embedding_shape(self):
        self._unexpected("embedding_shape")

    async def embed(self, token_lists: list[list[int]]) -> list:
        self._unexpected("embed")

    def slot_busy(self, slot: int) -> bool:
        self._unexpected("slot_busy")

    async def slot_expect(self, model_sha256: str):
        self._unexpected("slot_expect")

    async def save_slot(self, slot: int):
        self._unexpected("save_slot")

    async def restore_slot(self, slot: int, restored):
        self._unexpected("restore_slot")

    async def erase_slot(self, slot: int) -> int:
        self._unexpected("erase_slot")

    @property
    def cache_type(self) -> str | None:
        return "f16"

    def weights_report(self) -> dict | None:
        return None

    async def load(self, build):
        self._unexpected("load")

    def load_blocking(self, build):
        self._unexpected("load_blocking")

    def compile_rest(self) -> None:
        self._unexpected("compile_rest")

    async def unload(self) -> None:
        self._unexpected("unload")

    def stop(self) -> None:
        self._unexpected("stop")
