"""Agreement with llama.cpp (README, "How close to llama.cpp"): greedy tokens and top-5 logprobs against llama-server.

Fixtures: tests/fixtures/record_golden.py runs a real llama-server on the model twice (see its
docstring): on the quantized GGUF itself, and on the same weights dequantized to F32.

- Against the F32 run (the same weights, f32 activations on both sides), tightly: our engine decodes
  greedily through its KV cache; at each step every llama.cpp top-5 token has our logprob within
  0.05 nats, and our token equals llama.cpp's until a near-tie (top-2 gap < 0.05 nats), after which
  the sequences may part and the comparison stops.
- Against the quantized run, statistically. There ggml rounds every activation to 8 bits before
  each quantized matmul (model/actquant.py). On these small models that rounding alone moves logprobs
  by ~0.07 nats, and chaotically: under it, nudging the embeddings by 1e-6 moves our own logprobs by a
  median 0.09 nats (bench/rounding.py), so emulating the rounding exactly brings us no closer --
  only bit-identical arithmetic would, which an XLA engine cannot have. Teacher-forced on llama.cpp's
  tokens, our top-1 must match on >= 95% of the non-tied positions, with median |dlogprob| <= 0.1
  and 90th percentile <= 0.35 nats. A wrong rope, norm or mask fails all three by far.

The q8_0 KV cache: golden_<model>_q8_0.json is llama-server run with `--cache-type-k q8_0
--cache-type-v q8_0` (record_golden.py --cache-type q8_0), our engine with cache_type="q8_0" (Q, K and V
Hadamard-rotated and rounded through q8_0 blocks as llama.cpp's graph and flash attention do,
kernels/kvquant.py). q8_0's steps are 1/254 of a block's largest value, so a 1e-6 difference in a K or V
that flips one quant moves the next layers by far more than f32 rounding, and flips more: two q8_0
computations that are not bit-identical part like the quantized runs above. Our own prefill and decode
over the same q8_0 cache differ by up to 0.08 nats, so the F32 run's 0.05-nat rule cannot hold for any
such pair; against llama.cpp it is held statistically, as the quantized run is, and tighter: top-1 on
>= 98% of the non-tied positions, median |dlogprob| <= 0.05 and 90th percentile <= 0.15 nats (measured:
100%, 0.025 and 0.083 on SmolLM2, 100%, 0.019 and 0.075 on gemma3), plus the greedy decode through the
cache at Q8_0_LOGPROB_TOL (tokens compared until a near-tie of Q8_0_NEAR_TIE). The quantized run keeps
the rule above unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from bankml.pin import sha256_file
from model.engine import Engine
from model.messages import SamplingParams

FIXTURES = Path(__file__).parent / "fixtures"
LOGPROB_TOL = 0.05  # nats
NEAR_TIE = 0.05  # nats between llama.cpp's top two
GOLDEN = ["smollm2", "gemma3", "smollm2:q8_0", "gemma3:q8_0"]  # model[:KV cache type]
Q8_0_LOGPROB_TOL = 0.5  # nats, greedy through a q8_0 cache (measured max 0.33 SmolLM2, 0.42 gemma3)
Q8_0_NEAR_TIE = 0.1  # nats: a gap within q8_0's noise (90th percentile 0.08) is a tie



@pytest.fixture(scope="module")
def golden(request, smollm2_path, gemma3_path):
    """(engine, fixture) per model and KV cache type ("smollm2", or "smollm2:q8_0"), loaded once for both checks."""
    name, _, cache_type = request.param.partition(":")
    cache_type = cache_type or "f16"
    path = {"smollm2": smollm2_path, "gemma3": gemma3_path}[name]
    fixture = FIXTURES / (f"golden_{name}.json" if cache_type == "f16" else f"golden_{name}_{cache_type}.json")
    if not fixture.exists():
        pytest.skip(f"{fixture.name} is not recorded (tests/fixtures/record_golden.py)")
    data = json.loads(fixture.read_text())
    if sha256_file(path) != data["model_sha256"]:
        pytest.fail(f"{path.name} is not the file {fixture.name} was recorded from")
    assert data.get("cache_type", "f16") == cache_type
    return Engine.load(path, verified=True, n_ctx=512, warmup=False, cache_type=cache_type), data


def _near_tie(top, near_tie: float = NEAR_TIE) -> bool:
    return len(top) > 1 and top[0][1] - top[1][1] < near_tie


def compare_greedy(engine: Engine, data: dict, run: str, tol: float = LOGPROB_TOL,
                   near_tie: float = NEAR_TIE, flip_within_tol: bool = False) -> tuple[list[str], dict]:
    """Decode each prompt greedily; returns (failures, stats) under the tight rule (every logprob within `tol`,
    the same tokens until llama.cpp's top two are within `near_tie`). `flip_within_tol` (q8_0): another
    token is no failure when our own logprob of llama.cpp's token is within `tol` of our choice's (what
    per-logprob differences of up to `tol` allow); it ends that prompt's comparison, as a near tie does."""
    failures, near_ties, compared, max_diff = [], 0, 0, 0.0
    for n, (prompt, ref) in enumerate(zip(data["prompts"], data["runs"][run], strict=True)):
        params = SamplingParams(temperature=0.0, max_tokens=len(ref["tokens"]), n_probs=20)
        outs = list(engine.generate(prompt["prompt_tokens"], params))
        for i, (ref_token, ref_top) in enumerate(zip(ref["tokens"], ref["top_logprobs"], strict=True)):
            where = f"prompt {n} ({prompt['text'][-30:]!r}) step {i}"
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
                if diff > tol:
                    failures.append(f"{where}: token {token} logprob {ours[token]:.4f} vs llama.cpp {logprob:.4f}")
            compared += 1
            if _near_tie(ref_top, near_tie):
                near_ties += 1
                break  # either choice is right, and what follows depends on it
            if outs[i].token != ref_token:
                if flip_within_tol and ref_token in ours and ours[outs[i].token] - ours[ref_token] < tol:
                    near_ties += 1
                    break
                failures.append(f"{where}: token {outs[i].token} vs llama.cpp {ref_token}")
                break
    return failures, {"steps": compared, "near_ties": near_ties, "max_logprob_diff": round(max_diff, 4)}


def compare_teacher_forced(engine: Engine, data: dict, run: str) -> dict:
    """Our log-softmax on llama.cpp's own token sequence, against llama.cpp's top-5 at each step."""
    diffs, agree, positions = [], 0, 0
    for prompt, ref in zip(data["prompts"], data["runs"][run], strict=True):
        n = len(prompt["prompt_tokens"])
        seq = prompt["prompt_tokens"] + ref["tokens"][:-1]
        logprobs = np.asarray(jax.nn.log_softmax(engine.logits(seq)[n - 1:], axis=-1))
        for row, token, top in zip(logprobs, ref["tokens"], ref["top_logprobs"], strict=True):
            diffs += [abs(float(row[t]) - lp) for t, lp in top]
            if not _near_tie(top):
                positions += 1
                agree += int(row.argmax() == token)
    d = np.array(diffs)
    return {"top1_agreement": agree / positions, "positions": positions, "median_diff": float(np.median(d)),
            "p90_diff": float(np.percentile(d, 90)), "max_diff": float(d.max())}


@pytest.mark.slow
@pytest.mark.parametrize("golden", GOLDEN, indirect=True)
def test_greedy_agrees_with_llama_cpp_on_the_same_f32_weights(golden):
    engine, data = golden
    q8 = data.get("cache_type") == "q8_0"
    failures, stats = compare_greedy(engine, data, "f32", *((Q8_0_LOGPROB_TOL, Q8_0_NEAR_TIE, True) if q8 else ()))
    print(data["model"], data.get("cache_type", "f16"), "f32", stats)
    if q8:
        forced = compare_teacher_forced(engine, data, "f32")
        print(data["model"], "q8_0", "f32 teacher-forced", forced)
        assert forced["top1_agreement"] >= 0.98 and forced["median_diff"] <= 0.05 and forced["p90_diff"] <= 0.15, forced
    # q8_0's wider tie band stops more sequences early: its teacher-forced statistics cover every position
    assert stats["steps"] >= (0.4 if q8 else 0.5) * sum(len(r["tokens"]) for r in data["runs"]["f32"])
    assert not failures, f"{len(failures)} disagreements with llama.cpp ({stats}):\n" + "\n".join(failures[:20])


@pytest.mark.slow
@pytest.mark.parametrize("golden", GOLDEN, indirect=True)
def test_logits_close_to_llama_cpp_on_the_quantized_file(golden):
    engine, data = golden
    stats = compare_teacher_forced(engine, data, "quantized")
    print(data["model"], data.get("cache_type", "f16"), "quantized", stats)
    assert stats["top1_agreement"] >= 0.95, stats
    assert stats["median_diff"] <= 0.1, stats
    assert stats["p90_diff"] <= 0.35, stats
