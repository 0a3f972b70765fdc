"""tests/gateway_fake_server.py, whose chat preparation can be made to hang, for tests/test_wedge_and_shutdown.py.

    python tests/wedge_server.py (gateway_fake_server.py's arguments)

A chat whose last message holds `PREP-BLOCK:<fifo>` blocks the worker thread preparing it (the
template and tokenizing step, gateway/openai/chat.py `_prompt`, run by `asyncio.to_thread` on the
loop's default executor) until the test opens the fifo for writing and closes it: the stand-in for a
preparation stuck in CPU work (issue 28), with no hook in the server itself.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import gateway_fake_server  # noqa: E402

from gateway.openai import chat  # noqa: E402

PREP_HANG = re.compile(r"PREP-BLOCK:([^\s\"'<]+)")
_prompt = chat._prompt


def hanging_prompt(model, request):
    hang = PREP_HANG.search(str(request.messages))
    if hang:
        with open(hang.group(1), "rb") as fifo:  # blocks until the test opens it for writing
            fifo.read()  # and closes it
    return _prompt(model, request)


chat._prompt = hanging_prompt

if __name__ == "__main__":
    sys.exit(gateway_fake_server.main(sys.argv[1:]))
