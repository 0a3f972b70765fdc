"""How far ggml's activation rounding moves logprobs, and why no f32 engine can follow it. Prints JSON.

    python bench/rounding.py [--models smollm2,gemma3] [--nudge 1e-6]

llama.cpp's CPU backend rounds every quantized matmul's input to 8 bits (model/actquant.py). For each
model with a golden fixture (tests/fixtures/golden_*.json), on llama.cpp's own token sequences:
- `agreement`: our log-softmax against llama.cpp's quantized run and its F32 run, with f32
  activations and with ggml's rounding emulated (`Engine.load(activations="ggml")`): top-1 agreement,
  median / 90th percentile / max |dlogprob| over llama.cpp's top-5 (tests/test_golden.py's measure).
- `nudge`: the same sequences with the token embeddings multiplied by (1 + nudge * N(0, 1)): how far
  that moves our own top-5 logprobs, per mode. Under the rounding a 1e-6 nudge flips a few roundings,
  each flip moves later activations by a rounding step, and the flips cascade through the layers:
  the result is as far from the un-nudged run as two engines' independent roundings are from each
  other. Matching llama.cpp's quantized logits to 0.05 nats therefore takes bit-identical arithmetic
  (every sum in ggml's order), which an XLA engine does not have.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from test_golden import compare_teacher_forced  # noqa: E402

from bankml.default_model import models_dir  # noqa: E402
from model import forward as forward_module  # noqa: E402
from model.engine import Engine  # noqa: E402

FILES = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3": "gemma-3-270m-q4_k_m.gguf"}


def _sequences(data: dict) -> list[tuple[list[int], int]]:
    return [(p["prompt_tokens"] + r["tokens"][:-1], len(p["prompt_tokens"]))
            for p, r in zip(data["prompts"], data["runs"]["quantized"], strict=True)]


def _top5_logprobs(engine: Engine, data: dict) -> list[np.ndarray]:
    return [np.asarray(jax.nn.log_softmax(engine.logits(seq)[n - 1:], axis=-1)) for seq, n in _sequences(data)]


def _nudged(engine: Engine, data: dict, nudge: float) -> dict:
    base = _top5_logprobs(engine, data)
    plain = forward_module.embed

    def embed(weights, tokens, config):
        x = plain(weights, tokens, config)
        return x * (1 + nudge * jax.random.normal(jax.random.PRNGKey(0), x.shape))

    forward_module.embed = embed
    jax.clear_caches()  # the compiled programs traced the plain embedding
    try:
        moved = _top5_logprobs(engine, data)
    finally:
        forward_module.embed = plain
        jax.clear_caches()
    diffs = []
    for a, b in zip(base, moved, strict=True):
        top = np.argsort(-a, axis=-1)[:, :5]
        diffs.append(np.abs(np.take_along_axis(a, top, -1) - np.take_along_axis(b, top, -1)).ravel())
    d = np.concatenate(diffs)
    return {"median": float(np.median(d)), "p90": float(np.percentile(d, 90)), "max": float(d.max())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--nudge", type=float, default=1e-6)
    args = ap.parse_args()
    result = {"nudge": args.nudge}
    for name in args.models.split(","):
        path = models_dir() / FILES[name]
        data = json.loads((ROOT / "tests" / "fixtures" / f"golden_{name}.json").read_text())
        if not path.exists():
            result[name] = {"skipped": f"{path} is not here"}
            continue
        out = {}
        for mode in ("f32", "ggml"):
            engine = Engine.load(path, verified=True, n_ctx=512, warmup=False, activations=mode)
            out[mode] = {"vs_quantized": compare_teacher_forced(engine, data, "quantized"),
                         "vs_f32": compare_teacher_forced(engine, data, "f32"),
                         "nudge": _nudged(engine, data, args.nudge)}
        result[name] = out
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
