"""llama-server's slot actions on the paged engine: save a slot's K/V to a file, restore one, erase one.

A slot's K/V are not its own here: a finished sequence leaves its full pages in the shared prefix
cache (model/pages.py) and its slot remembers its tokens (`Scheduler.kept`). So:

- **save** holds the pages of those tokens (computing, as a prompt would, whatever the cache has
  evicted since, and the last part-filled page, which no cache keeps), copies them to the host and
  writes the slot file (model/slot_file.py): n_saved = the slot's tokens, prompt + answer - 1;
- **restore** reads and checks the file, writes its K/V into pages taken from the pool and publishes
  the full ones in the prefix cache: the next prompt that begins with those tokens computes only
  what follows, whichever slot it runs in, as if the conversation had never left. A file that fails
  any check is refused with the reason, and the slot is emptied;
- **erase** forgets the slot's tokens and their pages in the cache (n_erased).

All run on the engine thread, between iterations; a slot a sequence is running in is `SlotBusy`. They
take the scheduler (the slots, their tokens and the pages) and the runner's `SlotKV` side (the pool's
pages to and from the host), nothing else of the engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from model import slot_file
from model.config import Config
from model.scheduler import Scheduler
from model.slot_file import Expect, Slot, SlotBusy, SlotFileError, SlotResult, SlotSaveFailed


class SlotKV(Protocol):
    """What slot files need of the engine's KV pool (model/runner.py's `Runner` has it)."""

    config: Config
    n_ctx: int
    cache_type: str  # the pool's

    def pages_to_host(self, pages: list[int], n_tokens: int) -> list[np.ndarray]:
        """The first `n_tokens` cells of `pages`, per pool array: [L, n_tokens, Hkv * X] each."""

    def pages_from_host(self, pages: list[int], cells: Sequence[np.ndarray]) -> None:
        """`cells` (as `pages_to_host` returns them) into the first cells of `pages`."""


def expect(kv: SlotKV, model_sha256: str) -> Expect:
    """What this engine's slot files hold. SlotFileError for a pool no slot file holds (a test's f32)."""
    c, cache_type = kv.config, kv.cache_type
    if cache_type not in slot_file.CACHE_TYPES:
        raise SlotFileError(f"slot files hold an f16 or q8_0 cache, not {cache_type}")
    return Expect(model_sha256, kv.n_ctx, c.n_layer, c.n_head_kv * c.head_dim, cache_type, c.n_vocab)


def _idle(sched: Scheduler, slot: int) -> None:
    """SlotBusy while a sequence runs in `slot`."""
    if sched.slot_busy(slot):
        raise SlotBusy(slot)


def save(sched: Scheduler, kv: SlotKV, slot: int, path: str | os.PathLike, model_sha256: str) -> SlotResult:
    t0 = time.perf_counter()
    _idle(sched, slot)
    try:
        want = expect(kv, model_sha256)
    except SlotFileError as e:
        raise SlotSaveFailed(str(e)) from None
    tokens = list(sched.kept[slot] or [])
    hold = sched.hold_kv(tokens)
    if hold is None:
        raise SlotSaveFailed("no free KV pages to compute the slot's cache in")
    try:
        cells = kv.pages_to_host(hold.pages, len(tokens))
    finally:
        sched.release_kv(tokens, hold.pages)
    data = slot_file.encode(Slot(np.asarray(tokens, np.int64), *cells), want)
    try:
        slot_file.write(path, data)
    except OSError as e:
        raise SlotSaveFailed(f"the file cannot be written: {e.strerror or e}") from None
    return SlotResult(len(tokens), len(data), (time.perf_counter() - t0) * 1e3)


def restore(sched: Scheduler, kv: SlotKV, slot: int, path: str | os.PathLike, model_sha256: str) -> SlotResult:
    """SlotFileError (the slot emptied) when the file cannot be restored."""
    t0 = time.perf_counter()
    _idle(sched, slot)
    try:
        want = expect(kv, model_sha256)
        data = slot_file.read(path, want)
        restored = slot_file.decode(data, want)
        tokens = [int(t) for t in restored.tokens]
        pages = sched.take_kv(len(tokens))
        if pages is None:
            raise SlotFileError("no available space in the KV cache")
    except SlotFileError:
        sched.keep(slot, None if sched.kept[slot] is None else [])
        raise
    if tokens:
        kv.pages_from_host(pages, restored.arrays)
    sched.release_kv(tokens, pages)
    sched.keep(slot, tokens)
    return SlotResult(len(tokens), len(data), (time.perf_counter() - t0) * 1e3)


def erase(sched: Scheduler, slot: int) -> int:
    _idle(sched, slot)
    return sched.erase(slot)
