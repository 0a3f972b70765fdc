"""verify = guard, then pin: the one gate before any model is served.

The cheap check runs first: the guard reads only the header, with its own bounded parser. Only a
file that plays is hashed whole and compared with its pin. `Verified` is what every later step
(serve's startup, `GET /bankml`, each receipt) reports. `gate_model` is verify with the file's
identity taken before and after, as `bankml serve` gates its model at start and the native gateway
gates it again after the file changed: a file that changed while it was hashed is refused.
When the FORK.json names an OpenSSF model signature, it is verified after the pin (bankml/model_signature.py)
and the signer is recorded (`model_signer`); its paths are relative to the FORK.json, so callers pass
`fork_path`. Failures are bankml.errors classes: Unreadable, Truncated, Refused (NotPinned), FileChanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from bankml import __version__, jstr, model_signature
from bankml.errors import FileChanged, Refused, Truncated, Unreadable
from bankml.guard import guard_file
from bankml.pin import pin


@dataclass(frozen=True)
class FileIdentity:
    """What a per-request check compares: a changed file has another inode, size or mtime."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str | os.PathLike) -> FileIdentity:
        st = os.stat(path)
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class Verified:
    model_sha256: str
    arch: str | None
    name: str | None
    types: dict[str, int] = field(default_factory=dict)
    rule_set: str = "mainline"
    model_signer: str | None = None  # who signed the model (bankml.model_signature), None: not signed

    def as_dict(self) -> dict:
        out = {
            "verdict": "play",
            "guard": "play",
            "engine": self.rule_set,  # the Rust bankml's key: here "engine" is the guard's rule set
            "model_sha256": self.model_sha256,
            "bankml": __version__,
            "arch": self.arch,
            "name": self.name,
            "types": dict(self.types),
        }
        if self.model_signer is not None:  # only a signed model's record has it: the Rust shape stays
            out["model_signer"] = self.model_signer
        return out

    def to_json(self) -> str:
        return jstr.dumps(self.as_dict())


def verify(path: str | os.PathLike, fork_text: str, rule_set: str = "mainline",
           fork_path: str | None = None) -> Verified:
    """Guard the header, then pin the whole file, then check the signature the FORK.json (at `fork_path`)
    names, if any. Raises Unreadable, Truncated or Refused (NotPinned), with the Rust bankml's messages."""
    signature = model_signature.named(fork_text, fork_path)  # a malformed signer is refused before hashing
    try:
        report = guard_file(path, rule_set=rule_set)
    except OSError as e:
        raise Unreadable(f"cannot read {os.fspath(path)}: {e.strerror or e}") from e
    if report.verdict == "need_more":
        raise Truncated(f"guard needs {report.bytes_needed} header bytes: file truncated")
    if report.verdict != "play":
        raise Refused("guard refused: " + "; ".join(report.reasons))
    sha = pin(path, fork_text)
    signer = None if signature is None else model_signature.verify_signature(os.fspath(path), signature, sha)
    return Verified(model_sha256=sha, arch=report.arch, name=report.name, types=dict(report.types),
                    rule_set=report.rule_set, model_signer=signer)


@dataclass(frozen=True)
class GatedModel:
    """A model file that passed the gate."""

    path: str  # canonical
    verified: Verified
    identity: FileIdentity
    fork_text: str
    given: str = ""  # the path as given: a re-verification pins its basename, as the first one did
    fork_path: str | None = None  # the FORK.json file the pin was read from (a derived model records it)


def gate_model(path: str, fork_text: str, rule_set: str = "mainline", fork_path: str | None = None) -> GatedModel:
    """Take the file's identity, verify it, canonicalise the path and take the identity again.
    `fork_path`: the FORK.json the text was read from (a signature's paths are relative to it)."""
    try:
        before = FileIdentity.of(path)
    except OSError as e:
        raise Unreadable(f"cannot read {path}: {e.strerror or e}") from e
    verified = verify(path, fork_text, rule_set=rule_set, fork_path=fork_path)
    canonical = os.path.realpath(path)
    try:
        after = FileIdentity.of(canonical)
    except OSError as e:
        raise Unreadable(f"cannot read {path}: {e.strerror or e}") from e
    if after != before:
        raise FileChanged(f"{path} changed while it was being hashed: refused")
    return GatedModel(canonical, verified, after, fork_text, os.fspath(path), fork_path)


def refusal_json(reason: str) -> str:
    return jstr.dumps({"verdict": "refuse", "reason": reason, "bankml": __version__})
