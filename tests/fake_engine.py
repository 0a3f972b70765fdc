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

from batch_adapter import GeneratorBatch

from model.messages import EngineStats, FinishReason, SamplingParams, SequenceState, StepOutput

REPLY_PIECES = ["Sav", "ante", " knows", ".", " Ça", " va", " ✓", " 😀", "!"]
REPLY = "".join(REPLY_PIECES)


class EngineDeath(BaseException):
    pass


class FakeTokenizer:
    bos_token = ""
    eos_token = "<|im_end|>"
    add_bos = False
    add_eos = False

    def encode(self, text: str, add_special: bool, parse_special: bool, limit: int | None = None) -> list[int]:
        return list(text.encode("utf-8"))  # the whole text, whatever the limit: the fake's tokens are cheap

    n_vocab = 256  # one token per byte value

    def token_to_piece(self, token: int, special: bool) -> bytes:
        return bytes([token])

    def decode(self, ids, special: bool = False) -> str:
        return bytes(ids).decode("utf-8", "replace")


class FakeEngine(GeneratorBatch):
    on_accelerator = False  # what /api/ps's size_vram reads: a CPU's engine

    def __init__(self, n_ctx: int = 4096, step_s: float = 0.002, max_seqs: int = 1, size_bytes: int = 1 << 20):
        super().__init__()
        self.tokenizer = FakeTokenizer()
        self.n_ctx = n_ctx
        self.step_s = step_s
        self.max_seqs = max_seqs
        self.size_bytes = size_bytes

    def memory_bytes(self) -> int:
        return self.size_bytes

    def stats(self) -> EngineStats:
        """The adapter's counts, and one SequenceState per slot as the scheduler gives them (a
        request's slot is its place among the running ones, in admission order)."""
        running = list(self._running.items())
        states = []
        for slot in range(self.max_seqs):
            if slot >= len(running):
                states.append(SequenceState(id=slot, id_task=-1, is_processing=False, n_ctx=self.n_ctx))
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

    # embeddings (gateway/openai/embeddings.py, ollama_embed.py): mean pooling, n_embd numbers per input
    pooling = 1
    n_embd = 8
    n_vocab = 49152  # SmolLM2's: recorded token inputs are in range (the fake's own tokens are bytes)

    def embed(self, token_lists: list[list[int]], pooling: int | None = None) -> list:
        return [fake_embedding(t) for t in token_lists]

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


def fake_embedding(tokens: list[int]):
    """The fake engine's (unnormalized) embedding of a token list: 8 float32 numbers from its tokens."""
    import numpy as np

    t = np.asarray(tokens, np.float64)
    return np.array([len(t), t.mean(), t[0], t[-1], t.max(), t.min(), -1.5, 1e-7], np.float32)


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
