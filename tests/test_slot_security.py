"""Slot files against a hostile slot directory and a busy registry (issue 28), on the fake engine (its slots
keep what a restore gave them, in a tiny layout: tests/fake_engine.py).

- a file this server did not seal (a recomputed sha256, the old v1 format, another server's key) restores
  nothing; one it sealed restores;
- a FIFO, a symbolic link (a loop too) or a directory under the name is a 400 at once, naming the file as
  the client gave it and no server path, and the engine keeps answering;
- erase takes no body and needs no JSON content type;
- with several models loaded, a slot action or GET /slots must say whose slots (`model`);
- GET /slots says what each slot's pages hold (`cache_type`).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

import httpx
import numpy as np
import pytest
from fake_engine import SLOT_LAYOUT
from gateway_helpers import FakeServer, registry_dir, tiny_model

from bankml import signing
from model import slot_file
from model.slot_file import Expect, Slot

HANG_GUARD_S = 60  # a FIFO opened for reading blocks until a writer comes: this only bounds the test


def post(server, path: str, body=None, content_type: str | None = "application/json", **kw) -> httpx.Response:
    content = b"" if body is None else json.dumps(body).encode()
    headers = {"Content-Type": content_type} if content_type else {}
    return httpx.post(server.url(path, **kw), content=content, headers=headers, timeout=HANG_GUARD_S)


def error(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["message"]


def slots_of(server, query: str = "") -> list[dict]:
    r = httpx.get(server.url("/slots" + query), timeout=HANG_GUARD_S)
    assert r.status_code == 200, r.text
    return r.json()


def chat(server, model: str | None = None) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **({"model": model} if model else {})}
    return post(server, "/v1/chat/completions", body)


@pytest.fixture(scope="module")
def served(tmp_path_factory, receipt_key_dir):
    d = tmp_path_factory.mktemp("slotsec")
    model, fork = tiny_model(d / "m")
    slots = d / "slots"
    s = FakeServer(model, fork, engine={"max_seqs": 2}, flags=["--slot-dir", str(slots)])
    key = signing.read_key(str(receipt_key_dir / signing.KEY_FILE), "the receipt key")
    expect = Expect(hashlib.sha256(model.read_bytes()).hexdigest(), 4096, *SLOT_LAYOUT)
    yield s, slots, slot_file.mac_key(key.private.private_bytes_raw()), expect
    s.stop()


def _slot(tokens: list[int], fill: float = 0.5) -> Slot:
    n, width = len(tokens), SLOT_LAYOUT[1]
    kv = np.full((1, n, width), fill, np.float16)
    return Slot(np.asarray(tokens, np.int64), kv, kv.copy())


# --- who sealed the file --------------------------------------------------------------------------


def test_only_a_file_this_server_sealed_restores(served):
    server, slots, key, expect = served
    tokens = list(range(40, 60))
    good = slot_file.encode(_slot(tokens), expect, key)
    body = bytearray(good[:-32])
    at = len(slot_file.MAGIC) + 64 + 3 * 8 + 8  # the first layer's K
    body[at:at + 8] = struct.pack("<4e", 1e4, -1e4, 1e4, -1e4)  # forged K, the same tokens
    v1 = b"bankML slot v1\n" + bytes(body[len(slot_file.MAGIC):])
    forged = {
        "sha.bin": bytes(body) + hashlib.sha256(bytes(body)).digest(),  # the forgery: a recomputed sha256
        "v1.bin": v1 + hashlib.sha256(v1).digest(),  # the old format, which had nothing more
        "other-key.bin": slot_file.encode(_slot(tokens, 9.0), expect, slot_file.mac_key(b"another server")),
        "cut.bin": good[:-1],
    }
    (slots / "good.bin").write_bytes(good)
    r = post(server, "/slots/1?action=restore", {"filename": "good.bin"})
    assert r.status_code == 200, r.text
    assert r.json()["n_restored"] == len(tokens) and r.json()["n_read"] == len(good)
    assert slots_of(server)[1]["n_prompt_tokens"] == len(tokens)

    for name, data in forged.items():
        (slots / name).write_bytes(data)
        status, message = error(post(server, "/slots/1?action=restore", {"filename": name}))
        assert status == 400 and message.startswith(f"Unable to restore slot: '{name}': "), message
        assert slots_of(server)[1]["n_prompt_tokens"] == 0, name  # refused: nothing restored, the slot emptied
    assert "older bankML" in error(post(server, "/slots/1?action=restore", {"filename": "v1.bin"}))[1]

    # what the slot holds is saved as it came, sealed again by this server
    post(server, "/slots/1?action=restore", {"filename": "good.bin"})
    r = post(server, "/slots/1?action=save", {"filename": "again.bin"})
    assert r.status_code == 200, r.text
    assert r.json()["n_saved"] == len(tokens) and (slots / "again.bin").read_bytes() == good
    assert (slots / "again.bin").stat().st_mode & 0o777 == 0o600


# --- what is under the name -----------------------------------------------------------------------


def test_a_fifo_is_refused_at_once_and_the_engine_keeps_answering(served):
    server, slots, _, _ = served
    os.mkfifo(slots / "pipe.bin")
    assert error(post(server, "/slots/0?action=restore", {"filename": "pipe.bin"})) == (
        400, "Unable to restore slot: 'pipe.bin': not a regular file")
    assert chat(server).status_code == 200  # the engine thread never waited on the FIFO
    assert (slots / "pipe.bin").exists()


@pytest.mark.parametrize("make, why", [
    (lambda d: os.symlink("loop.bin", d / "loop.bin"), "the name is a symbolic link (slot files are regular files)"),
    (lambda d: os.symlink(d / "target.bin", d / "link.bin"), "the name is a symbolic link (slot files are regular files)"),
    (lambda d: (d / "dir.bin").mkdir(), "the name is a directory"),
])
def test_links_and_directories_are_400_without_a_path(served, make, why):
    server, slots, key, expect = served
    (slots / "target.bin").write_bytes(slot_file.encode(_slot([1, 2, 3]), expect, key))
    make(slots)
    name = sorted(p.name for p in slots.iterdir() if p.is_symlink() or p.is_dir())[0]
    r = post(server, "/slots/0?action=restore", {"filename": name})
    assert error(r) == (400, f"Unable to restore slot: '{name}': {why}")
    assert str(slots) not in r.text and "/tmp" not in r.text


def test_a_save_replaces_a_link_and_never_writes_through_it(served, tmp_path):
    server, slots, _, _ = served
    outside = tmp_path / "outside.txt"
    outside.write_text("not yours")
    os.symlink(outside, slots / "planted.bin")
    r = post(server, "/slots/0?action=save", {"filename": "planted.bin"})
    assert r.status_code == 200, r.text
    assert outside.read_text() == "not yours"
    assert not (slots / "planted.bin").is_symlink() and (slots / "planted.bin").stat().st_size == r.json()["n_written"]
    (slots / "taken.bin").mkdir()
    r = post(server, "/slots/0?action=save", {"filename": "taken.bin"})
    assert (r.status_code, r.json()["error"]["message"]) == (500, "Unable to save slot: 'taken.bin': the name is a directory")
    assert str(slots) not in r.text


# --- erase needs no body ---------------------------------------------------------------------------


def test_erase_takes_no_body_and_no_content_type(served):
    server, _, _, _ = served
    for content_type in (None, "application/json"):
        r = post(server, "/slots/1?action=erase", content_type=content_type)
        assert r.status_code == 200, r.text
        assert r.json()["id_slot"] == 1
    # a body still needs its JSON content type
    assert post(server, "/slots/1?action=erase", {"model": "x"}, content_type="text/plain").status_code == 415


def test_get_slots_says_what_the_pages_hold(served):
    server, _, _, _ = served
    assert [s["cache_type"] for s in slots_of(server)] == ["f16", "f16"]


# --- whose slots, with several models loaded -------------------------------------------------------


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    d = tmp_path_factory.mktemp("slotreg")
    model, fork = tiny_model(d / "m")
    reg = registry_dir(d / "reg", ["Model-A.Q8_0.gguf", "Model-B.Q8_0.gguf"])
    s = FakeServer(model, fork, registry=reg, max_loaded=3, flags=["--slot-dir", str(d / "slots")])
    yield s
    s.stop()


def test_with_several_models_loaded_a_slot_action_names_its_model(registry):
    s = registry
    assert post(s, "/slots/0?action=erase").status_code == 200  # one model loaded: it is meant
    assert chat(s, "model-a.q8_0").status_code == 200  # now two
    for r in (post(s, "/slots/0?action=erase"), post(s, "/slots/0?action=save", {"filename": "x.bin"}),
              httpx.get(s.url("/slots"), timeout=HANG_GUARD_S)):
        status, message = error(r)
        assert status == 400 and "several models are loaded" in message, message
        assert "model-a.q8_0" in message and "tiny-model.q8_0" in message
    assert post(s, "/slots/0?action=erase", {"model": "model-a.q8_0"}).status_code == 200
    assert post(s, "/slots/0?action=erase&model=tiny-model.q8_0").status_code == 200
    r = post(s, "/slots/0?action=save", {"filename": "a.bin", "model": "model-a.q8_0"})
    assert r.status_code == 200, r.text
    assert len(slots_of(s, "?model=model-a.q8_0")) == 1
    status, message = error(post(s, "/slots/0?action=erase", {"model": "model-b.q8_0"}))
    assert status == 400 and "'model-b.q8_0' is not loaded" in message
    assert post(s, "/slots/0?action=erase", {"model": "nobody"}).status_code == 404
    assert error(post(s, "/slots/0?action=erase", {"model": 7}))[0] == 400
