"""verify = guard, then pin (gate.md §1): the one gate before any model is served.

The cheap check runs first: the guard reads only the header, with its own bounded parser. Only a
file that plays is hashed whole and compared with its pin. `Verified` is what every later step
(serve's startup, `GET /bankml`, each receipt) reports.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from bankml import __version__, jstr
from bankml.guard import guard_file
from bankml.pin import PinError, pin


class VerifyError(Exception):
    """verify refused. The message is the reason; its first word sets the CLI's exit code."""

    @property
    def exit_code(self) -> int:
        msg = str(self)
        if msg.startswith("cannot"):
            return 1
        if msg.startswith("guard needs"):
            return 3
        return 2


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
    engine: str = "mainline"

    def as_dict(self) -> dict:
        return {
            "verdict": "play",
            "guard": "play",
            "engine": self.engine,
            "model_sha256": self.model_sha256,
            "bankml": __version__,
            "arch": self.arch,
            "name": self.name,
            "types": dict(self.types),
        }

    def to_json(self) -> str:
        return jstr.dumps(self.as_dict())


def verify(path: str | os.PathLike, fork_text: str, engine: str = "mainline") -> Verified:
    """Guard the header, then pin the whole file. Raises VerifyError with the original's messages."""
    try:
        report = guard_file(path, engine=engine)
    except OSError as e:
        raise VerifyError(f"cannot read {os.fspath(path)}: {e.strerror or e}") from e
    if report.verdict == "need_more":
        raise VerifyError(f"guard needs {report.bytes_needed} header bytes: file truncated")
    if report.verdict != "play":
        raise VerifyError("guard refused: " + "; ".join(report.reasons))
    try:
        sha = pin(path, fork_text)
    except PinError as e:
        raise VerifyError(str(e)) from e
    return Verified(model_sha256=sha, arch=report.arch, name=report.name, types=dict(report.types),
                    engine=report.engine)


def refusal_json(reason: str) -> str:
    return jstr.dumps({"verdict": "refuse", "reason": reason, "bankml": __version__})
