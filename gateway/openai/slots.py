"""llama-server's `POST /slots/{id}?action=save|restore|erase` with `--slot-dir` (serving.md §6, §4.3).

The checks come in llama-server's order, each its answer: no slot directory is its 501; an id that
is not a number (negative, or past std::stoi's int) is "Invalid slot ID"; an action other than the
three (or none) is "Invalid action"; a file name that is missing, not a string, or not a plain name
(`filename_ok`, llama.cpp's fs_validate_filename without subdirectories) is "Invalid filename". Erase
takes no body (nor, with none, a JSON content type). An id past the slots wraps, as llama-server's
get_slot_by_id does (`id % slots`).

Whose slots: the model `model` names (in the body or the query, as llama-server's router takes it),
which must be loaded; without one, the only loaded model. With several loaded and none named it is a
400 naming them: the most recently used one would be whichever another client last asked for.
`GET /slots` (gateway/openai/llama_routes.py) picks its model the same way (`slot_model`).

The work is split so that nothing slow or hostile in the file system reaches the engine thread or the
event loop: the engine thread copies a slot's pages to or from the host (model/slots.py), and a
worker thread of this module's reads, checks, seals and writes the file (model/slot_file.py). A file
is sealed with an HMAC keyed from this server's receipt key, and a restore checks it before a byte
of K/V reaches the pool: a forged or altered file restores nothing, so it cannot answer another
client's prompt from the prefix cache. A save that fails is a 500 with its reason, a restore that
fails a 400 "Unable to restore slot: '<filename>': <reason>" (the slot emptied), as llama-server
answers a restore it cannot do with a 400; no reason names a server path.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from bankml import jstr
from bankml.errors import EngineFailed, InvalidRequest, NotServed
from gateway.http.body import parse_body
from gateway.http.errors import json_response
from gateway.http.sanic_app import query_of, takes_query
from model import slot_file
from model.slot_file import SlotFileError, SlotSaveFailed

NO_SLOT_DIR = "This server does not support slots action. Start it with `--slot-save-path`"
ACTIONS = ("save", "restore", "erase")
MAX_NAME_BYTES = 255
INT32_MAX = 2**31 - 1
# reserved on some file system, or a path separator (llama.cpp's fs_validate_filename)
_RESERVED = set(':*?"<>|/\\')
# look like a dot or a slash, or are not characters at all
_LOOKALIKES = {"\ufffd", "\ufeff", "\uff0e", "\u2215", "\u2216"}
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
# slot files are read and written here, one at a time: never on the engine thread, never on the loop,
# never in the default pool the answers use
_FILES = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bankml-slot-files")
T = TypeVar("T")


def filename_ok(name: str) -> bool:
    """A plain file name: 1 to 255 UTF-8 bytes, no path separator or reserved character, no control
    character, none of U+FFFD, U+FEFF, U+FF0E, U+2215, U+2216, no space at either end, no final dot."""
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate
        return False
    if not 0 < size <= MAX_NAME_BYTES or name[0] == " " or name[-1] in " .":
        return False
    return not (_CONTROL.search(name) or _RESERVED & set(name) or _LOOKALIKES & set(name))


# --- whose slots ----------------------------------------------------------------------------------


def model_named(body: Any, query: dict[str, list[str]]) -> str | None:
    """The `model` a slot request names: the body's, else the query's; None when it names none."""
    name = body.get("model") if isinstance(body, dict) else None
    if name is None:
        name = (query.get("model") or [None])[0]
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise InvalidRequest("'model' must be the name of a loaded model")
    return name


async def slot_model(state, name: str | None):
    """The loaded model (residency.Loaded) whose slots a request means: the one `name` resolves to,
    which must be loaded; without a name, the only loaded one (or the startup model, loaded now, when
    none is). InvalidRequest when it cannot be told, ModelNotFound for a name no pin has."""
    resident = state.residency.resident()
    if name is not None:
        pin = state.registry.resolve_openai(name).pin
        for loaded in resident:
            if loaded.name == pin.name:
                return loaded
        raise InvalidRequest(f"model '{pin.name}' is not loaded; slots belong to a loaded model's engine "
                             f"(loaded: {_names(resident)})")
    if len(resident) > 1:
        raise InvalidRequest(f"several models are loaded ({_names(resident)}): say whose slots with 'model'")
    return resident[0] if resident else await state.residency.current()


def _names(resident) -> str:
    return ", ".join(loaded.name for loaded in resident) or "none"


# --- the route ------------------------------------------------------------------------------------


@takes_query
async def slot_action(request, state):
    if state.slot_dir is None:
        raise NotServed(NO_SLOT_DIR)
    target = request.raw_url.decode("latin-1").partition("?")[0]
    id_text = target.removeprefix("/slots/")
    id_slot = int(id_text) if id_text.isascii() and id_text.isdigit() else -1
    if not 0 <= id_slot <= INT32_MAX:  # std::stoi's range
        raise InvalidRequest("Invalid slot ID")
    query = query_of(request)
    action = (query.get("action") or [""])[0]
    if action not in ACTIONS:
        raise InvalidRequest("Invalid action")
    body = parse_body(request.body) if request.body.strip() else {}
    filename = None
    if action != "erase":
        filename = body.get("filename") if isinstance(body, dict) else None
        if not isinstance(filename, str) or not filename_ok(filename):
            raise InvalidRequest("Invalid filename")
    loaded = await slot_model(state, model_named(body, query))
    async with state.residency.lease(loaded.pin) as held:  # not unloaded while its slot is worked on
        loaded = held.loaded
        slot = id_slot % max(1, loaded.client.max_seqs)
        if action == "erase":
            n_erased = await loaded.client.erase_slot(slot)
            # the id as asked, before the wrap (llama-server answers the task's id_slot)
            return json_response(jstr.dumps({"id_slot": id_slot, "n_erased": n_erased}))
        key = slot_file.mac_key(state.receipt_key.private.private_bytes_raw())
        if action == "save":
            return await _save(loaded, state.slot_dir, slot, id_slot, filename, key)
        return await _restore(loaded, state.slot_dir, slot, id_slot, filename, key)


async def _save(loaded, slot_dir: str, slot: int, id_slot: int, filename: str, key: bytes):
    t0 = time.perf_counter()
    client = loaded.client
    try:
        want = await client.slot_expect(loaded.verified.model_sha256)
        taken = await client.save_slot(slot)  # the engine thread: its pages to the host, once it is idle
        data = await _off_loop(lambda: slot_file.encode(taken, want, key))
        await _off_loop(lambda: slot_file.write(slot_dir, filename, data))
    except (SlotFileError, SlotSaveFailed) as e:
        raise EngineFailed(f"Unable to save slot: '{filename}': {e}") from None
    return json_response(jstr.dumps({"id_slot": id_slot, "filename": filename, "n_saved": len(taken.tokens),
                                     "n_written": len(data), "timings": {"save_ms": _ms_since(t0)}}))


async def _restore(loaded, slot_dir: str, slot: int, id_slot: int, filename: str, key: bytes):
    t0 = time.perf_counter()
    client = loaded.client
    try:
        want = await client.slot_expect(loaded.verified.model_sha256)
        data = await _off_loop(lambda: slot_file.read(slot_dir, filename, want.max_bytes()))
        restored = await _off_loop(lambda: slot_file.decode(data, want, key))  # the MAC first
        n_restored = await client.restore_slot(slot, restored)  # the engine thread, once the slot is idle
    except SlotFileError as e:
        await client.restore_slot(slot, None)  # any failure empties the slot (llama-server clears its cache)
        raise InvalidRequest(f"Unable to restore slot: '{filename}': {e}") from None
    return json_response(jstr.dumps({"id_slot": id_slot, "filename": filename, "n_restored": n_restored,
                                     "n_read": len(data), "timings": {"restore_ms": _ms_since(t0)}}))


async def _off_loop(fn: Callable[[], T]) -> T:
    return await asyncio.get_running_loop().run_in_executor(_FILES, fn)


def _ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3
