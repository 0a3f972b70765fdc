"""Receipts (README, "Serving"): what every /v1 answer carries as `bankml_receipt`.

With one, a client can check that the text it shows is the text this gateway produced from the
verified file, for this request: `response_sha256` is the sha256 of the answer text exactly as sent
(the message content, or the streamed deltas joined), `request_sha256` of the raw request body, and,
when the answer has logprobs, `logprobs_sha256` of the `logprobs.content` array as this gateway writes
it (a stream's entries gathered into one array, in the order sent).
The times are whole milliseconds, truncated. `wall_ms` runs from the moment the
request was handed to the engine queue to the receipt. `ttft_ms` is, with --native, the engine's
time to first text (from the answer's turn on the engine, as /bankml/metrics' `ttft_ms`), streamed
or not; in front of llama-server it is the gateway's, to the first streamed piece (null when not
streamed). Every value is an int, a string, a bool or null, so the object a client parses is the one
that was signed.

Each receipt is signed with the server's ed25519 key (bankml/signing.py): `"signed": true`, the key's
`key_id` and the `signature` over the receipt's canonical bytes, which a client checks against
`GET /bankml/receipt-key`, or with `bankml receipt verify`. A signed model's receipts also carry
`model_signer` (who signed the model file: bankml/model_signature.py), under the same signature; an
unsigned model's receipts do not have the key, as before.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass, field

from bankml import __version__, jstr
from bankml.signing import ReceiptKey
from bankml.verify import Verified
from model.messages import StepOutput


@dataclass
class Tally:
    """What a receipt is made from: the request's hash, the key that signs it, the clock, the answer's
    text and counts."""

    request_sha256: str
    key: ReceiptKey
    t0: float = field(default_factory=time.perf_counter)
    ttft_ms: int | None = None
    pieces: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs_sha256: str | None = None  # set when the answer carries logprobs

    @classmethod
    def start(cls, body: bytes, key: ReceiptKey) -> Tally:
        return cls(hashlib.sha256(body).hexdigest(), key)

    def token(self) -> None:
        """A piece came from llama-server (the first one sets the time to first token)."""
        if self.ttft_ms is None:
            self.ttft_ms = int((time.perf_counter() - self.t0) * 1e3)

    def answered(self, last: StepOutput) -> None:
        """The engine's final output: the counts, and the time to first text it measured."""
        self.prompt_tokens, self.completion_tokens = last.prompt_tokens, last.completion_tokens
        self.ttft_ms = None if last.ttft_ms is None else int(last.ttft_ms)

    def sent(self, text: str) -> None:
        """`text` went to the client as part of the answer."""
        if text:
            self.pieces.append(text)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def logprobs(self, entries: list[dict]) -> None:
        """The answer carries these logprob entries: the receipt hashes the array as written."""
        self.logprobs_sha256 = hashlib.sha256(jstr.dumps(entries).encode("utf-8")).hexdigest()

    def receipt_for(self, loaded, response_sha256: str | None = None) -> dict:
        """The receipt of an answer of `loaded` (gateway.serving.residency.Loaded): its engine, its verified file,
        and the sha256 of a --chat-template-file when one replaced the GGUF's template."""
        template_sha256 = getattr(loaded.model, "chat_template_sha256", None)
        return self.receipt(loaded.backend, loaded.verified, template_sha256, response_sha256)

    def receipt(self, engine: str, verified: Verified, chat_template_sha256: str | None = None,
                response_sha256: str | None = None) -> dict:
        """The signed receipt. `response_sha256`: of the answer as written when it is not text (the
        embeddings' vectors); else of the text sent."""
        out = {
            "bankml": __version__,
            "engine": _SURROGATE.sub("\ufffd", engine),  # as jstr writes it (llama-server names its build)
            "model_sha256": verified.model_sha256,
            "guard": "play",
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_ms": self.ttft_ms,
            "wall_ms": int((time.perf_counter() - self.t0) * 1e3),
            "response_sha256": text_sha256(self.text) if response_sha256 is None else response_sha256,
            "request_sha256": self.request_sha256,
        }
        if self.logprobs_sha256 is not None:
            out["logprobs_sha256"] = self.logprobs_sha256
        if chat_template_sha256 is not None:
            out["chat_template_sha256"] = chat_template_sha256
        signer = getattr(verified, "model_signer", None)  # a Verified; a test's stand-in may lack it
        if signer is not None:
            out["model_signer"] = signer
        return self.key.sign(out)


_SURROGATE = re.compile("[\ud800-\udfff]")


def text_sha256(text: str) -> str:
    """sha256 of `text` as it goes on the wire: UTF-8, a lone surrogate written as U+FFFD (as jstr does)."""
    return hashlib.sha256(_SURROGATE.sub("\ufffd", text).encode("utf-8")).hexdigest()
