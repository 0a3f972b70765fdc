"""Slot files on the paged engine (model/slots.py, model/slot_file.py), on a tiny random llama: a saved
slot restored into a fresh engine continues exactly as the engine that never lost it, and every file
that is not right for this engine is refused with its reason. `save` and `restore` do what the route
does (gateway/openai/slots.py): the engine's pages to and from the host, the file read and written
beside it."""

from __future__ import annotations

import hashlib
import hmac

import numpy as np
import pytest
from tiny_gguf import write_tiny_gguf

from model import slot_file
from model.engine import Engine
from model.messages import GenerateRequest, SamplingParams
from model.slot_file import SlotBusy, SlotFileError
from model.slots import expect

SHA = hashlib.sha256(b"tiny").hexdigest()
N_CTX = 256
KEY = slot_file.mac_key(b"this server's secret")


def save(engine: Engine, slot: int, path, sha256: str = SHA) -> tuple[int, int]:
    """The slot saved to `path`: (tokens, bytes)."""
    data = slot_file.encode(engine.save_slot(slot), engine.slot_expect(sha256), KEY)
    slot_file.write(path.parent, path.name, data)
    return len(slot_file.decode(data, engine.slot_expect(sha256), KEY).tokens), len(data)


def restore(engine: Engine, slot: int, path, sha256: str = SHA) -> int:
    """The file at `path` into the slot, its tokens; SlotFileError (the slot emptied) when it cannot be."""
    want = engine.slot_expect(sha256)
    try:
        restored = slot_file.decode(slot_file.read(path.parent, path.name, want.max_bytes()), want, KEY)
        return engine.restore_slot(slot, restored)
    except SlotFileError:
        engine.restore_slot(slot, None)
        raise


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("slots") / "tiny.gguf", "llama", n_layer=2, scale=0.3)


@pytest.fixture(scope="module")
def path32(tmp_path_factory):  # heads of 32: one q8_0 block each
    return write_tiny_gguf(tmp_path_factory.mktemp("slots32") / "tiny.gguf", "llama", n_layer=2, head_dim=32,
                           scale=0.3)


def _engine(path, **kw) -> Engine:
    return Engine.load(path, verified=True, n_ctx=kw.pop("n_ctx", N_CTX), max_seqs=2, warmup=False, **kw)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def _run(engine: Engine, prompt: list[int], n: int = 6, id_slot: int = -1):
    outs = list(_generate(engine, prompt, n, id_slot))
    return [o.token for o in outs], outs[-1]


def _generate(engine, prompt, n, id_slot):
    task = engine.add(GenerateRequest(prompt, SamplingParams(temperature=0.0, max_tokens=n), id_slot=id_slot))
    while True:
        for t, out in engine.iterate().outputs:
            if t == task and out.token is not None or t == task and out.finish_reason is not None:
                yield out
                if out.finish_reason is not None:
                    return


@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
def test_a_restored_slot_continues_as_one_never_saved(path, path32, tmp_path, cache_type):
    path = path32 if cache_type == "q8_0" else path
    first = _prompt(37)
    a = _engine(path, cache_type=cache_type)
    answer, last = _run(a, first, id_slot=1)
    assert last.id_slot == 1
    n_saved, n_written = save(a, 1, tmp_path / "s.bin")
    assert n_saved == len(first) + len(answer) - 1  # the last sampled token is never computed
    assert (tmp_path / "s.bin").stat().st_size == n_written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.bin"]  # the temporary file was renamed
    assert (tmp_path / "s.bin").stat().st_mode & 0o777 == 0o600  # a conversation: its owner's only

    second = first + answer + _prompt(9, seed=5)
    want, want_last = _run(a, second)  # the engine that never lost its cache

    b = _engine(path, cache_type=cache_type)  # a restart: nothing cached
    assert restore(b, 0, tmp_path / "s.bin") == n_saved
    assert b.stats().sequences[0].n_kept == n_saved
    # saved again at once: the full pages come back bit for bit from the prefix cache (the part-filled
    # last one, which no cache keeps, is computed again)
    save(b, 0, tmp_path / "again.bin")
    was, again = (slot_file.decode((tmp_path / n).read_bytes(), expect(b.runner, SHA), KEY)
                  for n in ("s.bin", "again.bin"))
    full = n_saved // 16 * 16
    assert list(was.tokens) == list(again.tokens) and was.cache_type == cache_type
    for a_, b_ in ((was.k, again.k), (was.v, again.v), (was.k_scale, again.k_scale), (was.v_scale, again.v_scale)):
        assert (a_ is None and b_ is None) or np.array_equal(a_[:, :full], b_[:, :full])

    got, got_last = _run(b, second)
    assert got == want
    assert got_last.cached_tokens == want_last.cached_tokens > 0  # the restored pages were used


def test_save_computes_what_the_cache_evicted(path, tmp_path):
    """The slot's pages were evicted by other prompts: the save computes them again, and the file
    equals one saved while they were cached."""
    a = _engine(path, kv_cache_bytes=0)
    prompt = _prompt(40, seed=2)
    _run(a, prompt, id_slot=0)
    hot = a.save_slot(0)
    a.scheduler.pool.clear()  # every cached page gone
    cold = a.save_slot(0)
    assert list(hot.tokens) == list(cold.tokens)
    # computed by prefill instead of decode steps: the same values to f16 rounding
    np.testing.assert_allclose(hot.k.astype(np.float32), cold.k.astype(np.float32), atol=2e-2)


def test_a_name_of_255_bytes_is_saved(path, tmp_path):
    """The filename rule allows 255 bytes: the temporary file beside it must not add to that name."""
    a = _engine(path)
    name = "é" * 127 + "a"
    assert len(name.encode()) == 255
    save(a, 0, tmp_path / name)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_an_idle_slot_saves_empty_and_erase_forgets(path, tmp_path):
    a = _engine(path)
    assert save(a, 1, tmp_path / "idle.bin")[0] == 0
    assert a.stats().sequences[1].n_kept is None  # saving did not make up a prompt for it
    assert a.erase_slot(1) == 0

    prompt = _prompt(50, seed=3)
    _, first = _run(a, prompt, id_slot=1)
    _, again = _run(a, prompt, id_slot=1)
    assert again.cached_tokens == 48  # three full pages of 16
    n = a.erase_slot(1)
    assert n == len(prompt) + 5
    assert a.stats().sequences[1].n_kept == 0
    _, after = _run(a, prompt, id_slot=1)
    assert after.cached_tokens == 0


def _refused(engine, tmp_path, data: bytes, why: str):
    (tmp_path / "bad.bin").write_bytes(data)
    with pytest.raises(SlotFileError, match=why):
        restore(engine, 0, tmp_path / "bad.bin")
    assert engine.stats().sequences[0].n_kept in (None, 0)


def _resealed(body: bytes) -> bytes:
    """`body` sealed with this server's key: the checks behind the MAC, on a file it would pass."""
    return body + hmac.new(KEY, body, hashlib.sha256).digest()


def test_every_wrong_file_is_refused(path, path32, tmp_path):
    a = _engine(path)
    _run(a, _prompt(20, seed=4), id_slot=0)
    save(a, 0, tmp_path / "good.bin")
    good = (tmp_path / "good.bin").read_bytes()
    body = good[:-32]
    head = len(slot_file.MAGIC)

    with pytest.raises(SlotFileError, match="does not exist"):
        restore(a, 0, tmp_path / "missing.bin")
    assert a.stats().sequences[0].n_kept == 0  # a failed restore empties the slot
    _refused(a, tmp_path, b"hello" * 40, "not a bankML slot file")
    flipped = bytearray(good)
    flipped[head + 100] ^= 1
    _refused(a, tmp_path, bytes(flipped), "damaged")
    _refused(a, tmp_path, good[:16], "not a bankML slot file")
    with pytest.raises(SlotFileError, match="another model"):
        restore(a, 0, tmp_path / "good.bin", hashlib.sha256(b"other").hexdigest())
    wider = _engine(path, n_ctx=2 * N_CTX)
    with pytest.raises(SlotFileError, match="context of 256 tokens, this server has 512"):
        restore(wider, 0, tmp_path / "good.bin")
    with pytest.raises(SlotFileError, match="holds an f16 cache, this server q8_0"):
        restore(_engine(path32, cache_type="q8_0"), 0, tmp_path / "good.bin")

    def field(offset: int, value: int) -> bytes:
        return _resealed(body[:offset] + value.to_bytes(8, "little") + body[offset + 8:])

    _refused(a, tmp_path, field(head + 64 + 8, N_CTX), "does not fit in the slot context")
    _refused(a, tmp_path, field(head + 64 + 16, 3), "3 layers, the model 2")
    width = int.from_bytes(body[head + 88:head + 96], "little")
    _refused(a, tmp_path, field(head + 88, width | slot_file.Q8_0_FLAG), "holds a q8_0 cache, this server f16")
    _refused(a, tmp_path, field(head + 88, width * 2), "K/V width")
    _refused(a, tmp_path, _resealed(body[:-4]), "truncated")
    _refused(a, tmp_path, _resealed(body + b"\0\0\0\0"), "trailing data")
    bad_token = body[:-4] + (10**6).to_bytes(4, "little")
    _refused(a, tmp_path, _resealed(bad_token), "Invalid tokens in slot save file")
    _refused(a, tmp_path, good + b"x" * (expect(a.runner, SHA).max_bytes()), "more than a slot file")
    # the good one still restores after all that
    assert restore(a, 0, tmp_path / "good.bin") == 20 + 5


def test_a_busy_slot_is_not_touched(path, tmp_path):
    a = _engine(path)
    task = a.add(GenerateRequest(_prompt(30), SamplingParams(temperature=0.0, max_tokens=50), id_slot=1))
    a.iterate()
    for action in (lambda: a.save_slot(1), lambda: a.restore_slot(1, None), lambda: a.erase_slot(1)):
        with pytest.raises(SlotBusy):
            action()
    a.cancel(task)
    assert a.stats().sequences[1].n_kept > 0


def test_id_slot_picks_and_waits_for_its_slot(path):
    a = _engine(path)
    first = a.add(GenerateRequest(_prompt(20), SamplingParams(temperature=0.0, max_tokens=30), id_slot=3))
    second = a.add(GenerateRequest(_prompt(20, 1), SamplingParams(temperature=0.0, max_tokens=30), id_slot=1))
    a.iterate()
    running = {s.id: s.id_task for s in a.stats().sequences if s.is_processing}
    assert running == {1: first}  # 3 wraps to slot 1 (llama-server's id % slots); the second waits for it
    assert a.stats().waiting == 1
    a.cancel(first)
    a.iterate()
    assert {s.id: s.id_task for s in a.stats().sequences if s.is_processing} == {1: second}
