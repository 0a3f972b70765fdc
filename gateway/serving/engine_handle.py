"""The one typed handle the gateway holds on a model's engine (`Loaded.client`), and what that handle drives.

`EngineHandle` names everything the gateway asks of a model: queue its generations, read its thread's
state (failure, last snapshot, requests in flight), its sequences at once (`max_seqs`), run work on its
engine thread between two decode iterations (a prompt's logprobs, embeddings, llama-server's slot
files), read its weights report, and load, warm, unload and stop it. engine_client.py's `EngineClient`
implements it over a `model.engine_thread.EngineThread`; no route walks `client.thread.engine`.

`ServedEngine` is the other side: what the handle asks of the engine on its thread (model.engine.Engine,
and the tests' fake engines). tests/test_engine_handle.py checks every implementation, and every fake,
member by member against these protocols, so a missing method fails there, not in a request.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from model.engine_thread import BatchEngine, EnergyMeter
from model.messages import EngineStats, GenerateRequest, StepOutput
from model.slot_file import Expect, Slot
from model.speculative import Speculation

Outputs = AsyncIterable[StepOutput]  # one generation's outputs; the last has a finish_reason


@dataclass(frozen=True)
class EngineLoad:
    """What a load made, read on the engine thread once the engine was installed and warmed (the residency
    builds its `Loaded` from it: `NativeModel.of` reads `tokenizer` and `n_ctx` as it reads an engine's)."""

    backend: str  # a few words on the backend, the receipts' "engine"
    compile_s: float  # the warm-up's compile time
    memory_bytes: int  # weights + KV pool: /api/ps "size"
    on_accelerator: bool  # those bytes live on a GPU: /api/ps "size_vram"
    tokenizer: Any
    n_ctx: int


@dataclass(frozen=True)
class EmbeddingShape:
    """What an embedding request is checked against: the GGUF's pooling (model/pooling.py), the vectors'
    size and the vocabulary's."""

    pooling: int
    n_embd: int
    n_vocab: int


# Build: the loader's work, on the engine thread: the engine (unwarmed) and a few words on its backend
Build = Callable[[], tuple["ServedEngine", str]]


class EngineHandle(Protocol):
    """Everything the gateway asks of one model's engine. Methods that run on the engine thread (between
    two iterations, so nothing else touches the device) are async; the rest read what the thread published."""

    # --- generations -------------------------------------------------------------------------------

    def generate(self, request: GenerateRequest) -> AbstractAsyncContextManager[Outputs]:
        """`async with handle.generate(req) as gen: async for out in gen: ...`; leaving the block
        cancels the generation before the engine's next decode step."""

    def generate_all(self, requests: list[GenerateRequest]) -> AbstractAsyncContextManager[list[Outputs]]:
        """Every request queued at once, or none (Overloaded: the queue has no room for all of them);
        leaving the block cancels every one not done."""

    # --- the thread's state ------------------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        """Why the engine thread is gone (every answer is then a 503 saying so); None while it runs."""

    def stats(self) -> EngineStats | None:
        """The scheduler's last snapshot (one SequenceState per slot), or None: no engine has run, or
        the thread is gone."""

    def in_flight(self) -> tuple[int, int]:
        """(running, waiting) generations; (0, 0) once the thread is gone."""

    def stalled_s(self) -> float:
        """How long the engine thread has had work without completing a step or a job: 0 while it is idle
        or moving; /health's wedge check (gateway/http/liveness.py)."""

    @property
    def max_seqs(self) -> int:
        """The sequences the engine decodes at once ([engine] max_seqs, llama-server's n_parallel)."""

    def free_slots(self) -> int:
        """Slots no sequence holds now (the limiter's count when there is no snapshot yet)."""

    @property
    def has_engine(self) -> bool:
        """An engine is installed: False before the load, after the unload, and once the thread died."""

    def set_meter(self, meter: EnergyMeter | None) -> None:
        """The energy meter the thread reads from each answer's admission to its end (None: unmeasured)."""

    # --- work on the engine thread -----------------------------------------------------------------

    async def prompt_logprobs(self, ids: list[int], n_probs: int) -> list:
        """Teacher-forced: `model.score.Scored` for positions 1.. of `ids` (OpenAI's echo with logprobs)."""

    async def embedding_shape(self) -> EmbeddingShape: ...

    async def embed(self, token_lists: list[list[int]]) -> list[np.ndarray]:
        """Each input's vector (pooled as the GGUF says), or each token's with pooling none."""

    def slot_busy(self, slot: int) -> bool:
        """A sequence holds the slot now (read on the engine thread: the slot actions wait for it)."""

    async def slot_expect(self, model_sha256: str) -> Expect:
        """What this engine's slot files hold (model/slots.py `expect`); SlotFileError: none can."""

    async def save_slot(self, slot: int) -> Slot:
        """llama-server's slot save, once the slot is idle: its tokens and K/V on the host (the gateway
        writes the file, off the engine thread)."""

    async def restore_slot(self, slot: int, restored: Slot | None) -> int:
        """llama-server's slot restore, once the slot is idle: a file the gateway read and checked (its
        MAC too) into the slot; None, for a file it refused, empties the slot. The tokens restored."""

    async def erase_slot(self, slot: int) -> int:
        """llama-server's slot erase, once the slot is idle; the tokens it held."""

    # --- reports -----------------------------------------------------------------------------------

    @property
    def cache_type(self) -> str | None:
        """What the KV pool's pages hold ([engine] cache_type: "f16", "q8_0"); None without an engine."""

    @property
    def speculation(self) -> Speculation | None:
        """The engine's speculative decoding (--spec-type, --draft-max...: /props, /slots, the task params);
        None without an engine."""

    def weights_report(self) -> dict | None:
        """The engine's report of its weights and kernels (GET /bankml "weights"); None: no engine, or
        one that does not report (the tests' fakes)."""

    # --- its life (the residency's) ----------------------------------------------------------------

    async def load(self, build: Build) -> EngineLoad:
        """On the engine thread: build the engine, install it, warm it (what a first answer needs)."""

    def load_blocking(self, build: Build) -> EngineLoad:
        """`load`, blocking the caller: the startup model, before the event loop runs."""

    def compile_rest(self) -> None:
        """The rest of the engine's programs, in the background (the load warmed the essential ones)."""

    async def unload(self) -> None:
        """Drop the engine (after its running iteration) and end the thread; answers it still runs end
        with "the model was unloaded while it answered"."""

    def stop(self) -> None:
        """End the thread, blocking (after the event loop has ended, or when a load failed)."""


class SlotScheduler(Protocol):
    """What the handle reads of an engine's scheduler (model/scheduler.py)."""

    def slot_busy(self, slot: int) -> bool: ...


class ServedEngine(BatchEngine, Protocol):
    """What the handle asks of an engine on its thread, beyond the thread's own batch protocol
    (model.engine.Engine has it all; so must the tests' fake engines)."""

    tokenizer: Any  # encode(text, add_special, parse_special, limit); bos_token, eos_token, add_bos, add_eos
    n_ctx: int
    scheduler: SlotScheduler
    pooling: int
    n_embd: int
    n_vocab: int
    cache_type: str  # the KV pool's
    speculation: Speculation  # its drafts (spec_type "none": it drafts nothing)

    def warmup(self) -> float:
        """Compile what a first answer needs; the seconds it took."""

    def compile_in_background(self) -> Any:
        """Compile the rest on a thread of its own (None: nothing left)."""

    def memory_bytes(self) -> int: ...

    def weights_report(self) -> dict | None: ...

    def free_slots(self) -> int: ...

    def embed(self, token_lists: Sequence[Sequence[int]], pooling: int | None = None) -> list[np.ndarray]: ...

    def prompt_logprobs(self, tokens: Sequence[int], n_probs: int = 0) -> list: ...

    def slot_expect(self, model_sha256: str) -> Expect: ...

    def save_slot(self, slot: int) -> Slot: ...

    def restore_slot(self, slot: int, restored: Slot | None) -> int: ...

    def erase_slot(self, slot: int) -> int: ...
