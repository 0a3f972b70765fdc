"""The one adapter between the HTTP side and a loaded engine (model.engine.Engine, or the tests' fake).

What the routes need from a model: its context size, its tokenizer, and its chat template, rendered
as llama-server `--jinja` renders it (model/chat_template.py, in Jinja2's sandbox). The template comes
from the GGUF's own `tokenizer.chat_template`, or from a --chat-template-file that replaces it (then its
sha256 is `chat_template_sha256`, which /bankml, /props and every receipt show); without either,
llama-server's ChatML fallback. If the
engine's API moves, this file is the one to change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from bankml.errors import ContextExceeded, InvalidRequest
from bankml.serve_files import ChatTemplateFile
from gateway.serving.request_fields import gguf_defaults
from model.chat_template import TemplateError, render_chat
from model.messages import SamplingParams
from model.tokenizer_bpe import InvalidText, TokenLimitExceeded
from model.tokenizer_gguf import gguf_fields


@dataclass(frozen=True)
class NativeModel:
    tokenizer: Any  # encode(text, add_special, parse_special); bos_token, eos_token, add_bos, add_eos
    n_ctx: int
    chat_template: str | None
    defaults: SamplingParams  # llama.cpp's defaults under the GGUF's general.sampling.* (and /props)
    chat_template_sha256: str | None = None  # set when --chat-template-file replaced the GGUF's template

    @classmethod
    def of(cls, engine: Any, path: str | os.PathLike, template_file: ChatTemplateFile | None = None) -> NativeModel:
        kv = gguf_fields(path, ("tokenizer.chat_template", "general.sampling."))
        template = kv.get("tokenizer.chat_template")
        if template_file is not None:  # llama-server --chat-template-file: the file's text, in place of the GGUF's
            return cls(engine.tokenizer, int(engine.n_ctx), template_file.text, gguf_defaults(kv), template_file.sha256)
        return cls(engine.tokenizer, int(engine.n_ctx), template if isinstance(template, str) else None,
                   gguf_defaults(kv))

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               template_kwargs: dict | None = None, continue_final: bool = False) -> str:
        """The prompt text for a conversation (llama-server's /apply-template), `tools` passed to the
        template (gateway/serving/tool_calls.py), `template_kwargs` its other variables (chat_template_kwargs:
        enable_thinking and the like, gateway/serving/reasoning.py); a template error is a 400."""
        if continue_final:
            return self._continued(messages, tools, template_kwargs)
        tok = self.tokenizer
        try:
            return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                               bos_token=tok.bos_token, eos_token=tok.eos_token,
                               add_bos=bool(tok.add_bos), add_eos=bool(tok.add_eos), tools=tools,
                               extra_context=template_kwargs)
        except TemplateError as e:
            raise InvalidRequest(str(e)) from None

    def _continued(self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None) -> str:
        """The prompt that continues the final (assistant) message, as transformers' continue_final_message
        and llama-server's assistant prefill make it: the conversation rendered with that message, cut just
        after its text (the template's end of turn dropped). A final message with no text is the turn to
        come; one whose text the template does not render cannot be continued: a 400."""
        final = messages[-1].get("content")
        final = final.strip() if isinstance(final, str) else ""
        if not final:
            return self.render(messages[:-1], True, tools, template_kwargs)
        text = self.render(messages, False, tools, template_kwargs)
        at = text.rfind(final)
        if at < 0:
            raise InvalidRequest("the final assistant message cannot be continued: its text does not appear in "
                                 "the prompt the chat template makes")
        return text[:at + len(final)]

    def tokenize(self, text: str, add_special: bool, parse_special: bool, limit: int | None = None) -> list[int]:
        """The text's tokens (llama-server's /tokenize: the whole text). A text the tokenizer cannot take
        is a 400 with its reason."""
        try:
            ids = self.tokenizer.encode(text, add_special, parse_special, limit=limit)
        except InvalidText as e:
            raise InvalidRequest(str(e)) from None
        return [int(t) for t in ids]

    def prompt(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, template_kwargs: dict | None = None,
               continue_final: bool = False) -> list[int]:
        """Template, then tokens, as llama-server builds a chat prompt (special tokens parsed, BOS added).

        The tokenizer stops once a prompt is sure not to fit: up to `count_limit` tokens the count in
        llama-server's exceed_context_size_error is exact, beyond it the count made so far ("at least").
        """
        text = self.render(messages, add_generation_prompt, tools, template_kwargs, continue_final)
        try:
            return self.tokenize(text, add_special=True, parse_special=True, limit=self.count_limit)
        except TokenLimitExceeded as e:
            raise ContextExceeded(f"request (at least {e.at_least} tokens) exceeds the available context size "
                                  f"({self.n_ctx} tokens), try increasing it",
                                  n_prompt_tokens=e.at_least, n_ctx=self.n_ctx) from None

    @property
    def count_limit(self) -> int:
        # twice the context (and a little): a prompt a bit too long still gets its exact count
        return 2 * self.n_ctx + 1024
