"""Signed receipts: the key (made once, 0600, reused; a bad one refused), the signature of every answer's
receipt as a client parses it (/v1, /api, llama-server's routes, streamed or not, in front of
llama-server too), `GET /bankml/receipt-key`, `bankml receipt verify`, and the README's check.

The servers are the real gateway over the fake engine (tests/gateway_helpers.py) and P0 over the mock
llama-server (tests/p0_helpers.py), each with its own config directory in tmp.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import stat
import timeit
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from conftest import run_cli
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from gateway_helpers import FakeServer, free_port, tiny_model
from p0_helpers import Engine, Gateway, chat_body, receipt_event

from bankml import jstr, signing
from bankml.cli import main
from bankml.errors import ReceiptInvalid
from gateway.serving.receipt import Tally

pytestmark = pytest.mark.timeout(180)

README = Path(__file__).resolve().parents[1] / "docs" / "receipts.md"  # the check moved from the README
HI = [{"role": "user", "content": "Say hello."}]


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                      timeout=30)


def public_key(info: dict):
    return serialization.load_pem_public_key(info["public_key"].encode())


def key_file(path: Path, private, mode: int = 0o600) -> Path:
    path.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    path.chmod(mode)
    return path


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("signing") / "config" / "bankml"  # made by the server


@pytest.fixture(scope="module")
def pinned(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("signing-model"))


@pytest.fixture(scope="module")
def server(pinned, config_dir):
    s = FakeServer(*pinned, engine={"max_seqs": 2}, env={"BANKML_CONFIG_DIR": str(config_dir)})  # n = 2 too
    yield s
    s.stop()


@pytest.fixture(scope="module")
def key_info(server) -> dict:
    r = httpx.get(server.url("/bankml/receipt-key"), timeout=10)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    return r.json()


# --- the key ---------------------------------------------------------------------------------------------


def test_the_key_is_made_at_the_first_start_0600_in_a_0700_directory_then_reused(server, pinned, config_dir,
                                                                                   key_info):
    path = config_dir / signing.KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(config_dir.stat().st_mode) == 0o700
    pem = path.read_bytes()
    assert pem.startswith(b"-----BEGIN PRIVATE KEY-----\n")  # PKCS8, unencrypted
    private = serialization.load_pem_private_key(pem, password=None)
    raw = private.public_key().public_bytes_raw()
    assert key_info["key_id"] == hashlib.sha256(raw).hexdigest() and key_info["algorithm"] == "ed25519"
    assert base64.b64decode(key_info["public_key_raw"]) == raw
    assert list(key_info) == ["key_id", "algorithm", "public_key", "public_key_raw"]
    assert f"receipts signed with {path} (key_id {key_info['key_id']})" in server.log()
    again = FakeServer(*pinned, env={"BANKML_CONFIG_DIR": str(config_dir)})  # a second start: the same key
    try:
        assert httpx.get(again.url("/bankml/receipt-key"), timeout=10).json() == key_info
    finally:
        again.stop()
    assert path.read_bytes() == pem


def test_the_key_is_0600_from_its_creation_whatever_the_umask(tmp_path, monkeypatch):
    monkeypatch.setenv("BANKML_CONFIG_DIR", str(tmp_path / "a" / "bankml"))
    old = os.umask(0)
    try:
        made = signing.server_key("", "[serve] receipt_key")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(made.path).st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "a" / "bankml").stat().st_mode) == 0o700
    assert signing.server_key("", "[serve] receipt_key").key_id == made.key_id == signing.local_key().key_id


def test_the_config_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("BANKML_CONFIG_DIR")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert signing.config_dir() == tmp_path / "xdg" / "bankml"
    monkeypatch.setenv("XDG_CONFIG_HOME", "relative")  # the XDG spec: ignored
    monkeypatch.setenv("HOME", str(tmp_path))
    assert signing.config_dir() == tmp_path / ".config" / "bankml"
    monkeypatch.setenv("BANKML_CONFIG_DIR", str(tmp_path / "mine"))
    assert signing.config_dir() == tmp_path / "mine"


OPEN = "its group or others may use it"


def _bad_keys(d: Path) -> dict[str, tuple[Path, str]]:
    ed = Ed25519PrivateKey.generate()
    garbage = d / "garbage.pem"
    garbage.write_text("not a key\n")
    garbage.chmod(0o600)
    encrypted = d / "encrypted.pem"
    encrypted.write_bytes(ed.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.BestAvailableEncryption(b"secret")))
    encrypted.chmod(0o600)
    (d / "a-directory").mkdir()
    return {
        "missing": (d / "nope.pem", "cannot read it: No such file or directory"),
        "a directory": (d / "a-directory", "cannot read it: Is a directory"),
        "a device": (Path(os.devnull), "not a regular file"),
        "others may read it": (key_file(d / "open.pem", ed, 0o644), f"{OPEN} (mode 644)"),
        "its group may write": (key_file(d / "group.pem", ed, 0o620), f"{OPEN} (mode 620)"),
        "not ed25519": (key_file(d / "ec.pem", ec.generate_private_key(ec.SECP256R1())), "not an ed25519 key"),
        "not a key": (garbage, "not an unencrypted PEM private key"),
        "encrypted": (encrypted, "not an unencrypted PEM private key"),
    }


def test_a_bad_key_file_refuses_the_start_with_exit_2(tmp_path, bankml_cmd):
    models = tmp_path / "models"
    models.mkdir()
    for why, (path, says) in _bad_keys(tmp_path).items():
        r = run_cli(bankml_cmd, "serve", "--native", "--receipt-key", str(path),
                    env={"BANKML_MODELS": str(models)})
        assert r.returncode == 2, (why, r.stderr)
        assert r.stderr.startswith(f"bankml serve: refuse: --receipt-key {path}: {says}"), (why, r.stderr)
    config = tmp_path / "serve.toml"
    config.write_text(f'[serve]\nreceipt_key = "{tmp_path / "open.pem"}"\n')
    r = run_cli(bankml_cmd, "serve", "--native", "--config", str(config), env={"BANKML_MODELS": str(models)})
    assert r.returncode == 2 and "refuse: [serve] receipt_key " in r.stderr and "(mode 644)" in r.stderr
    assert not os.listdir(models)  # refused before the default model is fetched


def test_a_given_key_signs_and_none_is_made(tmp_path, pinned):
    private = Ed25519PrivateKey.generate()
    path = key_file(tmp_path / "mine.pem", private)
    s = FakeServer(*pinned, flags=["--receipt-key", str(path)],
                   env={"BANKML_CONFIG_DIR": str(tmp_path / "unused")})
    try:
        receipt = post(s.url("/v1/chat/completions"), {"messages": HI}).json()["bankml_receipt"]
        assert signing.verify(receipt, private.public_key()) == hashlib.sha256(
            private.public_key().public_bytes_raw()).hexdigest()
    finally:
        s.stop()
    assert not (tmp_path / "unused").exists()


# --- every answer's receipt, as the client parsed it -----------------------------------------------------


def _last_event(text: str) -> dict:
    return json.loads([e for e in text.split("\n\n") if e.startswith("data: {")][-1].removeprefix("data: "))


def _last_line(text: str) -> dict:
    return json.loads(text.splitlines()[-1])


ASKED = {  # every place a receipt is written: (path, body, the object of the answer's text that carries it)
    "/v1/chat/completions": ("/v1/chat/completions", {"messages": HI}, json.loads),
    "/v1/chat/completions, streamed": ("/v1/chat/completions", {"messages": HI, "stream": True}, _last_event),
    "/v1/chat/completions, n=2": ("/v1/chat/completions", {"messages": HI, "n": 2},
                                  lambda text: json.loads(text)["choices"][1]),
    "/v1/completions": ("/v1/completions", {"prompt": "Hi", "max_tokens": 3}, json.loads),
    "/completion, streamed": ("/completion", {"prompt": "Hi", "n_predict": 3, "stream": True}, _last_event),
    "/api/chat": ("/api/chat", {"messages": HI, "stream": False}, json.loads),
    "/api/chat, streamed": ("/api/chat", {"messages": HI}, _last_line),
    "/api/generate": ("/api/generate", {"prompt": "Hi", "stream": False}, json.loads),
    "/v1/embeddings": ("/v1/embeddings", {"input": ["Hello", "é"]}, json.loads),
    "/embedding": ("/embedding", {"content": "Hello"}, lambda text: json.loads(text)[0]),
    "/api/embed": ("/api/embed", {"input": "Hello"}, json.loads),
    "/api/embeddings": ("/api/embeddings", {"prompt": "Hello"}, json.loads),
}


@pytest.fixture(scope="module")
def receipts(server) -> dict[str, dict]:
    """One receipt per place, parsed from the answer as a client parses it."""
    out = {}
    for where, (path, body, carrier) in ASKED.items():
        r = post(server.url(path), body)
        assert r.status_code == 200, (where, r.text)
        out[where] = carrier(r.text)["bankml_receipt"]
    r = post(server.url("/v1/chat/completions", upstream=True), {"messages": HI})  # llama-server's address
    out["/v1/chat/completions, engine address"] = r.json()["bankml_receipt"]
    return out


def test_every_receipt_is_signed_and_verifies(receipts, key_info):
    key = public_key(key_info)
    assert len(receipts) == len(ASKED) + 1
    for where, receipt in receipts.items():
        assert receipt["signed"] is True and list(receipt)[-3:] == ["signed", "key_id", "signature"], where
        assert signing.verify(receipt, key) == key_info["key_id"], where
        assert len(base64.b64decode(receipt["signature"], validate=True)) == 64


CHANGES = {  # field: (its new value, or how to change it; what verification says)
    "response_sha256": ("0" * 64, "signature does not match"),
    "request_sha256": ("0" * 64, "signature does not match"),
    "model_sha256": ("0" * 64, "signature does not match"),
    "prompt_tokens": (lambda n: n + 1, "signature does not match"),
    "engine": ("another engine", "signature does not match"),
    "signature": (base64.b64encode(bytes(64)).decode(), "signature does not match"),
    "key_id": ("0" * 64, "key_id does not match the key"),
    "signed": (False, "receipt is not signed"),
}


@pytest.mark.parametrize("field", list(CHANGES))
def test_a_changed_receipt_fails(receipts, key_info, field):
    change, says = CHANGES[field]
    for where in ("/v1/chat/completions", "/v1/chat/completions, streamed", "/api/chat, streamed"):
        receipt = dict(receipts[where])
        receipt[field] = change(receipt[field]) if callable(change) else change
        with pytest.raises(ReceiptInvalid, match=says):
            signing.verify(receipt, public_key(key_info))


def test_another_key_and_an_unsigned_receipt_fail(receipts):
    receipt = receipts["/v1/chat/completions"]
    with pytest.raises(ReceiptInvalid, match="key_id does not match the key"):
        signing.verify(receipt, Ed25519PrivateKey.generate().public_key())
    unsigned = {k: v for k, v in receipt.items() if k not in ("key_id", "signature")} | {"signed": False}
    with pytest.raises(ReceiptInvalid, match="receipt is not signed"):
        signing.verify(unsigned, Ed25519PrivateKey.generate().public_key())


def test_the_canonical_bytes(key_info, receipts):
    receipt = receipts["/v1/chat/completions"]
    unsigned = {k: v for k, v in receipt.items() if k != "signature"}
    canonical = signing.canonical(unsigned)
    assert canonical == json.dumps(unsigned, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    assert list(json.loads(canonical)) == sorted(unsigned) and b'"signed":true,"ttft_ms":' in canonical
    assert signing.canonical({"signed": True, "b": "é\n😀", "a": 1, "n": None}) == (
        b'{"a":1,"b":"\\u00e9\\n\\ud83d\\ude00","n":null,"signed":true}')  # the README's description
    public_key(key_info).verify(base64.b64decode(receipt["signature"]), canonical)


def test_a_receipt_with_any_text_verifies_as_parsed_from_the_wire():
    """Non-ASCII, control characters and a lone surrogate in a string (the engine's name comes from
    llama-server's /props): the receipt parsed from jstr's text is the one that was signed."""
    key = signing.ReceiptKey(Ed25519PrivateKey.generate(), "")
    tally = Tally.start(b'{"x": 1}', key)
    tally.sent("é 😀\t\"\\")
    verified = SimpleNamespace(model_sha256="ab" * 32)
    receipt = tally.receipt("llama.cpp b1 \ud800 ünïcode\n\x01 server", verified, "cd" * 32)
    parsed = json.loads(jstr.dumps(receipt))
    assert parsed["engine"] == "llama.cpp b1 \ufffd ünïcode\n\x01 server"
    assert signing.verify(parsed, key.public) == key.key_id
    assert all(type(v) in (str, int, bool) or v is None for v in parsed.values())


def test_signing_costs_tens_of_microseconds(receipts):
    """Sign + canonical bytes of a realistic receipt (the value is in the report, not a bound to race)."""
    key = signing.ReceiptKey(Ed25519PrivateKey.generate(), "")
    unsigned = {k: v for k, v in receipts["/v1/chat/completions"].items()
                if k not in ("signed", "key_id", "signature")}
    n = 2000
    us = min(timeit.repeat(lambda: key.sign(unsigned), number=n, repeat=3)) / n * 1e6
    print(f"signing one receipt: {us:.1f} us")
    assert us < 5000


# --- GET /bankml/receipt-key and `bankml receipt verify` ------------------------------------------------


def test_the_receipt_key_route_matches_the_key_file(key_info, config_dir):
    local = signing.read_key(str(config_dir / signing.KEY_FILE), "the receipt key")
    assert key_info == local.public_info()
    assert key_info["public_key"].startswith("-----BEGIN PUBLIC KEY-----\n")


def _verify(capsys, *args: str) -> tuple[int, str]:
    code = main(["receipt", "verify", *args])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_the_cli_verifies(tmp_path, capsys, monkeypatch, server, receipts, key_info, config_dir):
    pub = tmp_path / "key.pem"
    pub.write_text(key_info["public_key"])
    answer = tmp_path / "answer.json"
    answer.write_text(post(server.url("/v1/chat/completions"), {"messages": HI}).text)  # the whole answer
    valid = f"valid (key_id {key_info['key_id']}; the key in {pub})\n"
    assert _verify(capsys, str(answer), "--key", str(pub)) == (0, valid)
    bare = tmp_path / "receipt.json"
    bare.write_text(json.dumps(receipts["/api/chat, streamed"]))
    assert _verify(capsys, str(bare), "--key", str(pub)) == (0, valid)
    event = {"choices": [], "bankml_receipt": receipts["/v1/chat/completions, streamed"]}
    sse_line = "data: " + json.dumps(event)
    monkeypatch.setattr("sys.stdin", io.StringIO(sse_line))
    assert _verify(capsys, "-", "--key", str(pub)) == (0, valid)
    # without --key: the running server's key, fetched, in a shell with another config directory
    monkeypatch.setenv("BANKML_CONFIG_DIR", str(tmp_path / "elsewhere"))
    url = server.url("")
    assert _verify(capsys, str(bare), "--server", url) == (
        0, f"valid (key_id {key_info['key_id']}; the key of the server at {url})\n")
    code, said = _verify(capsys, str(bare), "--server", f"http://127.0.0.1:{free_port()}")
    assert code == 1 and said.startswith("no server at http://127.0.0.1:")  # named, and no fallback
    # no --server and none at [serve] listen's address: the config directory's key file, said so
    from dataclasses import replace

    from bankml import config as config_module

    nowhere = replace(config_module.load_config(None).serve, listen=f"127.0.0.1:{free_port()}")
    monkeypatch.setattr(config_module, "load_config", lambda preset=None: replace(config_module.Config(), serve=nowhere))
    monkeypatch.setenv("BANKML_CONFIG_DIR", str(config_dir))
    code, said = _verify(capsys, str(bare))
    assert code == 0 and said.startswith(f"valid (key_id {key_info['key_id']}; the key file {config_dir}")
    assert "no server answers at" in said

    for field in ("response_sha256", "request_sha256", "model_sha256"):
        changed = dict(receipts["/v1/chat/completions"])
        changed[field] = "0" * 64
        bare.write_text(json.dumps(changed))
        said = _verify(capsys, str(bare), "--key", str(pub))
        assert said == (2, "invalid: signature does not match\n"), field
    for text, why in (("{not json", "not JSON"), ('{"choices": []}', "no receipt in it"),
                      (json.dumps({"bankml_receipt": {"signed": False}}), "receipt is not signed")):
        bare.write_text(text)
        code, said = _verify(capsys, str(bare), "--key", str(pub))
        assert code == 2 and said.startswith(f"invalid: {why}"), text
    other = tmp_path / "other.pem"
    other.write_bytes(Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    bare.write_text(json.dumps(receipts["/v1/chat/completions"]))
    assert _verify(capsys, str(bare), "--key", str(other)) == (2, "invalid: key_id does not match the key\n")

    assert _verify(capsys, str(tmp_path / "absent.json"))[0] == 1  # cannot read: 1, as every command
    assert _verify(capsys, str(bare), "--key", str(bare)) == (1, f"{bare}: not an ed25519 public key (PEM)\n")
    monkeypatch.setenv("BANKML_CONFIG_DIR", str(tmp_path / "no-key-here"))
    code, said = _verify(capsys, str(bare))
    assert code == 1 and said.startswith("no receipt key at ") and not (tmp_path / "no-key-here").exists()


def test_the_installed_command_verifies_and_refuses(tmp_path, bankml_cmd, receipts, key_info):
    pub = tmp_path / "key.pem"
    pub.write_text(key_info["public_key"])
    receipt = tmp_path / "receipt.json"
    receipt.write_text(json.dumps(receipts["/v1/chat/completions"]))
    r = run_cli(bankml_cmd, "receipt", "verify", str(receipt), "--key", str(pub))
    assert (r.returncode, r.stdout) == (0, f"valid (key_id {key_info['key_id']}; the key in {pub})\n")
    receipt.write_text(json.dumps({**receipts["/v1/chat/completions"], "response_sha256": "0" * 64}))
    r = run_cli(bankml_cmd, "receipt", "verify", str(receipt), "--key", str(pub))
    assert (r.returncode, r.stdout) == (2, "invalid: signature does not match\n")
    r = run_cli(bankml_cmd, "receipt")
    assert r.returncode == 1 and "ACTION" in r.stderr  # bad usage, as every command


# --- in front of llama-server ----------------------------------------------------------------------------


def test_p0_receipts_are_signed_plain_and_streamed(tmp_path):
    model, fork = tiny_model(tmp_path / "models")
    engine = Engine(tmp_path / "engine")
    g = Gateway(model, fork, "--spawn", str(engine.bin), "--upstream", f"127.0.0.1:{free_port()}",
                env={"BANKML_CONFIG_DIR": str(tmp_path / "config")})
    try:
        assert g.ready, g.log()
        info = httpx.get(g.url("/bankml/receipt-key"), timeout=10).json()
        key = public_key(info)
        plain = g.post(chat_body()).json()["bankml_receipt"]
        with httpx.stream("POST", g.url("/v1/chat/completions"), content=chat_body(stream=True),
                          headers={"Content-Type": "application/json"}, timeout=30) as s:
            streamed = receipt_event(s.read().decode())
        for receipt in (plain, streamed):
            assert signing.verify(receipt, key) == info["key_id"]
            with pytest.raises(ReceiptInvalid, match="signature does not match"):
                signing.verify({**receipt, "response_sha256": "0" * 64}, key)
        path = tmp_path / "config" / signing.KEY_FILE
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert signing.read_key(str(path), "the receipt key").key_id == info["key_id"]
    finally:
        g.stop()


# --- the README's check ----------------------------------------------------------------------------------


def readme_check():
    """The README's `receipt_is_valid`, run as it is written there."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    code = [b for b in blocks if "def receipt_is_valid" in b]
    assert len(code) == 1
    namespace: dict = {}
    exec(code[0], namespace)
    return namespace["receipt_is_valid"]


def test_the_readmes_lines_verify_a_real_receipt(receipts, key_info):
    receipt_is_valid = readme_check()
    for where, receipt in receipts.items():
        assert receipt_is_valid(receipt, key_info["public_key"]) is True, where
    receipt = receipts["/v1/chat/completions"]
    assert receipt_is_valid({**receipt, "response_sha256": "0" * 64}, key_info["public_key"]) is False
    assert receipt_is_valid({**receipt, "signed": False}, key_info["public_key"]) is False
    other = Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    assert receipt_is_valid(receipt, other) is False
