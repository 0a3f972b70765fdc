"""Reasoning models: the thought split from the answer, for every dialect.

A template that thinks (Qwen3's and DeepSeek-R1's `<think>`; llama.cpp's chat parser knows other forms, such
as Command R7B's `<|START_THINKING|>` and gpt-oss's channels, which are not cut out here yet) makes the model
write its thought first, between tags, then the answer. Every dialect shows the
two apart: chat's `reasoning_content`, Ollama's `thinking`, Anthropic's `thinking` blocks, Responses'
`reasoning` items. This module is the one place that knows the tags:

- `Reasoning`: how one request thinks (split or not, the template's `enable_thinking` and other
  variables, a budget of thought tokens);
- `thought_tags(template)`: the tags the template's model writes its thought between, or None;
- `split(text, tags, started)`: a whole answer's (reasoning, content);
- `ThoughtStream`: the same, piece by piece, each delta sent once it is sure to be reasoning or content.

`started`: the prompt already opened the thought (DeepSeek-R1's generation prompt ends with `<think>\n`),
so the answer begins inside it; `opened` tells it from the prompt's tokens.

The budget, and any grammar, on a thinking template (`constrain`, called by the answer pipeline for every
`Work` with a `reasoning`): one llguidance grammar whose thought rule stops at the close tag or after
`budget` tokens (its `max_tokens`), after which the close tag is forced, and whose answer is the
request's grammar (tool calls, a JSON schema) or any text, as llama.cpp applies them after the thought.

The request's side (`read_chat`): llama-server's `reasoning_format` (none / deepseek / deepseek-legacy /
auto), `chat_template_kwargs` (`enable_thinking` and the template's other variables; the renderer's own
names refused), `reasoning_effort` (a template variable, as llama-server passes it) and
`reasoning_budget_tokens`; `ollama_think` reads Ollama's `think`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from bankml.errors import InvalidRequest, NotSupported

# (open, close) of the forms we split; the first whose open tag the template names is the model's
TAGS: tuple[tuple[str, str], ...] = (("<think>", "</think>"),)


@dataclass(frozen=True)
class Reasoning:
    """How one request thinks. `split`: the thought goes apart from the answer (llama-server's
    reasoning_format deepseek/auto; False for "none", the thought left in the text); `enable`: the
    template's `enable_thinking` (None: the template's default); `budget`: thought tokens before the
    thought is closed (-1 unbounded, 0 none); `kwargs`: the template's other variables
    (`chat_template_kwargs`)."""

    split: bool = True
    enable: bool | None = None
    budget: int = -1
    kwargs: dict[str, Any] = field(default_factory=dict)
    legacy: bool = False  # reasoning_format deepseek-legacy: the content keeps the thought and its tags

    def template_kwargs(self) -> dict[str, Any]:
        """The variables the template renders with (enable_thinking among them when chosen). A budget of 0
        asks for no thought: enable_thinking false, for a template that reads it (Qwen3's); a prompt that
        opens the thought anyway (DeepSeek-R1's) has it closed at once by `constrain`."""
        out = dict(self.kwargs)
        if self.enable is not None:
            out["enable_thinking"] = self.enable
        elif self.budget == 0:
            out["enable_thinking"] = False
        return out

    @property
    def thinks(self) -> bool:
        """The request may think: thinking is not turned off (by enable_thinking false or a budget of 0)."""
        return self.template_kwargs().get("enable_thinking", True) is not False


def thought_tags(template: str | None) -> tuple[str, str] | None:
    """The tags the template's model thinks between, or None for a template that does not think."""
    if not template:
        return None
    for open_tag, close_tag in TAGS:
        if open_tag in template or close_tag in template:
            return open_tag, close_tag
    return None


def started(prompt_text: str, tags: tuple[str, str] | None) -> bool:
    """The rendered prompt ends inside an open thought (its generation prompt opened it)."""
    if tags is None:
        return False
    tail = prompt_text.rstrip()
    return tail.endswith(tags[0])


def split(text: str, tags: tuple[str, str] | None, started: bool = False) -> tuple[str, str]:
    """A whole answer's (reasoning, content): the thought between the tags at its start (or from the start
    when the prompt opened it), the rest the answer. An unclosed thought is all reasoning."""
    if tags is None:
        return "", text
    open_tag, close_tag = tags
    body = text
    lead = len(body) - len(body.lstrip())
    if body[lead:].startswith(open_tag):  # opened by the model (again, when the prompt opened it: dropped)
        body = body[lead + len(open_tag):]
    elif not started:
        return "", text
    end = body.find(close_tag)
    if end < 0:
        return body.strip(), ""
    return body[:end].strip(), body[end + len(close_tag):].lstrip()


class ThoughtStream:
    """`split` piece by piece: `feed(piece)` and `finish()` give ("reasoning" | "content", delta) pairs,
    each text sent once it is sure which it is (a partial tag is held back)."""

    def __init__(self, tags: tuple[str, str] | None, started: bool = False) -> None:
        self.tags = tags
        self.state = "content" if tags is None else "lead"
        self.started = started
        self.held = ""
        self.fresh = True  # nothing of the thought sent yet

    def feed(self, piece: str) -> list[tuple[str, str]]:
        self.held += piece
        out: list[tuple[str, str]] = []
        while True:
            moved = self._step(out)
            if not moved:
                return [(k, d) for k, d in out if d]

    def finish(self) -> list[tuple[str, str]]:
        rest, self.held = self.held, ""
        if not rest:
            return []
        if self.state == "lead" and not self.started:
            return [("content", rest)]
        if self.state in ("lead", "reasoning"):
            rest = rest.strip()
            return [("reasoning", rest)] if rest else []
        return [("content", rest)]

    def _step(self, out: list[tuple[str, str]]) -> bool:
        if self.tags is None or self.state == "content":
            if self.held:
                out.append(("content", self.held))
                self.held = ""
            return False
        open_tag, close_tag = self.tags
        if self.state == "lead":  # before any text: a thought opens here, or the answer has none
            stripped = self.held.lstrip()
            if stripped.startswith(open_tag):
                self.held, self.state = stripped[len(open_tag):], "reasoning"
                return True
            if open_tag.startswith(stripped):
                return False  # whitespace or a partial open tag: wait
            self.state = "reasoning" if self.started else "content"
            return True
        if self.state == "reasoning":
            if self.fresh:  # the thought's leading whitespace is dropped, as `split` strips it
                self.held = self.held.lstrip()
                self.fresh = not self.held
            end = self.held.find(close_tag)
            if end >= 0:
                out.append(("reasoning", self.held[:end].rstrip()))
                self.held, self.state = self.held[end + len(close_tag):], "after"
                return True
            keep = _partial_suffix(self.held, close_tag)
            sure = self.held[:len(self.held) - keep].rstrip()  # trailing whitespace waits: it may end the thought
            if sure:
                out.append(("reasoning", sure))
                self.held = self.held[len(sure):]
            return False
        # "after": the whitespace between the thought and the answer is dropped
        stripped = self.held.lstrip()
        if stripped:
            self.held, self.state = stripped, "content"
            return True
        self.held = ""
        return False


def _partial_suffix(text: str, tag: str) -> int:
    """How many of `text`'s last characters could begin `tag` (held back until the next piece)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def thought_tokens(pieces: list[str], tags: tuple[str, str] | None, started: bool = False) -> int:
    """The answer's tokens that make its thought, tags included (`usage`'s reasoning_tokens): the outputs (a
    token each, `pieces` their texts) that begin before the close tag ends; 0 without a thought."""
    if tags is None:
        return 0
    text = "".join(pieces)
    lead = len(text) - len(text.lstrip())
    if not started and not text.startswith(tags[0], lead):
        return 0
    end = text.find(tags[1])
    thought_chars = len(text) if end < 0 else end + len(tags[1])
    n, at = 0, 0
    for piece in pieces:
        if at >= thought_chars:
            break
        n, at = n + 1, at + len(piece)
    return n


def opened(tokenizer, prompt: list[int], tags: tuple[str, str] | None) -> bool:
    """`started` from a prompt's tokens: its last few, as text (specials included)."""
    if tags is None or not prompt:
        return False
    tail = b"".join(tokenizer.token_to_piece(int(t), True) for t in prompt[-8:])
    return started(tail.decode("utf-8", "replace"), tags)


# --- the request -----------------------------------------------------------------------------------

FORMATS = ("none", "deepseek", "deepseek-legacy", "auto")  # llama-server's reasoning_format names
# the names the renderer sets itself (model/chat_template.py render_chat, gateway/serving/native_model.py)
RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "strftime_now", "datetime",
            "date_string", "raise_exception")


def read_template_kwargs(v: Any, field_name: str = "chat_template_kwargs") -> dict[str, Any]:
    """`chat_template_kwargs`: an object of the template's variables; `enable_thinking` a boolean (llama-server's
    words for another type); a name the renderer sets itself is a 400 naming it."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise InvalidRequest(f"'{field_name}' must be a JSON object, got {_json_type(v)}")
    reserved = [k for k in v if k in RESERVED]
    if reserved:
        raise InvalidRequest(f"'{field_name}' cannot set {', '.join(repr(k) for k in reserved)}: the server sets "
                             "it when it renders the template")
    if "enable_thinking" in v and not isinstance(v["enable_thinking"], bool):
        raise InvalidRequest(f'invalid type for "enable_thinking" (expected boolean, got {_json_type(v["enable_thinking"])})')
    return dict(v)


def read_chat(request: dict, budget: int = -1, fmt: str | None = None) -> Reasoning:
    """How a /v1/chat/completions (or /apply-template) request thinks: `reasoning_format` (`fmt`, as the field
    table read it; None is the server's default, llama-server's `auto`), `chat_template_kwargs`,
    `reasoning_effort` (passed to the template, as llama-server passes it) and `reasoning_budget_tokens`
    (`budget`, -1 unbounded)."""
    if fmt is not None and fmt not in FORMATS:
        raise InvalidRequest(f"Unknown reasoning format: {fmt}")
    kwargs = read_template_kwargs(request.get("chat_template_kwargs"))
    effort = request.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise InvalidRequest(f"'reasoning_effort' must be a string, got {_json_type(effort)}")
        kwargs.setdefault("reasoning_effort", effort)
    enable = kwargs.pop("enable_thinking", None)
    return Reasoning(split=fmt != "none", enable=enable, budget=budget, kwargs=kwargs, legacy=fmt == "deepseek-legacy")


OLLAMA_LEVELS = ("low", "medium", "high")


def ollama_think(v: Any) -> Reasoning:
    """Ollama's `think`: absent, the template's default, its thought in `thinking`; true, the same with
    enable_thinking; a level ("low", "medium", "high") thinks, the level passed to the template as
    `reasoning_effort` (what gpt-oss's template reads); false renders with enable_thinking false and cuts
    nothing out: a model that thinks anyway has its thought in the content, as Ollama leaves it."""
    if v is None:
        return Reasoning()
    if isinstance(v, bool):
        return Reasoning(enable=v, split=v)
    if isinstance(v, str) and v in OLLAMA_LEVELS:
        return Reasoning(enable=True, kwargs={"reasoning_effort": v})
    raise InvalidRequest(f"invalid think value: {json.dumps(v)} (must be \"high\", \"medium\", \"low\", true, or false)")


def _json_type(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(v), "number")


# --- the budget and the answer's grammar -------------------------------------------------------------

def constrain(r: Reasoning | None, tags: tuple[str, str] | None, started_: bool, grammar: str | None) -> str | None:
    """The grammar an answer runs under, its thought first (llguidance's grammar text; None: none).

    A template that does not think, or a request without `reasoning`: `grammar` as it is. Otherwise the
    thought's rule ends at the close tag, or after `budget` tokens (llguidance's `max_tokens`), when the
    close tag is forced; the answer after it (and the whitespace between) is `grammar`, or any text:
    - the prompt opened the thought: the thought, then the answer (a budget of 0: closed at once);
    - thinking off (enable_thinking false, or a budget of 0, which renders it so): the grammar is the
      whole answer, as before;
    - a budget: the model opens it (forced);
    - only a grammar: the thought is optional (the model may answer at once).
    """
    if r is None or tags is None:
        return grammar
    bounded = r.budget >= 0
    if not (bounded or grammar is not None):
        return None
    if not started_ and not r.thinks:  # thinking off (a budget of 0 too): the prompt closed the thought, or none comes
        return grammar
    open_tag, close_tag = (json.dumps(t) for t in tags)
    limit = f", max_tokens={r.budget}" if bounded else ""
    thought = f"thought {close_tag}" if started_ else f"{open_tag} thought {close_tag}"
    head = thought if started_ or bounded else f"({thought} WS)?"
    rest = "WS @answer" if grammar is not None else "ANSWER"
    if not started_ and not bounded:
        rest = "@answer"
    lark = (f"start: {head} {rest}\n"
            f"thought[stop={close_tag}{limit}]: /(?s:.*)/\n"
            "WS: /[ \\t\\r\\n]{0,8}/\n"  # Qwen3 and R1 write "\\n\\n"; bounded, so a weak model cannot spend its tokens there
            "ANSWER: /(?s:.*)/\n")
    grammars: list[dict] = [{"name": "reasoning", "lark_grammar": lark}]
    if grammar is not None:
        grammars.append(_named(grammar, "answer"))
    return json.dumps({"grammars": grammars})


def _named(grammar: str, name: str) -> dict:
    """One of model/constraint.py's grammars as a named grammar of a list: a JSON TopLevelGrammar of one grammar,
    or Lark text."""
    try:
        top = json.loads(grammar)
    except ValueError:
        return {"name": name, "lark_grammar": grammar}
    inner = top.get("grammars") if isinstance(top, dict) else None
    if not isinstance(inner, list) or len(inner) != 1:
        raise NotSupported("a grammar of several grammars is not supported by bankml serve --native after a thought")
    return {**inner[0], "name": name}
