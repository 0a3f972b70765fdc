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

All run on the engine thread, between iterations; a slot a sequence is running in is `SlotBusy`.
"""

from __future__ import annotations

import os
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from model import slot_file
from model.kvcache import KVPool
from model.slot_file import Expect, Slot, SlotBusy, SlotFileError, SlotResult, SlotSaveFailed


def _pages_bucket(pages: list[int], n_pages: int) -> np.ndarray:
    """The page ids padded to a power of two with `n_pages` (past the pool: reads clip, writes drop),
    so a few programs serve every length."""
    size = 1 << max(0, len(pages) - 1).bit_length()
    out = np.full(size, n_pages, np.int32)
    out[:len(pages)] = pages
    return out


@jax.jit
def _gather(leaf: jax.Array, pages: jax.Array) -> jax.Array:
    """[L, n_pages, Hkv, P, X] -> the listed pages' cells in order, [L, len(pages) * P, Hkv * X]."""
    x = jnp.take(leaf, pages, axis=1, mode="clip")  # [L, Np, Hkv, P, X]
    n_layer, n_p, hkv, p, w = x.shape
    return jnp.moveaxis(x, 2, 3).reshape(n_layer, n_p * p, hkv * w)


@partial(jax.jit, donate_argnums=(0,))
def _scatter(leaf: jax.Array, pages: jax.Array, cells: jax.Array) -> jax.Array:
    """The inverse of `_gather`: cells [L, len(pages) * P, Hkv * X] into the listed pages."""
    n_layer, _, hkv, p, w = leaf.shape
    x = jnp.moveaxis(cells.reshape(n_layer, -1, p, hkv, w), 3, 2)  # [L, Np, Hkv, P, X]
    return leaf.at[:, pages].set(x.astype(leaf.dtype), mode="drop")


def expect(engine, model_sha256: str) -> Expect:
    """What this engine's slot files hold. SlotFileError for a pool no slot file holds (a test's f32)."""
    c, cache_type = engine.config, engine.pool.cache_type
    if cache_type not in slot_file.CACHE_TYPES:
        raise SlotFileError(f"slot files hold an f16 or q8_0 cache, not {cache_type}")
    return Expect(model_sha256, engine.n_ctx, c.n_layer, c.n_head_kv * c.head_dim, cache_type, c.n_vocab)


def _idle(engine, slot: int):
    """The engine's scheduler, once `slot` runs no sequence (else SlotBusy)."""
    if engine.scheduler.slot_busy(slot):
        raise SlotBusy(slot)
    return engine.scheduler


def save(engine, slot: int, path: str | os.PathLike, model_sha256: str) -> SlotResult:
    t0 = time.perf_counter()
    sched = _idle(engine, slot)
    try:
        want = expect(engine, model_sha256)
    except SlotFileError as e:
        raise SlotSaveFailed(str(e)) from None
    tokens = list(sched.kept[slot] or [])
    hold = sched.hold_kv(tokens)
    if hold is None:
        raise SlotSaveFailed("no free KV pages to compute the slot's cache in")
    try:
        pages = _pages_bucket(hold.pages, engine.pool.n_pages)
        cells = [np.asarray(_gather(leaf, pages))[:, :len(tokens)] for leaf in engine.pool.arrays]
    finally:
        sched.release_kv(tokens, hold.pages)
    data = slot_file.encode(Slot(np.asarray(tokens, np.int64), *cells), want)
    try:
        slot_file.write(path, data)
    except OSError as e:
        raise SlotSaveFailed(f"the file cannot be written: {e.strerror or e}") from None
    return SlotResult(len(tokens), len(data), (time.perf_counter() - t0) * 1e3)


def restore(engine, slot: int, path: str | os.PathLike, model_sha256: str) -> SlotResult:
    """SlotFileError (the slot emptied) when the file cannot be restored."""
    t0 = time.perf_counter()
    sched = _idle(engine, slot)
    try:
        want = expect(engine, model_sha256)
        data = slot_file.read(path, want)
        kv = slot_file.decode(data, want)
        tokens = [int(t) for t in kv.tokens]
        pages = sched.take_kv(len(tokens))
        if pages is None:
            raise SlotFileError("no available space in the KV cache")
    except SlotFileError:
        sched.keep(slot, None if sched.kept[slot] is None else [])
        raise
    if tokens:
        ids = _pages_bucket(pages, engine.pool.n_pages)
        rows = len(ids) * engine.page_size
        leaves = []
        for leaf, cells in zip(engine.pool.arrays, kv.arrays, strict=True):
            padded = np.zeros((cells.shape[0], rows, cells.shape[2]), cells.dtype)
            padded[:, :len(tokens)] = cells
            leaves.append(_scatter(leaf, ids, padded))
        engine.pool = KVPool(*leaves)
    sched.release_kv(tokens, pages)
    sched.keep(slot, tokens)
    return SlotResult(len(tokens), len(data), (time.perf_counter() - t0) * 1e3)


def erase(engine, slot: int) -> int:
    return _idle(engine, slot).erase(slot)
