"""The served model's life behind the gate: resident, checked before each answer, verified again.

One model, the startup one (the registry of other pins is a later issue):
- bankml serve gated it before anything else; it is loaded and warmed on the engine thread before
  any socket is bound (`load_startup`);
- before each /v1 answer (`acquire`) the file's identity (device, inode, size, mtime) is compared with
  what was verified. A change drops the engine, issues no receipt, and makes the model unusable: a
  503 "<file> changed since bankml verified it: unloaded, and refused; the next request verifies it
  again" (ModelUnusable), which `/health` answers too, so a balancer routes away;
- while nothing is resident, each `acquire` runs the whole gate again (guard, then the sha256 pin
  against the same FORK.json text). Until the file verifies, every answer is that same 503 (why the
  gate refused goes to the log); a file put back as it was verifies and serves again. A failed load
  is a 500 (EngineFailed), and the model stays unusable until a load succeeds;
- any `model` name is answered by the one model, as llama-server answers whatever name a client
  sends (clients hard-code names); the answer's `model` field says what answered;
- llama-server's routes use the resident model as it is, or acquire the startup one (`current`).
An asyncio lock orders checks, verifications and loads; generations run outside it, on the engine
thread, which also orders the unload and the load after whatever it is running.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from bankml import __version__
from bankml.errors import BankmlError, EngineFailed, ModelUnusable
from bankml.verify import FileIdentity, GatedModel, Verified, gate_model
from gateway.engine_client import EngineClient
from gateway.native_model import NativeModel
from gateway.request_fields import gguf_defaults
from model.tokenizer_gguf import gguf_fields

log = logging.getLogger("bankml.gateway")

# Loader: the verified canonical path -> (engine, a few words on the backend). Runs on the engine thread.
Loader = Callable[[str], tuple[Any, str]]



def model_name(text: str) -> str:
    """A pin's name: the file stem, lower-cased, `.gguf` dropped (any path before it ignored)."""
    name = text.strip().rsplit("/", 1)[-1].lower()
    return name[:-5] if name.endswith(".gguf") else name


@dataclass(frozen=True)
class Loaded:
    """A model behind the gate, as a request holds it."""

    name: str
    file_name: str  # the basename as given: /v1/models' id and the answers' "model"
    path: str  # canonical, as hashed
    verified: Verified
    identity: FileIdentity
    hashed_at: int  # unix seconds, when it was loaded
    backend: str  # the receipt's "engine": the inference backend, not the guard's rule set
    model: NativeModel
    compile_s: float


class Residency:
    def __init__(self, gated: GatedModel, client: EngineClient, loader: Loader):
        self.gated = gated
        self.given = gated.given or gated.path
        self.file_name = os.path.basename(self.given)
        self.name = model_name(self.file_name)
        self.client = client
        self.loader = loader
        self.resident: Loaded | None = None
        self.last: Loaded | None = None  # the most recent verification, for GET /bankml
        self.unusable: BankmlError | None = None  # what every answer gets while nothing is resident
        self._lock = asyncio.Lock()
        # the request defaults (general.sampling.* from the verified header), read before any load so a
        # bad request is refused before any model work
        self.sampling_defaults = gguf_defaults(gguf_fields(gated.path, ("general.sampling.",)))

    @property
    def names(self) -> list[str]:
        return [self.name]

    # --- loading (on the engine thread) ----------------------------------------------------------

    def _load_on_thread(self, gated: GatedModel) -> Loaded:
        thread = self.client.thread
        thread.set_engine(None)  # one resident model: the old one goes before the new one is read
        engine, backend = self.loader(gated.path)
        thread.set_engine(engine)
        compile_s = float(engine.warmup())
        return Loaded(self.name, self.file_name, gated.path, gated.verified, gated.identity, int(time.time()),
                      f"bankML {__version__} native: its own forward pass ({backend})",
                      NativeModel.of(engine, gated.path), compile_s)

    def load_startup(self) -> Loaded:
        """Load and warm the startup model; blocks (before the event loop runs). Raises what the load raises."""
        loaded = self.client.thread.call(partial(self._load_on_thread, self.gated)).result()
        self.resident = self.last = loaded
        return loaded

    # --- per request ---------------------------------------------------------------------------

    async def current(self) -> Loaded:
        """llama-server's routes: the resident model as it is, or the startup model acquired."""
        return self.resident or await self.acquire()

    async def acquire(self) -> Loaded:
        """The model for one answer, its file checked against what was verified (see the module doc)."""
        async with self._lock:
            r = self.resident
            if r is not None:
                try:
                    now = FileIdentity.of(r.path)
                except OSError:
                    now = None
                if now == r.identity:
                    return r
                self.resident = None
                self.client.thread.call(partial(self.client.thread.set_engine, None))  # after what is running
                log.warning("%s changed since it was verified: unloaded", r.path)
                self.unusable = ModelUnusable(f"{r.file_name} changed since bankml verified it: unloaded, and "
                                              "refused; the next request verifies it again")
                raise self._unusable()
            return await self._verify_and_load()

    def _unusable(self) -> BankmlError:
        """A fresh copy of the standing error (one raised instance would collect every request's traceback)."""
        u = self.unusable
        return type(u)(u.message, **u.extra)

    async def _verify_and_load(self) -> Loaded:
        try:
            gated = await asyncio.to_thread(gate_model, self.given, self.gated.fork_text,
                                            self.gated.verified.rule_set)
        except BankmlError as e:  # Unreadable, Refused, FileChanged: still not the verified file
            log.warning("%s does not verify: %s", self.given, e)
            raise (self._unusable() if self.unusable else e) from None
        log.info("%s verified again (sha256 %s); loading it", gated.path, gated.verified.model_sha256)
        try:
            loaded = await self.client.call(partial(self._load_on_thread, gated))
        except Exception as e:
            self.unusable = EngineFailed(f"cannot load {gated.path}: {e}")
            raise self._unusable() from None
        self.resident = self.last = loaded
        self.unusable = None
        engine = self.client.thread.engine
        if hasattr(engine, "compile_in_background"):  # the reload warmed the essentials; the rest as at start
            engine.compile_in_background()
        return loaded
