"""Reasoning models: the thought split from the answer, for every dialect.

A template that thinks (Qwen3's and DeepSeek-R1's `<think>`, and the other forms llama.cpp's chat parser
detects) makes the model write its thought first, between tags, then the answer. Every dialect shows the
two apart: chat's `reasoning_content`, Ollama's `thinking`, Anthropic's `thinking` blocks, Responses'
`reasoning` items. This module is the one place that knows the tags:

- `Reasoning`: how one request thinks (split or not, the template's `enable_thinking` and other
  variables, a budget of thought tokens);
- `thought_tags(template)`: the tags the template's model writes its thought between, or None;
- `split(text, tags, started)`: a whole answer's (reasoning, content);
- `ThoughtStream`: the same, piece by piece, each delta sent once it is sure to be reasoning or content.

`started`: the prompt already opened the thought (DeepSeek-R1's generation prompt ends with `<think>\n`),
so the answer begins inside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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

    def template_kwargs(self) -> dict[str, Any]:
        """The variables the template renders with (enable_thinking among them when chosen)."""
        out = dict(self.kwargs)
        if self.enable is not None:
            out["enable_thinking"] = self.enable
        return out


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
    if not started:
        lead = len(body) - len(body.lstrip())
        if not body[lead:].startswith(open_tag):
            return "", text
        body = body[lead + len(open_tag):]
    end = body.find(close_tag)
    if end < 0:
        return body.strip(), ""
    return body[:end].strip(), body[end + len(close_tag):].lstrip()


class ThoughtStream:
    """`split` piece by piece: `feed(piece)` and `finish()` give ("reasoning" | "content", delta) pairs,
    each text sent once it is sure which it is (a partial tag is held back)."""

    def __init__(self, tags: tuple[str, str] | None, started: bool = False) -> None:
        self.tags = tags
        self.state = "content" if tags is None else ("reasoning" if started else "lead")
        self.held = ""

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
        if self.state == "lead":
            return [("content", rest)]
        return [(self.state if self.state != "after" else "content", rest)]

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
                self.held, self.state = stripped[len(open_tag):].lstrip(), "reasoning"
                return True
            if open_tag.startswith(stripped):
                return False  # whitespace or a partial open tag: wait
            self.state = "content"
            return True
        if self.state == "reasoning":
            end = self.held.find(close_tag)
            if end >= 0:
                out.append(("reasoning", self.held[:end].rstrip()))
                self.held, self.state = self.held[end + len(close_tag):], "after"
                return True
            keep = _partial_suffix(self.held, close_tag)
            sure = self.held[:len(self.held) - keep]
            if sure.strip() or sure == "":
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
