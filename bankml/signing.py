"""Signed receipts (README, "Signed receipts"): the server's ed25519 key, and signing and checking a receipt.

The key is `--receipt-key FILE` / `[serve] receipt_key`, else receipt-key.pem in the user's config
directory ($BANKML_CONFIG_DIR, else $XDG_CONFIG_HOME/bankml, else ~/.config/bankml), made at the first
start (PEM, PKCS8, unencrypted; the directory 0700, the file 0600 from the moment it exists). A key
file that is missing (when given), unreadable, not an ed25519 private key, or open to its group or
others is refused: `ConfigInvalid`, and serve exits 2.

A receipt is signed over its canonical bytes: the receipt without `signature` (with `key_id` and
`signed`), as `json.dumps(r, sort_keys=True, separators=(",", ":"), ensure_ascii=True)` writes it,
so a client checks the object it parsed, whatever spacing and key order the wire had. `key_id` is the
hex sha256 of the raw 32-byte public key, `signature` the standard base64 of the 64-byte signature.
Imports neither sanic nor jax: `bankml receipt verify` uses it too.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import stat
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from bankml.errors import ConfigInvalid, ReceiptInvalid, Unreadable

KEY_FILE = "receipt-key.pem"
MAX_PEM_BYTES = 1 << 16  # an ed25519 PEM is 119 bytes


def config_dir() -> Path:
    """$BANKML_CONFIG_DIR, else $XDG_CONFIG_HOME/bankml (an absolute one, as the XDG spec says), else
    ~/.config/bankml."""
    env, xdg = os.environ.get("BANKML_CONFIG_DIR"), os.environ.get("XDG_CONFIG_HOME")
    if env:
        return Path(env)
    return Path(xdg) / "bankml" if xdg and os.path.isabs(xdg) else Path.home() / ".config" / "bankml"


def key_id(public: Ed25519PublicKey) -> str:
    return hashlib.sha256(public.public_bytes_raw()).hexdigest()


def canonical(receipt: dict) -> bytes:
    """The bytes a receipt's signature covers (`receipt` without its `signature`)."""
    return json.dumps(receipt, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


@dataclass(frozen=True)
class ReceiptKey:
    """The key serve signs every receipt with, and where it lives."""

    private: Ed25519PrivateKey
    path: str

    @cached_property
    def public(self) -> Ed25519PublicKey:
        return self.private.public_key()

    @cached_property
    def key_id(self) -> str:
        return key_id(self.public)

    def sign(self, receipt: dict) -> dict:
        """`receipt` with `"signed": true`, `key_id` and `signature` last."""
        out = {**receipt, "signed": True, "key_id": self.key_id}
        out["signature"] = base64.b64encode(self.private.sign(canonical(out))).decode("ascii")
        return out

    def public_info(self) -> dict[str, str]:
        """GET /bankml/receipt-key: what a client checks signatures with."""
        pem = self.public.public_bytes(serialization.Encoding.PEM,
                                       serialization.PublicFormat.SubjectPublicKeyInfo)
        return {"key_id": self.key_id, "algorithm": "ed25519", "public_key": pem.decode("ascii"),
                "public_key_raw": base64.b64encode(self.public.public_bytes_raw()).decode("ascii")}


# --- the server's key ----------------------------------------------------------------------------


def server_key(given: str, what: str) -> ReceiptKey:
    """The key serve signs with: the file `given` (named `what` in a refusal), which must exist, or
    with "" the config directory's, made there at the first start."""
    if given:
        return read_key(given, what)
    path = config_dir() / KEY_FILE
    try:
        return _make_key(path)
    except FileExistsError:
        return read_key(str(path), "the receipt key")


def local_key() -> ReceiptKey:
    """The config directory's key, as serve would use it; Unreadable when there is none (nothing is made)."""
    path = config_dir() / KEY_FILE
    if not path.exists():
        raise Unreadable(f"no receipt key at {path} (bankml serve makes it at its first start); "
                         "give --key PUB")
    try:
        return read_key(str(path), "the receipt key")
    except ConfigInvalid as e:
        raise Unreadable(e.message) from None


def read_key(path: str, what: str) -> ReceiptKey:
    """The ed25519 key of the PEM file `path`, only its owner's; else ConfigInvalid naming `what`."""
    path = os.path.abspath(os.path.expanduser(path))
    try:
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise ConfigInvalid(f"{what} {path}: not a regular file")
            data = f.read(MAX_PEM_BYTES)
    except OSError as e:
        raise ConfigInvalid(f"{what} {path}: cannot read it: {e.strerror or e}") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):  # as ssh refuses a private key others can read
        mode = stat.S_IMODE(info.st_mode)
        raise ConfigInvalid(f"{what} {path}: its group or others may use it (mode {mode:o}); chmod 600 {path}")
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise ConfigInvalid(f"{what} {path}: not an unencrypted PEM private key") from None
    if not isinstance(private, Ed25519PrivateKey):
        raise ConfigInvalid(f"{what} {path}: not an ed25519 key")
    return ReceiptKey(private, path)


def _make_key(path: Path) -> ReceiptKey:
    """A new key at `path`; FileExistsError if there is one already (O_EXCL: a key is never replaced)."""
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # 0600 before a byte is in it
    except FileExistsError:
        raise
    except OSError as e:
        raise ConfigInvalid(f"cannot make the receipt key {path}: {e.strerror or e}") from None
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return ReceiptKey(private, str(path))


# --- checking a receipt --------------------------------------------------------------------------


class NoServer(Unreadable):
    """No server answered at the address (connection refused, or none within the timeout)."""


def server_public_key(url: str, api_key: str | None = None, timeout_s: float = 5.0) -> Ed25519PublicKey:
    """The key a running server signs with: GET `url`/bankml/receipt-key (bounded: at most MAX_PEM_BYTES
    read). Raises NoServer when nothing answers there, Unreadable when it answers anything but a key."""
    import urllib.error
    import urllib.request

    where = url.rstrip("/") + "/bankml/receipt-key"
    request = urllib.request.Request(where, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:  # noqa: S310 (an http URL the user gives)
            body = r.read(MAX_PEM_BYTES)
    except urllib.error.HTTPError as e:
        hint = ": give --api-key KEY, or --key PUB" if e.code == 401 else ""
        raise Unreadable(f"{where}: HTTP {e.code}{hint}") from None
    except (urllib.error.URLError, OSError) as e:
        raise NoServer(f"no server at {url} ({getattr(e, 'reason', None) or e})") from None
    try:
        pem = json.loads(body)["public_key"].encode("ascii")
        public = serialization.load_pem_public_key(pem)
    except (ValueError, KeyError, TypeError, AttributeError, UnsupportedAlgorithm):
        public = None
    if not isinstance(public, Ed25519PublicKey):
        raise Unreadable(f"{where} gave no ed25519 public key: is it a bankml server?")
    return public


def read_public_key(path: str) -> Ed25519PublicKey:
    """A public key PEM file (GET /bankml/receipt-key's `public_key`). Raises Unreadable."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PEM_BYTES)
    except OSError as e:
        raise Unreadable(f"cannot read {path}: {e.strerror or e}") from None
    try:
        public = serialization.load_pem_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        public = None
    if not isinstance(public, Ed25519PublicKey):
        raise Unreadable(f"{path}: not an ed25519 public key (PEM)")
    return public


def receipt_in(text: str) -> dict:
    """The receipt in `text`: a receipt object, or an answer (an SSE `data:` line too) whose top level
    has `bankml_receipt`. Raises ReceiptInvalid."""
    try:
        value = json.loads(text.strip().removeprefix("data:"))
    except (ValueError, RecursionError):
        raise ReceiptInvalid("not JSON") from None
    if isinstance(value, dict) and isinstance(value.get("bankml_receipt"), dict):
        return value["bankml_receipt"]
    if isinstance(value, dict) and ("signature" in value or "signed" in value):
        return value
    raise ReceiptInvalid("no receipt in it (a receipt object, or an answer with bankml_receipt at its "
                         "top level)")


def verify(receipt: Any, public: Ed25519PublicKey) -> str:
    """The key_id of `receipt` when `public` signed it as it is; else ReceiptInvalid saying why."""
    if not isinstance(receipt, dict):
        raise ReceiptInvalid("not a receipt (a JSON object)")
    if receipt.get("signed") is not True or "signature" not in receipt:
        raise ReceiptInvalid("receipt is not signed")
    if receipt.get("key_id") != key_id(public):
        raise ReceiptInvalid("key_id does not match the key")
    try:
        signature = base64.b64decode(receipt["signature"], validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise ReceiptInvalid("signature is not base64") from None
    try:
        public.verify(signature, canonical({k: v for k, v in receipt.items() if k != "signature"}))
    except InvalidSignature:
        raise ReceiptInvalid("signature does not match") from None
    return receipt["key_id"]
