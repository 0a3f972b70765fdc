"""llama-server's slot actions on the paged engine: a slot's K/V to the host, back into the pool, or forgotten.

A slot's K/V are not its own here: a finished sequence leaves its full pages in the shared prefix
cache (model/pages.py) and its slot remembers its tokens (`Scheduler.kept`). So:

- **snapshot** (a save) holds the pages of those tokens (computing, as a prompt would, whatever the
  cache has evicted since, and the last part-filled page, which no cache keeps) and copies them to
  the host: the slot's tokens, prompt + answer - 1;
- **install** (a restore) writes a slot file's K/V into pages taken from the pool and publishes the
  full ones in the prefix cache: the next prompt that begins with those tokens computes only what
  follows, whichever slot it runs in, as if the conversation had never left (llama-server's clients
  restore into one slot and continue in another). Only a file whose MAC this server's key checked
  comes here (model/slot_file.py: the gateway decodes it first), so its K/V are pages this server
  computed for those tokens of this model, as fit for other clients as the ones it computes now.
  `None` (a file that was refused) empties the slot;
- **erase** forgets the slot's tokens and their pages in the cache (n_erased).

All run on the engine thread, between iterations, and touch no file: the gateway reads, checks and
writes slot files on a worker thread (a slow or hostile file system never stalls the decode loop).
A slot a sequence is running in is `SlotBusy`. They take the scheduler (the slots, their tokens and
the pages) and the runner's `SlotKV` side (the pool's pages to and from the host), nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from model import slot_file
from model.config import Config
from model.scheduler import Scheduler
from model.slot_file import Expect, Slot, SlotBusy, SlotFileError


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


def snapshot(sched: Scheduler, kv: SlotKV, slot: int) -> Slot:
    """The slot's tokens and their K/V on the host. SlotFileError when the pool has no pages to
    compute what the cache evicted in."""
    _idle(sched, slot)
    tokens = list(sched.kept[slot] or [])
    hold = sched.hold_kv(tokens)
    if hold is None:
        raise SlotFileError("no free KV pages to compute the slot's cache in")
    try:
        cells = kv.pages_to_host(hold.pages, len(tokens))
    finally:
        sched.release_kv(tokens, hold.pages)
    return Slot(np.asarray(tokens, np.int64), *cells)


def install(sched: Scheduler, kv: SlotKV, slot: int, restored: Slot | None) -> int:
    """`restored` (decoded, its MAC checked) as the slot's tokens and their pages; how many tokens.
    None empties the slot, and so does a file the pool has no room for (SlotFileError)."""
    _idle(sched, slot)
    if restored is None:
        _empty(sched, slot)
        return 0
    tokens = [int(t) for t in restored.tokens]
    if restored.cache_type != kv.cache_type:  # decoded for another engine
        _empty(sched, slot)
        raise SlotFileError(f"the file holds {restored.cache_type} K/V, this server {kv.cache_type}")
    pages = sched.take_kv(len(tokens))
    if pages is None:
        _empty(sched, slot)
        raise SlotFileError("no available space in the KV cache")
    if tokens:
        kv.pages_from_host(pages, restored.arrays)
    sched.release_kv(tokens, pages)
    sched.keep(slot, tokens)
    return len(tokens)


def _empty(sched: Scheduler, slot: int) -> None:
    sched.keep(slot, None if sched.kept[slot] is None else [])


def erase(sched: Scheduler, slot: int) -> int:
    _idle(sched, slot)
    return sched.erase(slot)
