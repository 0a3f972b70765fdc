"""The one adapter between the HTTP side and a loaded engine (model.engine.Engine, or the tests' fake).

What the routes need from a model: its context size, its tokenizer, and its chat template, rendered
as llama-server `--jinja` renders it (model/chat_template.py, in Jinja2's sandbox). The template comes
from the GGUF's own `tokenizer.chat_template`; without one, llama-server's ChatML fallback. If the
engine's API moves, this file is the one to change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from gateway.errors import ApiError
from gateway.request_fields import gguf_defaults
from model.chat_template import TemplateError, render_chat
from model.messages import SamplingParams
from model.tokenizer_gguf import gguf_fields


@dataclass(frozen=True)
class NativeModel:
    tokenizer: Any  # encode(text, add_special, parse_special); bos_token, eos_token, add_bos, add_eos
    n_ctx: int
    chat_template: str | None
    defaults: SamplingParams  # llama.cpp's defaults under the GGUF's general.sampling.* (and /props)

    @classmethod
    def of(cls, engine: Any, path: str | os.PathLike) -> NativeModel:
        kv = gguf_fields(path, ("tokenizer.chat_template", "general.sampling."))
        template = kv.get("tokenizer.chat_template")
        return cls(engine.tokenizer, int(engine.n_ctx), template if isinstance(template, str) else None,
                   gguf_defaults(kv))

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation (llama-server's /apply-template); a template error is a 400."""
        tok = self.tokenizer
        try:
            return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                               bos_token=tok.bos_token, eos_token=tok.eos_token,
                               add_bos=bool(tok.add_bos), add_eos=bool(tok.add_eos))
        except TemplateError as e:
            raise ApiError(400, str(e)) from None

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special, parse_special)]

    def prompt(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Template, then tokens, as llama-server builds a chat prompt (special tokens parsed, BOS added)."""
        return self.tokenize(self.render(messages, add_generation_prompt), add_special=True, parse_special=True)
