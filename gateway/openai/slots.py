"""llama-server's `POST /slots/{id}?action=save|restore|erase` with `--slot-dir` (serving.md §6, §4.3).

The checks come in llama-server's order, each its answer: no slot directory is its 501; an id that
is not a number (negative, or past std::stoi's int) is "Invalid slot ID"; an action other than the
three (or none) is "Invalid action"; a file name that is missing, not a string, or not a plain name (`filename_ok`,
llama.cpp's fs_validate_filename without subdirectories) is "Invalid filename". An id past the
slots wraps, as llama-server's get_slot_by_id does (`id % slots`). The action runs on the model's
engine thread once the slot is idle (model/slots.py): a save that fails is a 500 with its reason,
a restore that fails a 400 "Unable to restore slot: <reason>" (the slot emptied).
"""

from __future__ import annotations

import os
import re

from bankml import jstr
from bankml.errors import EngineFailed, InvalidRequest, NotServed
from gateway.http.body import parse_body
from gateway.http.errors import json_response
from gateway.http.sanic_app import query_of, takes_query
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


@takes_query
async def slot_action(request, state):
    if state.slot_dir is None:
        raise NotServed(NO_SLOT_DIR)
    target = request.raw_url.decode("latin-1").partition("?")[0]
    id_text = target.removeprefix("/slots/")
    id_slot = int(id_text) if id_text.isascii() and id_text.isdigit() else -1
    if not 0 <= id_slot <= INT32_MAX:  # std::stoi's range
        raise InvalidRequest("Invalid slot ID")
    action = (query_of(request).get("action") or [""])[0]
    if action not in ACTIONS:
        raise InvalidRequest("Invalid action")
    filename = None
    if action != "erase":
        body = parse_body(request.body) if request.body.strip() else {}
        filename = body.get("filename") if isinstance(body, dict) else None
        if not isinstance(filename, str) or not filename_ok(filename):
            raise InvalidRequest("Invalid filename")
    loaded = await state.residency.current()
    client = loaded.client
    slot = id_slot % max(1, client.max_seqs)
    sha256 = loaded.verified.model_sha256
    try:  # each waits for the slot to be idle, on the engine thread
        if action == "erase":
            n_erased = await client.erase_slot(slot)
        else:
            path = os.path.join(state.slot_dir, filename)
            done = await (client.save_slot if action == "save" else client.restore_slot)(slot, path, sha256)
    except SlotSaveFailed as e:
        raise EngineFailed(f"Unable to save slot: {e}") from None
    except SlotFileError as e:
        raise InvalidRequest(f"Unable to restore slot: {e}") from None
    # the id as asked, before the wrap (llama-server answers the task's id_slot)
    if action == "erase":
        return json_response(jstr.dumps({"id_slot": id_slot, "n_erased": n_erased}))
    if action == "save":
        return json_response(jstr.dumps({"id_slot": id_slot, "filename": filename, "n_saved": done.n_tokens,
                                         "n_written": done.n_bytes, "timings": {"save_ms": done.ms}}))
    return json_response(jstr.dumps({"id_slot": id_slot, "filename": filename, "n_restored": done.n_tokens,
                                     "n_read": done.n_bytes, "timings": {"restore_ms": done.ms}}))
