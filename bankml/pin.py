"""The pin: a file's sha256 against the one its FORK.json records (the Rust bankml's FORK.json rules).

`pinned_sha256` parses the FORK.json for real (where the Rust bankml scans the text):
the first `files[]` entry whose `path` equals the file's base name, as given, no symlink resolved.
Hashing reads large blocks into one reused buffer, so hashlib (OpenSSL, SHA-NI where the CPU has it)
runs at memory speed with the GIL released.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
from pathlib import Path

from bankml import __version__
from bankml.errors import NotPinned, Refused, Unreadable
from bankml.progress import Progress, stderr_progress

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_BLOCK_BYTES = 1 << 20  # fits in L2: larger reads evict the data before it is hashed


def sha256_file(path: str | os.PathLike, progress: Progress | None = None) -> str:
    """Lowercase hex sha256 of the whole file; a progress line on a terminal (default: stderr's) while
    it runs, since a 70 GB file takes minutes."""
    digest = hashlib.sha256()
    buf = bytearray(_BLOCK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        label = f"bankml: hashing {os.path.basename(os.fspath(path))}"
        with (progress or stderr_progress()).step(label, size, "bytes") as step:
            while n := f.readinto(buf):
                digest.update(view[:n])
                step.advance(n)
    return digest.hexdigest()


def pinned_sha256(fork_text: str, name: str) -> str | None:
    """The pinned sha256 of `name` in a FORK.json's text, lowercased, or None when there is none.

    Only `files[].path` and `files[].sha256` are read. The first entry whose path equals `name`
    decides: if its sha256 is not 64 hex digits the answer is None, without looking further.
    """
    try:
        doc = json.loads(fork_text)
    except ValueError:
        return None
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, list):
        return None
    for entry in files:
        if isinstance(entry, dict) and entry.get("path") == name:
            sha = entry.get("sha256")
            if isinstance(sha, str) and _HEX64.fullmatch(sha):
                return sha.lower()
            return None
    return None


def pin(path: str | os.PathLike, fork_text: str) -> str:
    """Hash `path` and compare with its pin; return the sha256. Raises NotPinned, Unreadable (cannot
    hash) or Refused (another sha256), each with the Rust bankml's message."""
    name = os.path.basename(os.fspath(path))
    want = pinned_sha256(fork_text, name)
    if want is None:
        raise NotPinned(f"{name} has no sha256 record in FORK.json: unpinned, refused")
    try:
        got = sha256_file(path)
    except OSError as e:
        raise Unreadable(f"cannot hash {name}: {_os_error(e)}") from e
    if got != want:
        raise Refused(f"{name} sha256 {got} != pinned {want}: refused")
    return got


def _os_error(e: OSError) -> str:
    return e.strerror or str(e)


def fork_record(path: str | os.PathLike, sha256: str | None = None) -> dict:
    """A new FORK.json for a local file: its sha256 and size, and that it was hashed here."""
    p = Path(path)
    size = p.stat().st_size
    sha = sha256 or sha256_file(p)
    now = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "kind": "bankml fork (a local file pinned by its owner)",
        "pinned_from": f"sha256 of the local file {p.resolve()}, hashed by bankml {__version__} at {now}",
        "pinned_at_utc": now,
        "bankml": __version__,
        "files": [{"path": p.name, "bytes": size, "sha256": sha}],
    }
