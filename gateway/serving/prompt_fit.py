"""The prompt of an /api answer, fitted to `num_ctx` as Ollama v0.13.3 fits it (server/prompt.go,
`chatPrompt`; spec §4.4).

- chat, and generate (`[system], user: prompt`, or a derived model's conversation): the GGUF's
  template, then tokens with specials. Under a num_ctx the oldest messages go first: walking back from
  the next-to-last message, each candidate is [the system messages before i] + messages[i:], kept
  while its prompt fits. The last message always stays. Ollama's quirk is kept: the system messages
  are those of the first candidate that did not fit, so a system message that is itself the first one
  cut is dropped. A prompt still too long is refused (Ollama's runner would cut tokens out of its
  middle, num_keep, which bankML does not reproduce);
- generate with raw: the prompt's tokens with specials, no template; over num_ctx, refused.
Either way a prompt that does not fit this server's context (--ctx) is refused. These run on a worker
thread (tokenizing a long conversation takes a while): the callers use `asyncio.to_thread`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bankml.errors import InvalidRequest
from model.tokenizer_bpe import TokenLimitExceeded

Count = Callable[[list[dict]], int]


def fit_messages(messages: list[dict], num_ctx: int, count: Count) -> tuple[list[dict], int]:
    """Ollama's chatPrompt truncation over any token count: the messages kept, and how many were cut."""
    last = len(messages) - 1
    n, system = last, []
    for i in range(last - 1, -1, -1):
        system = [m for m in messages[:i] if m["role"] == "system"]
        if count(system + messages[i:]) > num_ctx:
            break
        n = i
    kept = system + messages[n:]
    return kept, len(messages) - len(kept)


def _encode(model: Any, text: str, limit: int) -> list[int]:
    return model.tokenize(text, add_special=True, parse_special=True, limit=limit)


def _tokens(model: Any, messages: list[dict], limit: int, tools: list[dict] | None = None,
            template_kwargs: dict | None = None) -> list[int]:
    if continues(messages):
        text = model.render(messages, False, tools, template_kwargs, True)
    elif template_kwargs:
        text = model.render(messages, True, tools, template_kwargs)
    else:
        text = model.render(messages, True, tools)
    return _encode(model, text, limit)


def continues(messages: list[dict]) -> bool:
    """Ollama's prefill (template/template.go, Execute): a final assistant message is continued, the answer
    what comes after its text; one that only calls tools is a finished turn."""
    return bool(messages) and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")


def _too_long(n: str, num_ctx: int, dropped: int, what: str = "prompt", fix: str = "the last message") -> InvalidRequest:
    cut = f" with the {dropped} oldest messages dropped" if dropped else ""
    return InvalidRequest(f"the {what} is {n} tokens, more than num_ctx {num_ctx}{cut}: Ollama would cut tokens out "
                          f"of its middle (num_keep), which bankML does not reproduce; shorten {fix} or raise num_ctx "
                          "(up to this server's --ctx)")


def _fits_context(model: Any, tokens: list[int]) -> list[int]:
    if len(tokens) >= model.n_ctx:
        raise InvalidRequest(f"the prompt has {len(tokens)} tokens; the context is {model.n_ctx}")
    return tokens


def _whole(model: Any, encode: Callable[[int], list[int]]) -> tuple[list[int] | None, int]:
    """The tokens, or None and the count made when the tokenizer stopped past the model's count limit."""
    try:
        return encode(model.count_limit), 0
    except TokenLimitExceeded as e:
        return None, e.at_least


def chat_prompt(model: Any, messages: list[dict], num_ctx: int | None, tools: list[dict] | None = None,
                template_kwargs: dict | None = None) -> list[int]:
    """A conversation's prompt tokens (`model`: gateway.serving.native_model.NativeModel), fitted under num_ctx;
    `tools` and `template_kwargs` (enable_thinking: gateway/serving/reasoning.py) go to the template with every
    candidate."""
    dropped = 0
    fitted: tuple[list[dict], list[int]] | None = None  # the last candidate that fit, and its tokens
    if num_ctx is not None:
        def count(candidate: list[dict]) -> int:
            nonlocal fitted
            try:
                tokens = _tokens(model, candidate, num_ctx, tools, template_kwargs)
            except TokenLimitExceeded:
                return num_ctx + 1  # past it: the exact count does not matter
            if len(tokens) <= num_ctx:
                fitted = candidate, tokens
            return len(tokens)

        messages, dropped = fit_messages(messages, num_ctx, count)
    if fitted is not None and fitted[0] == messages:  # what was kept was counted whole: not tokenized again
        return _fits_context(model, fitted[1])
    tokens, at_least = _whole(model, lambda limit: _tokens(model, messages, limit, tools, template_kwargs))
    if tokens is None:
        if num_ctx is not None:
            raise _too_long(f"at least {at_least}", num_ctx, dropped)
        raise InvalidRequest(f"the prompt has at least {at_least} tokens; the context is {model.n_ctx}")
    if num_ctx is not None and len(tokens) > num_ctx:
        raise _too_long(str(len(tokens)), num_ctx, dropped)
    return _fits_context(model, tokens)


def raw_prompt(model: Any, text: str, num_ctx: int | None) -> list[int]:
    """generate with raw: the text's tokens, specials parsed, no template."""
    tokens, at_least = _whole(model, lambda limit: _encode(model, text, limit))
    if tokens is None:
        if num_ctx is not None:
            raise _too_long(f"at least {at_least}", num_ctx, 0, "raw prompt", "it")
        raise InvalidRequest(f"the prompt has at least {at_least} tokens; the context is {model.n_ctx}")
    if num_ctx is not None and len(tokens) > num_ctx:
        raise _too_long(str(len(tokens)), num_ctx, 0, "raw prompt", "it")
    return _fits_context(model, tokens)
