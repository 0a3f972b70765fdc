"""Agreement with llama.cpp (spec README §1): greedy tokens and top-5 logprobs against llama-server.

The fixtures are recorded by tests/fixtures/record_golden.py from a real llama-server on the same GGUF.
For each prompt our engine decodes greedily through its KV cache and reports logprobs of the raw
logits. Rules: each step, every one of llama.cpp's top-5 tokens has our logprob within 0.05 nats of
llama.cpp's; our token equals llama.cpp's, until a near-tie (llama.cpp's top-2 gap < 0.05 nats), from
which on the sequences may part and the comparison stops.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from model.engine import Engine
from model.messages import SamplingParams

FIXTURES = Path(__file__).parent / "fixtures"
LOGPROB_TOL = 0.05  # nats
NEAR_TIE = 0.05  # nats between llama.cpp's top two


def _fixture(name: str) -> dict:
    path = FIXTURES / f"golden_{name}.json"
    if not path.exists():
        pytest.skip(f"{path.name} is not recorded (tests/fixtures/record_golden.py)")
    return json.loads(path.read_text())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def compare(engine: Engine, golden: dict) -> tuple[list[str], dict]:
    """Run every case; returns (failures, stats)."""
    failures, near_ties, compared, max_diff = [], 0, 0, 0.0
    for n, case in enumerate(golden["cases"]):
        ref_tokens, ref_tops = case["tokens"], case["top_logprobs"]
        params = SamplingParams(temperature=0.0, max_tokens=len(ref_tokens), n_probs=20)
        outs = list(engine.generate(case["prompt_tokens"], params))
        for i, (ref_token, ref_top) in enumerate(zip(ref_tokens, ref_tops, strict=True)):
            where = f"case {n} ({case.get('text', '')[-40:]!r}) step {i}"
            if i >= len(outs):
                failures.append(f"{where}: we stopped after {len(outs)} tokens, llama.cpp went on")
                break
            ours = {t.token: t.logprob for t in outs[i].top_logprobs}
            for token, logprob in ref_top:
                if token not in ours:
                    failures.append(f"{where}: llama.cpp's top-5 token {token} is not in our top 20")
                    continue
                diff = abs(ours[token] - logprob)
                max_diff = max(max_diff, diff)
                if diff > LOGPROB_TOL:
                    failures.append(f"{where}: token {token} logprob {ours[token]:.4f} vs llama.cpp {logprob:.4f}")
            compared += 1
            if len(ref_top) > 1 and ref_top[0][1] - ref_top[1][1] < NEAR_TIE:
                near_ties += 1
                break  # a near-tie: either choice is right, and the rest follows from it
            if outs[i].token != ref_token:
                failures.append(f"{where}: token {outs[i].token} vs llama.cpp {ref_token}")
                break
    return failures, {"steps_compared": compared, "near_ties": near_ties, "max_logprob_diff": max_diff}


def _run(model_path: Path, name: str):
    golden = _fixture(name)
    if _sha256(model_path) != golden["model_sha256"]:
        pytest.fail(f"{model_path.name} is not the file golden_{name}.json was recorded from")
    engine = Engine.load(model_path, verified=True, n_ctx=512, warmup=False)
    failures, stats = compare(engine, golden)
    print(f"{name}: {stats}")
    assert not failures, f"{len(failures)} disagreements with llama.cpp ({stats}):\n" + "\n".join(failures[:20])


@pytest.mark.slow
def test_smollm2_agrees_with_llama_cpp(smollm2_path):
    _run(smollm2_path, "smollm2")


@pytest.mark.slow
def test_gemma3_agrees_with_llama_cpp(gemma3_path):
    _run(gemma3_path, "gemma3")
