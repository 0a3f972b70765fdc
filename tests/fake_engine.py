"""A fake engine with the real one's surface, for the gateway's protocol tests (fast, no JAX).

Its tokenizer is one token per UTF-8 byte. What it generates is steered by the last words of the
prompt, so one server serves every test:
- "LONG": 5000 pieces (a stream a client can walk away from); "HUGE": 5000 pieces of 8 KiB;
- "FAIL": raises after 3 pieces (an engine failure mid-answer);
- "DIE": raises a BaseException that kills the engine thread;
- "STEPERROR": the engine's iteration itself raises while admitting it (a scheduler bug, as Work.id_slot
  = None once was); its `reset` drops it, as model/scheduler.py drops the sequence it was admitting;
- "BROKEN": after 2 pieces every iteration raises, for good (an engine that cannot step any more);
- "HANG:<fifo>": its first step blocks the engine thread until the test opens the fifo for writing
  and closes it (a wedged engine, released by the test);
- "THINK": THOUGHT_PIECES (a thought between <think> tags, then REPLY), as a reasoning model answers;
- "CALLTOOL": CALL_PIECES (a call of get_weather in the generic JSON form, tool_calls.py's
  {"tool_call": {...}}), as a model answers a tool request;
- "THINKTOOL": THINK_CALL_PIECES (the thought, then a call of get_weather in the hermes form, Qwen3's
  `<tool_call>` markup), as a thinking model calls a tool;
- otherwise the fixed REPLY, piece by piece, each step `step_s` long; `max_tokens` gives "length".
It serves `max_seqs` generations at once (one by default), each advanced a step per iteration
(tests/batch_adapter.py). Every generation it ends (finished or aborted) is logged on stderr as `fake-engine: <id> <how> after
<n> steps`, so a test can see that an abandoned stream really stopped.
"""

from __future__ import annotations

import re
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
from model.speculative import Speculation

SLOT_LAYOUT = (1, 32, "f16", 1 << 16)  # the fake's slot files: n_layers, width, cache type, n_vocab
REPLY_PIECES = ["Sav", "ante", " knows", ".", " Ça", " va", " ✓", " 😀", "!"]
REPLY = "".join(REPLY_PIECES)
THOUGHT = "The user greets me. I answer."
THOUGHT_PIECES = ["<th", "ink>", "\nThe user", " greets me.", " I answer.", "\n</", "think>", "\n\n", *REPLY_PIECES]
HERMES_CALL = ["<tool_call>", '\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "\n</tool_call>"]
THINK_CALL_PIECES = [*THOUGHT_PIECES[:-len(REPLY_PIECES)], *HERMES_CALL]
CALL_PIECES = ['{"tool_call": ', '{"name": "get_weather", ', '"arguments": {"city": ', '"Paris"}}}']
STEP_FAILED = "the fake engine's step failed on purpose"
HANG = re.compile(rb"HANG:([^\s<\"]+)")


class EngineDeath(BaseException):
    pass


class FakeEngine(GeneratorBatch):
    """The rest of the engine's surface (embeddings, a prompt's logprobs...) is GeneratorBatch's
    (tests/batch_adapter.py). Its slots keep what a restore gave them, in a tiny layout (`SLOT_LAYOUT`:
    one layer of width 32, f16), so the slot route's file handling runs against it."""

    def __init__(self, n_ctx: int = 4096, step_s: float = 0.002, max_seqs: int = 1, size_bytes: int = 1 << 20,
                 speculation: Speculation | None = None):
        super().__init__()
        # a speculating fake says every step after the first drafted two tokens and kept one (`generate`)
        self.speculation = speculation or Speculation()
        self._spec = [0, 0, 0, 0]  # EngineStats' spec_steps, spec_drafts, spec_draft_tokens, spec_accepted_tokens
        self.n_ctx = n_ctx
        self.step_s = step_s
        self.max_seqs = max_seqs
        self.size_bytes = size_bytes
        self._kept: dict[int, Slot] = {}  # what a restore put in each slot
        self.broken = False  # "BROKEN": every iteration raises from now on
        self._admitting: int | None = None  # the task a failed iteration was admitting

    def iterate(self):
        """GeneratorBatch's iteration, unless it must fail (STEPERROR at the head of the queue, BROKEN)."""
        for request, _, count in self._running.values():
            if "BROKEN" in _tail(request.prompt_tokens) and count[0] >= 2:
                self.broken = True
        if self.broken:
            raise RuntimeError(STEP_FAILED + " (broken)")
        if self._waiting and len(self._running) < self.max_seqs:
            task, request = self._waiting[0]
            if "STEPERROR" in _tail(request.prompt_tokens):
                self._admitting = task
                raise RuntimeError(STEP_FAILED)
        return super().iterate()

    def reset(self) -> list[int]:
        """The running generations, and the one a failed iteration was admitting."""
        dropped = super().reset()
        for i, (task, _) in enumerate(self._waiting):
            if task == self._admitting:
                del self._waiting[i]
                dropped.append(task)
                break
        self._admitting = None
        return dropped

    def memory_bytes(self) -> int:
        return self.size_bytes

    def slot_expect(self, model_sha256: str) -> Expect:
        return Expect(model_sha256, self.n_ctx, *SLOT_LAYOUT)

    def save_slot(self, slot: int) -> Slot:
        if self.slot_busy(slot):
            raise SlotBusy(slot)
        return self._kept.get(slot) or _empty_slot()

    def restore_slot(self, slot: int, restored: Slot | None) -> int:
        """As the engine's: None (a refused file) empties a slot that held something."""
        if self.slot_busy(slot):
            raise SlotBusy(slot)
        if restored is not None or slot in self._kept:
            self._kept[slot] = restored or _empty_slot()
        return len(self._kept[slot].tokens) if slot in self._kept else 0

    def erase_slot(self, slot: int) -> int:
        kept = self._kept.get(slot)
        self._kept[slot] = _empty_slot()
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
        steps, drafts, drafted, accepted = self._spec
        return replace(super().stats(), sequences=tuple(states), spec_steps=steps, spec_drafts=drafts,
                       spec_draft_tokens=drafted, spec_accepted_tokens=accepted)

    def warmup(self) -> float:
        return 0.25

    def generate(self, prompt_tokens: list[int], params: SamplingParams | None = None,
                 request_id: str = "generate") -> Iterator[StepOutput]:
        params = params or SamplingParams()
        tail = _tail(prompt_tokens)
        if "DIE" in tail:
            raise EngineDeath("the fake engine thread was told to die")
        hang = HANG.search(bytes(prompt_tokens[-400:]))
        if hang:
            with open(hang.group(1), "rb") as fifo:  # blocks until the test opens it for writing
                fifo.read()  # and until it closes it
        pieces = (["tick "] * 5000 if "LONG" in tail else ["x" * 8192] * 5000 if "HUGE" in tail
                  else THINK_CALL_PIECES if "THINKTOOL" in tail
                  else THOUGHT_PIECES if "THINK" in tail else CALL_PIECES if "CALLTOOL" in tail else REPLY_PIECES)
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
                drafted = 2 * (n - 1) if self.speculation.on else 0
                if n > 1 and self.speculation.on:
                    self._spec = [self._spec[0] + 1, self._spec[1] + 1, self._spec[2] + 2, self._spec[3] + 1]
                yield StepOutput(token=1000 + i, text=piece, finish_reason=finish,
                                 prompt_tokens=len(prompt_tokens), completion_tokens=n, draft_n=drafted,
                                 draft_n_accepted=drafted // 2)
                if finish is not None:
                    return
        finally:
            print(f"fake-engine: {request_id} {how} after {n} steps", file=sys.stderr, flush=True)


def _tail(prompt_tokens) -> str:
    return bytes(prompt_tokens[-80:]).decode("utf-8", "replace")


def _empty_slot() -> Slot:
    width = SLOT_LAYOUT[1]
    return Slot(np.zeros(0, np.int64), *(np.zeros((1, 0, width), np.float16),) * 2)


def fake_loader(n_ctx: int = 4096, step_s: float = 0.002, max_seqs: int = 1,
                load_s: dict[str, float] | None = None, size_bytes: dict[str, int] | None = None,
                speculation: Speculation | None = None):
    """load_s: seconds a load of the model NAME sleeps (on its engine thread), by pin name; size_bytes:
    the bytes it says it holds (1 MiB unless named); speculation: serve's (--spec-type...), which the
    fake only reports (FakeEngine)."""
    def load(path: str):
        name = model_name(path)
        delay = (load_s or {}).get(name, 0.0)
        if delay:
            print(f"fake-engine: loading {name} for {delay} s", file=sys.stderr, flush=True)
            time.sleep(delay)
        engine = FakeEngine(n_ctx, step_s, max_seqs, (size_bytes or {}).get(name, 1 << 20), speculation)
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

    @property
    def speculation(self) -> Speculation | None:
        return Speculation()

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
