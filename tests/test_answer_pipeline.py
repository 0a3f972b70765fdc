"""The one answer pipeline (gateway/serving/answer.py): every text dialect is a parser and a `Writer` on it.

Each dialect's writer has the whole `Writer` protocol (checked member by member, as the engine handle's
fakes are), and no text route runs a piece of the pipeline itself: handing sequences to the engine,
tallying receipts, recording answers and attaching constraints are answer.py's alone.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_engine_handle import conformance

from gateway.ollama.chat import OllamaWriter
from gateway.openai.chat import ChatWriter
from gateway.openai.chat_writer import ChatCompletion
from gateway.openai.completion import CompletionWriter, Kind
from gateway.serving.answer import Work, Writer
from model.messages import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
DIALECTS = ("gateway/openai/chat.py", "gateway/openai/completion.py", "gateway/ollama/chat.py")
PIPELINE_ONLY = {"generate", "generate_all", "Tally", "attach_constraints", "outputs", "engine_error", "record"}


@pytest.mark.parametrize("writer", [
    ChatWriter(ChatCompletion("chatcmpl-x", 0, "m"), timed=False, plan=None, n=2),
    CompletionWriter(Kind.LLAMA, "cmpl-x", 0, "m", req=None, settings={}, prompts=[[1]], texts=["a"]),
    OllamaWriter(req=None, held=None, t0_ns=0, plan=None),
], ids=["chat", "completion", "ollama"])
def test_each_dialects_writer_is_a_writer(writer):
    assert conformance(Writer, writer) == []


def test_the_check_names_what_a_writer_lacks():
    class NoClose(ChatWriter):
        close = None

    assert conformance(Writer, NoClose(ChatCompletion("c", 0, "m"), False, None, 1)) == ["close: not callable"]


@pytest.mark.parametrize("path", DIALECTS)
def test_no_text_route_runs_a_piece_of_the_pipeline(path):
    """A dialect names none of the pipeline's steps: it cannot have a second copy of the loop."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    used |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    used |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert used & PIPELINE_ONLY == set(), f"{path} runs {sorted(used & PIPELINE_ONLY)} itself"


def test_work_numbers_its_sequences_prompt_by_prompt():
    """One sequence per prompt and per `n`, sequence k = prompt * n + j, each with its own id."""
    params = SamplingParams()
    work = Work([[1, 2], [3]], params, ["a", "b", "c", "d"], writer=None, stream=False, n=2, progress=True,
                id_slot=1)
    requests = work.requests()
    assert [(r.prompt_tokens, r.request_id) for r in requests] == [([1, 2], "a"), ([1, 2], "b"), ([3], "c"),
                                                                    ([3], "d")]
    assert all(r.return_progress and r.id_slot == 1 and r.params is params for r in requests)


def test_work_without_a_slot_asks_for_any_slot():
    """A dialect with no id_slot (Ollama's) gets -1, the scheduler's "any free slot"; None once made the
    engine thread fail every step of a real /api/chat (tests/test_ollama_smollm2.py hung on it)."""
    [r] = Work([[1]], SamplingParams(), ["a"], writer=None, stream=False).requests()
    assert r.id_slot == -1
