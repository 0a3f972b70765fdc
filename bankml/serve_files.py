"""What `bankml serve` reads at start besides the model: API keys, allowed origins, a chat template file.

Each is read once, before any model is fetched, and checked; anything wrong is a `ConfigInvalid`
naming the flag (or key) and the reason, which serve prints as `bankml serve: refuse: ...` and exits 2.
- API keys (`--api-key KEY`, repeatable; `--api-key-file F` / `[serve] api_key_file`: one key per line,
  blank lines and `#` comments skipped): a key is 1-4096 visible ASCII characters (no whitespace, no
  control character: a header value carries it, and a key with a space or a newline cannot be sent
  the same way by every client); a file that cannot be read, is not UTF-8 or holds no key is refused.
  A key file that its group or others may read is served with a warning on stderr, as ssh warns.
  No key is ever printed: a message names the flag, the file and the line, never the key.
- allowed origins (`--allow-origin O,...`, `[serve] allowed_origins`): each a browser's serialized
  origin, scheme://host[:port], without path, query or trailing slash; scheme and host are lowered
  and a default port (80 for http, 443 for https) dropped, as a browser writes its Origin header.
  `*`, `null` and wildcards are refused: the loopback rule exists so that no web page can drive this
  server, and `*` would admit every page on the web.
- the chat template (`--chat-template-file F` / `[serve] chat_template_file`): at most 1 MiB of UTF-8
  that compiles in the Jinja sandbox (model/chat_template.py); its text (as llama-server keeps it: CRLF
  as LF, one trailing newline dropped) and the sha256 of its bytes are kept, and the file is not read
  again (a later change does not reach the server).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import sys
from dataclasses import dataclass

from bankml.errors import ConfigInvalid

MAX_KEY_CHARS = 4096
MAX_KEY_FILE_BYTES = 1 << 20
MAX_TEMPLATE_BYTES = 1 << 20  # the longest GGUF template we know of is about 20 KiB

_KEY = re.compile(r"[\x21-\x7e]+")  # visible ASCII: no space, no control, nothing a header would re-encode
_ORIGIN = re.compile(r"([a-z][a-z0-9+.\-]*)://([a-z0-9.\-]+|\[[0-9a-f:.]+\])(?::([0-9]{1,5}))?")
_DEFAULT_PORTS = {"http": "80", "https": "443"}


@dataclass(frozen=True)
class ChatTemplateFile:
    """A --chat-template-file, as read at start: it replaces the startup model's GGUF template."""

    path: str  # absolute
    text: str
    sha256: str  # of the file's bytes


def check_key(key: str, where: str) -> str:
    """`key` if it can be an API key; else ConfigInvalid naming `where` (never the key itself)."""
    if not key:
        raise ConfigInvalid(f"{where}: an empty API key")
    if len(key) > MAX_KEY_CHARS:
        raise ConfigInvalid(f"{where}: an API key longer than {MAX_KEY_CHARS} characters")
    if not _KEY.fullmatch(key):
        raise ConfigInvalid(f"{where}: an API key may hold only visible ASCII characters (no whitespace, no "
                            "control character)")
    return key


def flag_keys(values: list[str] | None) -> list[str]:
    """The --api-key values. llama-server splits its --api-key on commas; a key given here is taken whole,
    so a comma is refused rather than read either way."""
    keys = []
    for value in values or ():
        if "," in value:
            raise ConfigInvalid("--api-key: a key with a comma (llama-server reads a list there; bankml takes one "
                                "key per --api-key: repeat the flag)")
        keys.append(check_key(value, "--api-key"))
    return keys


def read_key_file(path: str, what: str) -> list[str]:
    """The keys of an API key file (one a line; blank lines and `#` comments skipped)."""
    path = os.path.expanduser(path)
    try:
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise ConfigInvalid(f"{what} {path}: not a regular file")
            data = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigInvalid(f"{what} {path}: cannot read it: {e.strerror or e}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ConfigInvalid(f"{what} {path}: over {MAX_KEY_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigInvalid(f"{what} {path}: not UTF-8 text") from None
    keys = []
    for n, line in enumerate(text.split("\n"), 1):  # not splitlines(): a \x0b inside a key is refused, not a line end
        line = line.removesuffix("\r")  # a CRLF's CR; blanks around a key are refused with it, never guessed away
        bare = line.strip(" \t")
        if bare and not bare.startswith("#"):
            keys.append(check_key(line, f"{what} {path} line {n}"))
    if not keys:
        raise ConfigInvalid(f"{what} {path}: no key in it (one per line; blank lines and # comments are skipped)")
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        print(f"bankml serve: warning: {what} {path} may be read by its group or others (mode "
              f"{stat.S_IMODE(info.st_mode):04o}); chmod 600 it", file=sys.stderr, flush=True)
    return keys


def parse_origin(text: str, what: str) -> str:
    """One allowed origin, serialized as a browser sends it in `Origin`."""
    t = text.strip(" \t")
    if t in ("*", "null") or "*" in t:
        raise ConfigInvalid(f"{what} {text!r}: only exact origins are admitted (scheme://host[:port]); a wildcard "
                            "or null would let any web page drive this loopback server")
    m = _ORIGIN.fullmatch(t.lower())
    port = m.group(3) if m else None
    if m is None or (port is not None and not 0 < int(port) < 65536):
        raise ConfigInvalid(f"{what} {text!r} is not an origin: scheme://host[:port], with no path or trailing /")
    scheme, host = m.group(1), m.group(2)
    if port is None or _DEFAULT_PORTS.get(scheme) == port:
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{int(port)}"


def parse_origins(values: list[str], what: str) -> tuple[str, ...]:
    """Origins from flags (each may be a comma-separated list) or a config list, deduplicated in order."""
    out: list[str] = []
    for value in values:
        for part in value.split(","):
            if part.strip(" \t"):
                origin = parse_origin(part, what)
                if origin not in out:
                    out.append(origin)
    return tuple(out)


def read_chat_template(path: str, what: str) -> ChatTemplateFile:
    """The template file's text, checked: bounded, UTF-8, and compiling in the Jinja sandbox."""
    from model.chat_template import TemplateError, compile_template

    path = os.path.abspath(os.path.expanduser(path))
    try:
        with open(path, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ConfigInvalid(f"{what} {path}: not a regular file")
            data = f.read(MAX_TEMPLATE_BYTES + 1)
    except OSError as e:
        raise ConfigInvalid(f"{what} {path}: cannot read it: {e.strerror or e}") from None
    if len(data) > MAX_TEMPLATE_BYTES:
        raise ConfigInvalid(f"{what} {path}: over {MAX_TEMPLATE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigInvalid(f"{what} {path}: not UTF-8 (byte {e.start})") from None
    if not text.strip():
        raise ConfigInvalid(f"{what} {path}: empty")
    # the source as llama-server holds it (and /props shows it, recorded): CRLF as LF, one trailing newline
    # dropped; rendering drops that newline anyway (model/chat_template.py). The sha256 is of the bytes.
    text = text.replace("\r\n", "\n").removesuffix("\n")
    try:
        compile_template(text)
    except TemplateError as e:
        raise ConfigInvalid(f"{what} {path}: {e}") from None
    return ChatTemplateFile(path, text, hashlib.sha256(data).hexdigest())
