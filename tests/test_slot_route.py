"""`POST /slots/{id}?action=save|restore|erase` (gateway/openai/slots.py): llama-server's refusals, in its
order, on the fake engine; a save and a restore across a restart of the real server, on a tiny model."""

from __future__ import annotations

import hashlib
import hmac
import json

import httpx
import pytest
from gateway_helpers import CliServer, FakeServer, tiny_model

from gateway.openai.slots import filename_ok
from model import slot_file


def post(server, path: str, body=None, upstream: bool = False) -> httpx.Response:
    content = b"" if body is None else body.encode() if isinstance(body, str) else json.dumps(body).encode()
    return httpx.post(server.url(path, upstream), content=content, headers={"Content-Type": "application/json"},
                      timeout=120)


def error(r: httpx.Response) -> tuple[int, str, str]:
    e = r.json()["error"]
    return r.status_code, e["type"], e["message"]


@pytest.mark.parametrize("name, ok", [
    ("slot1.bin", True), ("a b.bin", True), ("ünïcode.bin", True), ("x" * 255, True), ("é" * 128, False),
    ("", False), ("..", False), (".", False), ("x.", False), (" x", False), ("x ", False), ("../evil.bin", False),
    ("sub/evil.bin", False), ("a\\b", False), ("a:b", False), ("a*b", False), ("a?b", False), ('a"b', False),
    ("a<b", False), ("a>b", False), ("a|b", False), ("a\x00b", False), ("a\nb", False), ("a\x7fb", False),
    ("a\x85b", False), ("a\ufffdb", False), ("\ufeffa", False), ("a\uff0eb", False), ("a\u2215b", False),
    ("a\u2216b", False), ("\ud800", False),
])
def test_filename_ok_is_llama_cpps_rule(name, ok):
    assert filename_ok(name) is ok


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    d = tmp_path_factory.mktemp("slotroute")
    model, fork = tiny_model(d / "m")
    s = FakeServer(model, fork, flags=["--slot-dir", str(d / "slots")])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def fake_without_dir(tmp_path_factory):
    model, fork = tiny_model(tmp_path_factory.mktemp("noslots"))
    s = FakeServer(model, fork)
    yield s
    s.stop()


def test_without_a_slot_dir_it_is_llama_servers_501(fake_without_dir):
    for path in ("/slots/0?action=save", "/slots/abc?action=nothing", "/slots/0"):
        for upstream in (False, True):
            assert error(post(fake_without_dir, path, {"filename": "x.bin"}, upstream)) == (
                501, "not_supported_error",
                "This server does not support slots action. Start it with `--slot-save-path`")


@pytest.mark.parametrize("path, body, message", [
    ("/slots/abc?action=save", {"filename": "x.bin"}, "Invalid slot ID"),
    ("/slots/-1?action=save", {"filename": "x.bin"}, "Invalid slot ID"),
    ("/slots/2147483648?action=save", {"filename": "x.bin"}, "Invalid slot ID"),  # past std::stoi's int
    ("/slots/?action=save", {"filename": "x.bin"}, "Invalid slot ID"),
    ("/slots/0?action=frobnicate", {"filename": "x.bin"}, "Invalid action"),
    ("/slots/0", {"filename": "x.bin"}, "Invalid action"),
    ("/slots/abc?action=frobnicate", {"filename": "x.bin"}, "Invalid slot ID"),  # the id is checked first
    ("/slots/0?action=save", {"filename": "../evil.bin"}, "Invalid filename"),
    ("/slots/0?action=restore", {"filename": "sub/evil.bin"}, "Invalid filename"),
    ("/slots/0?action=save", {"filename": ".."}, "Invalid filename"),
    ("/slots/0?action=save", {"filename": ""}, "Invalid filename"),
    ("/slots/0?action=save", {}, "Invalid filename"),
    ("/slots/0?action=restore", {"filename": 1}, "Invalid filename"),
    ("/slots/0?action=save", None, "Invalid filename"),
])
def test_refusals_in_llama_servers_order(fake, path, body, message):
    assert error(post(fake, path, body)) == (400, "invalid_request_error", message)


def test_other_methods_and_paths_are_not_slot_actions(fake):
    assert httpx.get(fake.url("/slots/0?action=save"), timeout=10).status_code == 404
    assert post(fake, "/slots/0/x?action=save", {"filename": "x.bin"}).status_code == 404


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("slotlive")
    model, fork = tiny_model(d)
    return model, fork, d / "slots"


def _server(bankml_cmd, tiny) -> CliServer:
    model, fork, slots = tiny
    return CliServer(bankml_cmd, str(model), "--fork", str(fork), "--ctx", "256", "--config", "cpu",
                     "--slot-dir", str(slots))


def _complete(server, prompt: str, id_slot: int, n: int = 12) -> dict:
    r = post(server, "/completion", {"prompt": prompt, "n_predict": n, "temperature": 0, "id_slot": id_slot,
                                     "cache_prompt": True})
    assert r.status_code == 200, r.text
    return r.json()


def _n_prompt_tokens(server, slot: int):
    return next(s for s in httpx.get(server.url("/slots"), timeout=10).json() if s["id"] == slot).get("n_prompt_tokens")


def test_a_conversation_restored_after_a_restart_continues_the_same(bankml_cmd, tiny):
    slots = tiny[2]
    first_prompt = "the quick brown fox jumps over the lazy dog, then " * 2
    a = _server(bankml_cmd, tiny)
    try:
        assert _n_prompt_tokens(a, 1) is None  # never ran
        first = _complete(a, first_prompt, 1)
        assert first["id_slot"] == 1
        assert _n_prompt_tokens(a, 1) == first["tokens_cached"]
        r = post(a, "/slots/1?action=save", {"filename": "conv.bin"})
        assert r.status_code == 200, r.text
        saved = r.json()
        assert saved["id_slot"] == 1 and saved["filename"] == "conv.bin"
        assert saved["n_saved"] == first["tokens_cached"]
        assert saved["n_written"] == (slots / "conv.bin").stat().st_size and saved["timings"]["save_ms"] > 0
        assert sorted(p.name for p in slots.iterdir()) == ["conv.bin"]  # no .tmp left behind
        follow_up = first_prompt + first["content"] + " and again"
        want = _complete(a, follow_up, 0)
    finally:
        a.stop()

    b = _server(bankml_cmd, tiny)  # a restart: an empty cache
    try:
        n_slots = len(httpx.get(b.url("/slots"), timeout=10).json())
        r = post(b, f"/slots/{n_slots + 1}?action=restore", {"filename": "conv.bin"})  # wraps to slot 1
        assert r.status_code == 200, r.text
        assert r.json()["n_restored"] == saved["n_saved"] and r.json()["n_read"] == saved["n_written"]
        assert r.json()["id_slot"] == n_slots + 1
        assert _n_prompt_tokens(b, 1) == saved["n_saved"]
        got = _complete(b, follow_up, 0)
        assert got["content"] == want["content"]
        assert got["timings"]["cache_n"] == want["timings"]["cache_n"] > 0

        # a damaged file: refused with the reason, the slot emptied, the file left as it was
        data = bytearray((slots / "conv.bin").read_bytes())
        data[200] ^= 0xFF
        (slots / "bad.bin").write_bytes(bytes(data))
        assert error(post(b, "/slots/1?action=restore", {"filename": "bad.bin"})) == (
            400, "invalid_request_error", "Unable to restore slot: 'bad.bin': the file is damaged, or was not "
                                          "saved by this server (its MAC does not match)")
        assert _n_prompt_tokens(b, 1) == 0
        assert (slots / "bad.bin").read_bytes() == bytes(data)
        assert error(post(b, "/slots/1?action=restore", {"filename": "never.bin"}))[2] == (
            "Unable to restore slot: 'never.bin': the file does not exist")

        # erase: the slot's tokens are forgotten, and their pages in the cache
        post(b, "/slots/1?action=restore", {"filename": "conv.bin"})
        r = post(b, "/slots/1?action=erase")
        assert r.json() == {"id_slot": 1, "n_erased": saved["n_saved"]}
        assert _n_prompt_tokens(b, 1) == 0

        # forged K/V under the same tokens, sealed as anyone can (a recomputed sha256, the v1 format) or
        # with another key: refused, and none of their pages reach the next client's identical prompt
        for name, forged in _forgeries((slots / "conv.bin").read_bytes()).items():
            (slots / name).write_bytes(forged)
            status, _, message = error(post(b, "/slots/1?action=restore", {"filename": name}))
            assert status == 400 and message.startswith(f"Unable to restore slot: '{name}': "), message
            assert _n_prompt_tokens(b, 1) == 0
        assert _complete(b, follow_up, 0)["timings"]["cache_n"] == 0
    finally:
        b.stop()


def _forgeries(good: bytes) -> dict[str, bytes]:
    """`good` with its K/V changed (the tokens kept), resealed by someone without this server's key."""
    head = len(slot_file.MAGIC) + 64 + 3 * 8 + 8  # the first layer's K
    body = bytearray(good[:-32])
    body[head:head + 64] = bytes(64)  # the first cells' K, zeroed
    v1 = b"bankML slot v1\n" + bytes(body[len(slot_file.MAGIC):])
    return {"forged-v1.bin": v1 + hashlib.sha256(v1).digest(),
            "forged-sha.bin": bytes(body) + hashlib.sha256(bytes(body)).digest(),
            "forged-key.bin": bytes(body) + hmac.new(b"another server", bytes(body), hashlib.sha256).digest()}
