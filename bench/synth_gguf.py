"""A GGUF with random weights in real block types, shaped like a named model, pinned beside itself.

    python bench/synth_gguf.py llama3-8b OUT.gguf [--seed 0]      # ~4.9 GB, Q4_K_M's mix
    python bench/synth_gguf.py tiny OUT.gguf                       # a few hundred KB, the same mix
    python bench/synth_gguf.py llama3-8b OUT.gguf --layers 2       # ~1 GB: the 8B's matrices, 2 layers

--layers N keeps the shape's matrices and vocabulary and cuts its layers to N (bench/parallel.py: the
8B's widths on a CPU box, where the embeddings and output, 0.7 GB, are most of the file); the mix
follows the cut count, as llama.cpp quantizing an N-layer model would pick it.

For a GPU machine that cannot download a model: what a step costs depends on the shapes and the
block types, not on the values. The mix is llama.cpp's Q4_K_M (llama_tensor_get_type in
src/llama-quant.cpp): Q4_K everywhere, Q6_K for `output` and for attn_v / ffn_down of the layers
`use_more_bits` picks, norms F32. Each block is random bytes with its f16 fields set: d a small
positive f16 scaled so the weights' std is about 0.02, and dmin (or Q4_1/Q5_1's m) the mean of the
codes times d, so the weights centre on 0 and the activations stay finite through every layer.

The tokenizer is byte-level BPE ("gpt2", pre-tokenizer "llama-bpe"): 256 byte tokens, a few merges,
filler tokens up to the vocabulary's size and Llama 3's special tokens at its end, so prompts
tokenize, sampled ids detokenize, and <|eot_id|> ends a generation.

The file is written tensor by tensor in chunks of at most CHUNK_BYTES (never whole in memory), then
hashed into FILE.FORK.json, as `bankml fork FILE` writes it, so the normal gate (bankml.verify) takes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bankml.pin import fork_record  # noqa: E402

Q = gguf.GGMLQuantizationType
CHUNK_BYTES = 32 << 20
WEIGHT_STD = 0.02


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    rope_base: float
    context_length: int


SHAPES = {
    "llama3-8b": Shape(n_layer=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8, head_dim=128, n_vocab=128256,
                       rope_base=500000.0, context_length=8192),
    # K-quant rows are 256 wide: the smallest widths that keep every matrix in real blocks
    "tiny": Shape(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64, n_vocab=512,
                  rope_base=500000.0, context_length=4096),
}

# Llama 3's first special tokens (ids 128000..); the rest of its 256 are reserved ones
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
            "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
MERGES = ["Ġ t", "h e", "i n", "Ġ a", "e r", "o n"]


def n_specials(shape: Shape) -> int:
    return 256 if shape.n_vocab > 100_000 else len(SPECIALS)


def vocabulary(shape: Shape) -> tuple[list[str], list[int]]:
    """(tokens, token types): bytes, merges, fillers, then the special tokens."""
    n_special = n_specials(shape)
    specials = SPECIALS + [f"<|reserved_special_token_{i}|>" for i in range(3, 3 + n_special - len(SPECIALS))]
    normal = _byte_tokens() + [m.replace(" ", "") for m in MERGES]
    normal += [f"Ġw{i}" for i in range(shape.n_vocab - n_special - len(normal))]
    types = [gguf.TokenType.NORMAL] * len(normal) + [gguf.TokenType.CONTROL] * n_special
    return normal + specials, types


def _byte_tokens() -> list[str]:
    # GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to U+0100 onwards
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama-quant.cpp's use_more_bits: the first and last eighth of the layers, and every third between."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def tensor_plan(shape: Shape) -> list[tuple[str, tuple[int, ...], Q]]:
    """(GGUF name, numpy shape [rows, cols], type) of every tensor, in file order."""
    d, f, v = shape.n_embd, shape.n_ff, shape.n_vocab
    q, kv = shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim
    plan = [("token_embd.weight", (v, d), Q.Q4_K), ("output_norm.weight", (d,), Q.F32),
            ("output.weight", (v, d), Q.Q6_K)]
    for il in range(shape.n_layer):
        more = Q.Q6_K if use_more_bits(il, shape.n_layer) else Q.Q4_K
        p = f"blk.{il}."
        plan += [(p + "attn_norm.weight", (d,), Q.F32), (p + "attn_q.weight", (q, d), Q.Q4_K),
                 (p + "attn_k.weight", (kv, d), Q.Q4_K), (p + "attn_v.weight", (kv, d), more),
                 (p + "attn_output.weight", (d, q), Q.Q4_K), (p + "ffn_norm.weight", (d,), Q.F32),
                 (p + "ffn_gate.weight", (f, d), Q.Q4_K), (p + "ffn_up.weight", (f, d), Q.Q4_K),
                 (p + "ffn_down.weight", (d, f), more)]
    return plan


def nbytes(numpy_shape: tuple[int, ...], qtype: Q) -> int:
    per_block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(numpy_shape)) // per_block * block_bytes


# Byte offsets of each block's f16 fields: ("d", offset) scales; ("min", offset) is subtracted (d * the
# codes' mean centres the weights); ("m", offset) is added (minus that).
_F16_FIELDS = {
    Q.Q4_0: (("d", 0),), Q.Q4_1: (("d", 0), ("m", 2)), Q.Q5_0: (("d", 0),), Q.Q5_1: (("d", 0), ("m", 2)),
    Q.Q8_0: (("d", 0),), Q.Q2_K: (("d", 80), ("min", 82)), Q.Q3_K: (("d", 108),),
    Q.Q4_K: (("d", 0), ("min", 2)), Q.Q5_K: (("d", 0), ("min", 2)), Q.Q6_K: (("d", 208),),
}
_CODE_MEAN = {Q.Q4_1: 7.5, Q.Q5_1: 15.5, Q.Q2_K: 1.5, Q.Q4_K: 7.5, Q.Q5_K: 15.5}
_unit_std: dict[Q, float] = {}


def random_blocks(rng: np.random.Generator, n_blocks: int, qtype: Q, d_scale: float) -> np.ndarray:
    """uint8 [n_blocks, block_bytes]: uniform code bytes, f16 fields d ~ d_scale * U(0.5, 1.5)."""
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    n = n_blocks * block_bytes
    # the generator's raw 64-bit words: several times faster than rng.bytes or rng.integers
    blocks = rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n].reshape(n_blocks, block_bytes)
    d = d_scale * rng.uniform(0.5, 1.5, n_blocks)
    for role, at in _F16_FIELDS[qtype]:
        value = {"d": d, "min": d * _CODE_MEAN.get(qtype, 0.0), "m": -d * _CODE_MEAN.get(qtype, 0.0)}[role]
        blocks[:, at:at + 2] = value.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return blocks


def d_scale_for(qtype: Q) -> float:
    """The d that gives weights of std WEIGHT_STD: measured once per type through gguf's dequantizer."""
    if qtype not in _unit_std:
        blocks = random_blocks(np.random.default_rng(1234), 256, qtype, 1.0)
        _unit_std[qtype] = float(gguf.quants.dequantize(blocks, qtype).std())
    return WEIGHT_STD / _unit_std[qtype]


class _Stream:
    """What GGUFWriter.write_tensor_data reads of an array (`nbytes`, `tofile`), written chunk by chunk."""

    def __init__(self, n_bytes: int, chunks: Iterator[np.ndarray]):
        self.nbytes = n_bytes
        self.chunks = chunks

    def tofile(self, fout) -> None:
        written = 0
        for chunk in self.chunks:
            fout.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))
            written += chunk.nbytes
        if written != self.nbytes:
            raise RuntimeError(f"wrote {written} bytes of a {self.nbytes}-byte tensor")


def tensor_chunks(rng: np.random.Generator, numpy_shape: tuple[int, ...], qtype: Q) -> Iterator[np.ndarray]:
    """A tensor's bytes in chunks of at most CHUNK_BYTES (whole rows)."""
    if qtype == Q.F32:  # norms: around 1, like trained ones
        yield (1.0 + 0.1 * rng.standard_normal(numpy_shape)).astype(np.float32)
        return
    rows, cols = numpy_shape
    per_block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    row_blocks = cols // per_block
    step = max(1, CHUNK_BYTES // (row_blocks * block_bytes))
    d_scale = d_scale_for(qtype)
    for r0 in range(0, rows, step):
        yield random_blocks(rng, (min(rows, r0 + step) - r0) * row_blocks, qtype, d_scale)


def shape_of(shape_name: str, layers: int | None = None) -> Shape:
    """The named shape, with its layer count cut to `layers` when given."""
    shape = SHAPES[shape_name]
    if layers is None:
        return shape
    if not 1 <= layers <= shape.n_layer:
        raise ValueError(f"layers must be 1..{shape.n_layer} for {shape_name}, got {layers}")
    return dataclasses.replace(shape, n_layer=layers)


def write(path: str | Path, shape_name: str, *, seed: int = 0, layers: int | None = None) -> Path:
    """Write the synthetic `shape_name` model (`layers` of them, default the shape's) to `path` and its
    FORK.json to `path`.FORK.json.

    Both appear whole or not at all: the model is written and hashed as `path`.partial, then renamed, then
    its FORK.json (written beside as .partial too) -- so a writer killed part way (a time box) leaves no
    file that looks finished, and a reader that finds both has the model they pin."""
    shape = shape_of(shape_name, layers)
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    _write_model(partial, shape_name if layers is None else f"{shape_name}-{layers}l", shape, seed)
    record = fork_record(partial)
    record["files"][0]["path"] = path.name
    record["pinned_from"] = record["pinned_from"].replace(str(partial.resolve()), str(path.resolve()))
    fork = path.with_name(path.name + ".FORK.json")
    fork_partial = fork.with_name(fork.name + ".partial")
    fork_partial.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    fork.unlink(missing_ok=True)  # a FORK.json left by an older file must not pin the new one, even briefly
    partial.replace(path)
    fork_partial.replace(fork)
    return path


def _write_model(path: Path, shape_name: str, shape: Shape, seed: int) -> None:
    rng = np.random.Generator(np.random.SFC64(seed))  # the fastest of numpy's generators
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"synthetic-{shape_name}")
    w.add_context_length(shape.context_length)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    tokens, types = vocabulary(shape)
    first_special = shape.n_vocab - n_specials(shape)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(first_special + SPECIALS.index("<|begin_of_text|>"))
    w.add_eos_token_id(first_special + SPECIALS.index("<|eot_id|>"))
    w.add_add_bos_token(True)

    plan = tensor_plan(shape)
    for name, numpy_shape, qtype in plan:
        # int8, not uint8: gguf-py then takes the shape as elements, not bytes
        w.add_tensor_info(name, numpy_shape, np.dtype(np.float32 if qtype == Q.F32 else np.int8),
                          nbytes(numpy_shape, qtype), raw_dtype=None if qtype == Q.F32 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, numpy_shape, qtype in plan:
        w.write_tensor_data(_Stream(nbytes(numpy_shape, qtype), tensor_chunks(rng, numpy_shape, qtype)))
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, help="cut the shape's layer count to this (default: the shape's)")
    args = ap.parse_args()
    try:
        shape_of(args.shape, args.layers)
    except ValueError as e:
        ap.error(str(e))
    path = write(args.out, args.shape, seed=args.seed, layers=args.layers)
    out = {"path": str(path), "bytes": path.stat().st_size, "shape": args.shape}
    if args.layers is not None:
        out["layers"] = args.layers
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
