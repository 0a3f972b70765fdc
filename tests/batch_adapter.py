"""The engine thread's batch protocol (model.engine_thread.BatchEngine) over the tests' generator
engines (the fake engine, the replay engine): up to `max_seqs` generations, admitted first come first
served, each advanced one step per iteration. An exception in one generation ends that request alone
with an error; a BaseException goes on up and kills the engine thread, as a real one would.

The rest of what the engine handle asks of an engine (gateway/serving/engine_handle.py `ServedEngine`)
is here too, plainly: a tokenizer of one token per byte, warm at once, 1 MiB on the CPU, no weights
report, embeddings from the tokens' numbers (`fake_embedding`), a prompt scored as certain, and no KV
cache to save a slot from. tests/test_engine_handle.py checks that every fake has all of it."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from model.engine_thread import _why
from model.messages import EngineStats, FinishReason, GenerateRequest, Iteration, SamplingParams, StepOutput
from model.slot_file import Expect, Slot, SlotFileError
from model.speculative import Speculation

NO_KV_CACHE = "the fake engine keeps no KV cache"


class FakeTokenizer:
    bos_token = ""
    eos_token = "<|im_end|>"
    add_bos = False
    add_eos = False
    bos_id = None  # no BOS, as SmolLM2
    eos_id = 0  # the NUL byte stands for the end of generation
    eog_ids = frozenset({0})

    def encode(self, text: str, add_special: bool, parse_special: bool, limit: int | None = None) -> list[int]:
        return list(text.encode("utf-8"))  # the whole text, whatever the limit: the fake's tokens are cheap

    n_vocab = 256  # one token per byte value
    attrs = (8,) + (4,) * 255  # TokenAttr: NUL is the control token (the end), every other byte NORMAL

    def token_to_piece(self, token: int, special: bool) -> bytes:
        return bytes([token])

    def decode(self, ids, special: bool = False) -> str:
        return bytes(ids).decode("utf-8", "replace")


def fake_embedding(tokens: list[int]):
    """The fake engine's (unnormalized) embedding of a token list: 8 float32 numbers from its tokens."""
    import numpy as np

    t = np.asarray(tokens, np.float64)
    return np.array([len(t), t.mean(), t[0], t[-1], t.max(), t.min(), -1.5, 1e-7], np.float32)


@dataclass(frozen=True)
class FakeScored:
    """model.score.Scored's shape (without importing jax): a position's logprob and its top tokens."""

    logprob: float
    top: list[tuple[int, float]]


class GeneratorBatch:
    max_seqs = 1
    n_ctx = 4096
    on_accelerator = False  # what /api/ps's size_vram reads: a CPU's engine, whatever device JAX found
    # embeddings (gateway/serving/embeddings.py): mean pooling, n_embd numbers per input
    pooling = 1
    n_embd = 8
    n_vocab = 49152  # SmolLM2's: recorded token inputs are in range (the fake's own tokens are bytes)

    def __init__(self):
        self._waiting: deque[tuple[int, GenerateRequest]] = deque()
        self._running: dict[int, tuple[GenerateRequest, Iterator[StepOutput], list[int]]] = {}
        self._next_task = 0
        self.tokenizer = FakeTokenizer()

    def generate(self, prompt_tokens: list[int], params: SamplingParams | None = None,
                 request_id: str = "generate") -> Iterator[StepOutput]:
        raise NotImplementedError

    def add(self, request: GenerateRequest) -> int:
        task, self._next_task = self._next_task, self._next_task + 1
        self._waiting.append((task, request))
        return task

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def iterate(self) -> Iteration:
        it = Iteration()
        while self._waiting and len(self._running) < self.max_seqs:
            task, request = self._waiting.popleft()
            steps = self.generate(request.prompt_tokens, request.params, request.request_id or "generate")
            self._running[task] = (request, steps, [0])
            it.admitted.append((task, time.perf_counter()))
        for task, (request, steps, count) in list(self._running.items()):
            try:
                out = next(steps)
            except StopIteration:
                out = _error(request, "the engine ended the generation without a finish reason")
            except Exception as e:
                out = _error(request, _why(e))
            count[0] = out.completion_tokens
            if out.finish_reason is not None:
                del self._running[task]
                steps.close()
            it.outputs.append((task, out))
        return it

    def cancel(self, task: int) -> StepOutput | None:
        for i, (t, request) in enumerate(self._waiting):
            if t == task:
                del self._waiting[i]
                return StepOutput(token=None, finish_reason=FinishReason.ABORT, prompt_tokens=len(request.prompt_tokens))
        if task in self._running:
            request, steps, count = self._running.pop(task)
            steps.close()
            return StepOutput(token=None, finish_reason=FinishReason.ABORT, prompt_tokens=len(request.prompt_tokens),
                              completion_tokens=count[0])
        return None

    def reset(self) -> list[int]:
        dropped = list(self._running)
        for _, steps, _ in self._running.values():
            steps.close()
        self._running.clear()
        return dropped

    def free_slots(self) -> int:
        return self.max_seqs - len(self._running)

    def stats(self) -> EngineStats:
        return EngineStats(max_seqs=self.max_seqs, running=len(self._running), waiting=len(self._waiting))

    # --- the rest of the handle's ServedEngine --------------------------------------------------------

    cache_type = "f16"  # what /slots says its pages would hold
    speculation = Speculation()  # it drafts nothing (a test may set its own: /props and /slots show it)

    @property
    def scheduler(self) -> GeneratorBatch:
        return self  # its own scheduler: a slot is a running generation's place, in admission order

    def slot_busy(self, slot: int) -> bool:
        return slot < len(self._running)

    def warmup(self) -> float:
        return 0.0

    def compile_in_background(self) -> None:
        return None  # nothing to compile

    def memory_bytes(self) -> int:
        return 1 << 20

    def weights_report(self) -> dict | None:
        return None  # the fakes do not report their weights (GET /bankml "weights" null)

    def embed(self, token_lists: Sequence[Sequence[int]], pooling: int | None = None) -> list:
        return [fake_embedding(list(t)) for t in token_lists]

    def prompt_logprobs(self, tokens: Sequence[int], n_probs: int = 0) -> list:
        return [FakeScored(0.0, [(int(t), 0.0)][:n_probs]) for t in tokens[1:]]  # certain of every token

    def slot_expect(self, model_sha256: str) -> Expect:
        raise SlotFileError(NO_KV_CACHE)

    def save_slot(self, slot: int) -> Slot:
        raise SlotFileError(NO_KV_CACHE)

    def restore_slot(self, slot: int, restored: Slot | None) -> int:
        if restored is None:
            return 0  # emptied: it held nothing
        raise SlotFileError(NO_KV_CACHE)

    def erase_slot(self, slot: int) -> int:
        return 0


def _error(request: GenerateRequest, why: str) -> StepOutput:
    return StepOutput(token=None, finish_reason=FinishReason.ERROR, error=why, prompt_tokens=len(request.prompt_tokens))
