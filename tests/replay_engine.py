"""An engine that replays llama-server's recorded greedy tokens, for the parity tests (no model run).

tests/fixtures/parity_smollm2.json holds, per prompt, the token ids llama-server generated and each
token's logprob and top-20 logprobs. `ReplayEngine.generate` looks the prompt up and feeds those
tokens, one per step, through the engine's own host side (model/completion.py: stop strings, UTF-8
hold-back, limits, logprob entries) with the real SmolLM2 tokenizer; the gateway writes the answer.
So a parity test compares our bytes with llama-server's for everything except the forward pass.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from batch_adapter import GeneratorBatch

from bankml.errors import InvalidRequest
from model.completion import Completion
from model.messages import SamplingParams, StepOutput
from model.tokenizer import Tokenizer

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "parity_smollm2.json"


class ReplayEngine(GeneratorBatch):
    def __init__(self, model_path: str | Path, fixture: Path = FIXTURE, n_ctx: int | None = None):
        super().__init__()
        data = json.loads(Path(fixture).read_text())
        self.tokenizer = Tokenizer.from_gguf(model_path)
        self.n_ctx = n_ctx or int(data["n_ctx"])
        self.traces = {tuple(t["prompt_tokens"]): t for t in data["traces"].values()}

    def warmup(self) -> float:
        return 0.0

    def generate(self, prompt_tokens: list[int], params: SamplingParams | None = None,
                 request_id: str = "generate") -> Iterator[StepOutput]:
        params = params or SamplingParams()
        if len(prompt_tokens) >= self.n_ctx:
            raise InvalidRequest(f"the prompt has {len(prompt_tokens)} tokens, the context only {self.n_ctx}")
        trace = self.traces.get(tuple(prompt_tokens))
        if trace is None:
            raise InvalidRequest("the replay engine has no recorded trace for this prompt")
        done = Completion(self.tokenizer, params, n_prompt=len(prompt_tokens), n_ctx=self.n_ctx,
                          eog_ids=self.tokenizer.eog_ids)
        for i, token in enumerate(trace["tokens"]):
            probs = trace["probs"].get(str(i))
            top = [(int(t), float(lp)) for t, lp in probs["top"][:params.n_probs]] if probs else ()
            out = done.push(token, probs["logprob"] if probs else None, top)
            yield out
            if out.finish_reason is not None:
                return
        raise InvalidRequest("the recorded trace ran out before the generation finished")


def replay_loader(fixture: Path = FIXTURE, n_ctx: int | None = None):
    def load(path: str):
        return ReplayEngine(path, fixture, n_ctx), "llama-server's recorded tokens, replayed"

    return load
