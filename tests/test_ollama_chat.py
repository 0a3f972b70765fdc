"""/api/chat and /api/generate answers: Ollama's shapes (gateway/ollama_shapes.py) and the whole path over
the fake engine (gateway/ollama_chat.py), with the real `ollama` client too."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime

from bankml import jstr
from gateway.ollama_shapes import created_at, final_object, logprob_entry, piece_line
from model.messages import FinishReason, LogprobEntry, StepOutput, Timeline, TopLogprob

CREATED_AT = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z$")
FINAL_KEYS = ["model", "created_at", "message", "done", "done_reason", "total_duration", "load_duration",
              "prompt_eval_count", "prompt_eval_duration", "eval_count", "eval_duration", "bankml_cache_n",
              "bankml_receipt"]


# --- shapes -----------------------------------------------------------------------------------------


def test_created_at_is_rfc3339_utc_with_nine_digits():
    assert created_at(0.0) == "1970-01-01T00:00:00.000000000Z"
    assert created_at(1764654000.5) == "2025-12-02T05:40:00.500000000Z"
    assert created_at(1764654000.25) == "2025-12-02T05:40:00.250000000Z"
    t = 1764654000.123456
    text = created_at(t)
    assert CREATED_AT.match(text)
    parsed = datetime.fromisoformat(text[:26] + "+00:00")  # Python reads 6 of the 9 digits
    assert abs(parsed.timestamp() - t) < 1e-5 and parsed.tzinfo == UTC
    assert CREATED_AT.match(created_at(1.9999999999))  # never a 10th digit from rounding up


def test_piece_lines():
    line = piece_line("smollm2:latest", "chat", "Hi", None)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    obj = json.loads(line)
    assert list(obj) == ["model", "created_at", "message", "done"]
    assert obj["message"] == {"role": "assistant", "content": "Hi"} and obj["done"] is False
    assert CREATED_AT.match(obj["created_at"])
    obj = json.loads(piece_line("x:latest", "generate", "Hi", [{"token": "Hi", "logprob": -0.5}]))
    assert list(obj) == ["model", "created_at", "response", "done", "logprobs"] and obj["response"] == "Hi"


def _last(**kw) -> StepOutput:
    tl = Timeline(queued_s=10.0, started_s=10.5, first_token_s=10.75, first_text_s=10.8, ended_s=11.5)
    return StepOutput(token=2, finish_reason=FinishReason.STOP, prompt_tokens=30, completion_tokens=7,
                      cached_tokens=12, timeline=tl, **kw)


def test_the_final_object_has_the_spec_keys_in_order_and_integer_durations():
    obj = json.loads(final_object("smollm2:latest", "chat", "Hello.", "stop", 123456789, 5000, _last(),
                                  None, {"bankml": "x"}))
    assert list(obj) == FINAL_KEYS
    assert obj["message"] == {"role": "assistant", "content": "Hello."}
    assert (obj["done"], obj["done_reason"]) == (True, "stop")
    assert (obj["total_duration"], obj["load_duration"]) == (123456789, 5000)
    assert (obj["prompt_eval_count"], obj["eval_count"], obj["bankml_cache_n"]) == (30, 7, 12)
    assert obj["prompt_eval_duration"] == 250_000_000 and obj["eval_duration"] == 750_000_000
    for k in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert type(obj[k]) is int
    with_logprobs = json.loads(final_object("m:latest", "generate", "x", "length", 1, 0, _last(),
                                            [{"token": "x", "logprob": -1.0}], {"r": 1}))
    assert list(with_logprobs) == ["model", "created_at", "response", *FINAL_KEYS[3:-1], "logprobs", "bankml_receipt"]


def test_a_load_has_no_counts_and_no_receipt():
    obj = json.loads(final_object("m:latest", "chat", "", "load", 10, 7))
    assert list(obj) == ["model", "created_at", "message", "done", "done_reason", "total_duration", "load_duration"]
    assert obj["message"]["content"] == "" and obj["done_reason"] == "load"


def test_logprob_entries_in_ollamas_shape():
    e = LogprobEntry(token=42, text=" caf\xc3\xa9".encode("latin-1"), logprob=-0.25,
                     top=(TopLogprob(42, b" caf\xc3\xa9", -0.25), TopLogprob(7, b"", -2.0), TopLogprob(9, b"x", -3.0)))
    out = logprob_entry(e, 2)
    assert out == {"token": " café", "logprob": -0.25, "bytes": list(" café".encode()),
                   "top_logprobs": [{"token": " café", "logprob": -0.25, "bytes": list(" café".encode())},
                                    {"token": "", "logprob": -2.0}]}
    assert "id" not in out
    # no text: no bytes; top 0: no top list; a trailing incomplete character is cut from the token
    assert logprob_entry(LogprobEntry(1, b"", -1.0, (TopLogprob(1, b"a", -1.0),)), 0) == {"token": "", "logprob": -1.0}
    cut = logprob_entry(LogprobEntry(1, b"a\xe2\x9c", -1.0, ()), 0)
    assert cut["token"] == "a" and cut["bytes"] == [97, 0xE2, 0x9C]


def test_the_logprobs_hash_covers_the_array_as_written():
    entries = [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1.5, "bytes": [98]}]
    body = final_object("m:latest", "chat", "ab", "stop", 1, 0, _last(), entries, {"r": 1})
    assert jstr.dumps(entries) in body  # the receipt hashes jstr.dumps(entries): this very substring
    # streamed: each line's array without its brackets, joined by ", ", inside [ ]
    lines = [piece_line("m:latest", "chat", "a", entries[:1]), piece_line("m:latest", "chat", "b", entries[1:])]
    arrays = [re.search(rb'"logprobs": (\[.*\])\}', line).group(1).decode() for line in lines]
    assert "[" + ", ".join(a[1:-1] for a in arrays) + "]" == jstr.dumps(entries)
