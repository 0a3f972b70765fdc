"""The tokenizer against llama-server's own answers (fixtures recorded by tests/fixtures/record_tokenizer.py),
the incremental detokenizer, and the refusals."""

from __future__ import annotations

import json
import time
import unicodedata
from pathlib import Path

import gguf
import numpy as np
import pytest

from model.detokenizer import IncrementalDetokenizer, complete_utf8_len
from model.tokenizer import Tokenizer, UnsupportedTokenizer, gguf_fields

FIXTURES = Path(__file__).parent / "fixtures"


def _fixture(name: str) -> dict:
    path = FIXTURES / f"tokenize_{name}.json"
    if not path.exists():
        pytest.fail(f"{path} is missing: run tests/fixtures/record_tokenizer.py")
    return json.loads(path.read_text())


def _cases(name: str) -> list:
    path = FIXTURES / f"tokenize_{name}.json"
    cases = json.loads(path.read_text())["cases"] if path.exists() else []
    return [pytest.param(c, id=f"{i}-{c['request']['content'][:24]!r}") for i, c in enumerate(cases)]


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="module")
def gemma3(gemma3_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gemma3_path)


def _piece_bytes(piece: str | list[int]) -> bytes:
    # llama-server sends a piece that is not valid UTF-8 as its byte values
    return bytes(piece) if isinstance(piece, list) else piece.encode("utf-8")


def _check_case(tok: Tokenizer, case: dict) -> None:
    req = case["request"]
    ids = tok.encode(req["content"], add_special=req["add_special"], parse_special=req["parse_special"])
    assert ids == case["tokens"], f"tokens differ for {req!r}"
    assert [tok.token_to_piece(t, special=True) for t in ids] == [_piece_bytes(p) for p in case["pieces"]]
    assert tok.decode(ids, special=True) == case["detokenized"]


# --- token identity with llama-server ----------------------------------------------------------------

def test_fixtures_are_for_these_models(smollm2_path: Path, gemma3_path: Path):
    for name, path in (("smollm2", smollm2_path), ("gemma3", gemma3_path)):
        data = _fixture(name)
        assert data["file"] == path.name
        assert len(data["cases"]) >= 30


@pytest.mark.parametrize("case", _cases("smollm2"))
def test_smollm2_matches_llama_server(smollm2: Tokenizer, case: dict):
    _check_case(smollm2, case)


@pytest.mark.parametrize("case", _cases("gemma3"))
def test_gemma3_matches_llama_server(gemma3: Tokenizer, case: dict):
    _check_case(gemma3, case)


OTHER_PRE = ("qwen2", "llama-bpe", "default", "gpt-2")


@pytest.mark.parametrize("pre", OTHER_PRE)
def test_other_pre_tokenizers_match_llama_server(smollm2_path: Path, pre: str):
    # recorded on a tiny model carrying SmolLM2's vocabulary and merges under this tokenizer.ggml.pre
    data = _fixture(f"pre_{pre}")
    assert data["pre"] == pre and data["vocab_from"] == smollm2_path.name
    tok = Tokenizer.from_gguf({**gguf_fields(smollm2_path), "tokenizer.ggml.pre": pre})
    assert sorted(tok.eog_ids) == data["eog_ids"]
    for case in data["cases"]:
        _check_case(tok, case)


def test_eog_ids_match_llama_server(smollm2: Tokenizer, gemma3: Tokenizer):
    assert sorted(smollm2.eog_ids) == _fixture("smollm2")["eog_ids"]
    assert sorted(gemma3.eog_ids) == _fixture("gemma3")["eog_ids"]
    assert smollm2.token_to_id["<|im_end|>"] in smollm2.eog_ids
    assert gemma3.token_to_id["<end_of_turn>"] in gemma3.eog_ids


def test_special_ids_and_bos(smollm2: Tokenizer, gemma3: Tokenizer):
    assert (smollm2.n_vocab, smollm2.bos_id, smollm2.eos_id, smollm2.add_bos) == (49152, 1, 2, False)
    assert (gemma3.n_vocab, gemma3.bos_id, gemma3.eos_id, gemma3.add_bos) == (262144, 2, 1, True)
    assert gemma3.encode("Hi", add_special=True, parse_special=True)[0] == gemma3.bos_id
    assert smollm2.encode("Hi", add_special=True, parse_special=True) == smollm2.encode("Hi", False, True)
    assert (gemma3.bos_token, smollm2.eos_token) == ("<bos>", "<|im_end|>")


def test_control_tokens_render_only_when_special(smollm2: Tokenizer):
    im_end = smollm2.token_to_id["<|im_end|>"]
    assert smollm2.token_to_piece(im_end, special=False) == b""
    assert smollm2.token_to_piece(im_end, special=True) == b"<|im_end|>"
    ids = smollm2.encode("<|im_start|>user\nhi<|im_end|>", add_special=False, parse_special=True)
    assert smollm2.decode(ids) == "user\nhi"


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_round_trip(name: str, request: pytest.FixtureRequest):
    tok: Tokenizer = request.getfixturevalue(name)
    for case in _fixture(name)["cases"]:
        text = case["request"]["content"]
        assert tok.decode(tok.encode(text, add_special=False, parse_special=False)) == text


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_two_thousand_token_prompt_takes_milliseconds(name: str, request: pytest.FixtureRequest):
    path = request.getfixturevalue(f"{name}_path")
    tok = Tokenizer.from_gguf(path)  # a fresh tokenizer: no word or fragment cache yet
    text = "\n".join(c["request"]["content"] for c in _fixture(name)["cases"])
    while len(tok.encode(text, add_special=False, parse_special=True)) < 2000:
        text += "\n" + text
    tok = Tokenizer.from_gguf(path)
    t0 = time.perf_counter()
    n = len(tok.encode(text, add_special=True, parse_special=True))
    elapsed_s = time.perf_counter() - t0
    assert n >= 2000
    assert elapsed_s < 0.25, f"{n} tokens took {elapsed_s * 1000:.0f} ms"


def test_code_point_classes_are_llama_cpps_table():
    from model.tokenizer_bpe import _COLLAPSE

    # llama.cpp's table is Unicode 15.1: CJK Extension I is letters, Unicode 16's Kirat Rai digits are not
    assert (_COLLAPSE[0x2EBF0], _COLLAPSE[0x16D70], _COLLAPSE[0x3000], _COLLAPSE[ord("a")]) == ("\xd2", "\xd0", "\x0b", "a")
    if unicodedata.unidata_version not in ("14.0.0", "15.0.0", "15.1.0"):
        pytest.skip(f"Python's Unicode {unicodedata.unidata_version} is newer than llama.cpp's table")
    cls = {"L": "\xd2", "N": "\xd1", "P": "\xd3", "M": "\xd4", "S": "\xd5"}
    space = {0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000}
    for cp in range(0x80, 0x110000):
        cat = unicodedata.category(chr(cp))
        if cat != "Cn":  # every code point Python's Unicode assigns agrees with llama.cpp's class
            assert _COLLAPSE[cp] == ("\x0b" if cp in space else cls.get(cat[0], "\xd0")), hex(cp)


# --- incremental detokenization --------------------------------------------------------------------

def test_detokenizer_holds_a_split_emoji_until_complete(smollm2: Tokenizer):
    text = "ok 🫠 and 𝔘"
    ids = smollm2.encode(text, add_special=False, parse_special=False)
    pieces = [smollm2.token_to_piece(t, special=False) for t in ids]
    assert any(complete_utf8_len(p) < len(p) for p in pieces), "the emoji should be split across tokens"
    detok = IncrementalDetokenizer(smollm2)
    chunks = [detok.push(t) for t in ids]
    assert "".join(chunks) + detok.flush() == text
    assert "\ufffd" not in "".join(chunks)
    held = [i for i, c in enumerate(chunks) if c == ""]
    assert held, "a token ending inside a character releases nothing"


def test_detokenizer_on_cjk_byte_tokens(gemma3: Tokenizer):
    # gemma3 spells a character it lacks with <0xXX> byte tokens
    text = "𖵃中"
    ids = gemma3.encode(text, add_special=False, parse_special=False)
    byte_ids = [t for t in ids if gemma3.tokens[t].startswith("<0x")]
    assert len(byte_ids) == 4
    detok = IncrementalDetokenizer(gemma3)
    chunks = [detok.push(t) for t in ids]
    assert chunks[:3] == ["", "", ""]
    assert "".join(chunks) == text


def test_detokenizer_releases_everything_held_like_llama_server():
    detok = IncrementalDetokenizer(None)
    assert detok.push_bytes(b"ab\xe4") == ""  # the complete "ab" waits with the partial character
    assert detok.pending_bytes == b"ab\xe4"
    assert detok.push_bytes(b"\xb8") == ""
    assert detok.push_bytes(b"\xad!") == "ab中!"
    assert detok.push_bytes(b"\xff") == "\ufffd"  # invalid, not truncated: released at once
    assert detok.push_bytes(b"x\xf0\x9f") == ""
    assert detok.flush() == "x\ufffd"  # forced at the end
    assert detok.flush() == ""


def test_complete_utf8_len_is_validate_utf8():
    assert complete_utf8_len(b"") == 0
    assert complete_utf8_len(b"abc") == 3
    assert complete_utf8_len(b"a\xc3") == 1
    assert complete_utf8_len(b"a\xe4\xb8") == 1
    assert complete_utf8_len(b"a\xf0\x9f\x99") == 1
    assert complete_utf8_len(b"a\xf0\x9f\x99\x82") == 5
    assert complete_utf8_len(b"\xf0abc") == 4  # a lead byte four back is not looked at as cut off


# --- construction from GGUF, and refusals ------------------------------------------------------------

def _tiny_bpe_fields(**over) -> dict:
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<x>", "a", "b", "ab", "Ġ", "Ġa", "Ġab", "c"]
    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3, 4, 1, 1, 1, 1, 1, 1, 1],
        "tokenizer.ggml.merges": ["a b", "Ġ ab", "Ġ a"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 2,
    }
    fields.update(over)
    return fields


def test_tiny_bpe_merges_specials_and_dropped_bytes():
    tok = Tokenizer.from_gguf(_tiny_bpe_fields())
    ab, gab = tok.token_to_id["ab"], tok.token_to_id["Ġab"]
    assert tok.encode("ab ab", add_special=False, parse_special=False) == [ab, gab]
    im_start, x = tok.token_to_id["<|im_start|>"], tok.token_to_id["<x>"]
    # control tokens split only with parse_special; user-defined ones always
    assert tok.encode("<|im_start|>ab<x>", False, True) == [im_start, ab, x]
    assert x in tok.encode("<|im_start|>ab<x>", False, False)
    assert im_start not in tok.encode("<|im_start|>ab<x>", False, False)
    # "z" has no token and no byte token: dropped, as llama.cpp drops it
    assert tok.encode("abz", False, False) == [ab]
    assert tok.eog_ids == {0, 2}


def test_from_gguf_reads_a_path_a_reader_and_its_fields(tmp_path: Path):
    fields = _tiny_bpe_fields()
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(fields["tokenizer.ggml.tokens"])
    w.add_token_types(fields["tokenizer.ggml.token_type"])
    w.add_token_merges(fields["tokenizer.ggml.merges"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(str(path))
    from_path = gguf_fields(path)
    assert from_path["tokenizer.ggml.tokens"] == fields["tokenizer.ggml.tokens"]
    assert list(from_path["tokenizer.ggml.token_type"]) == fields["tokenizer.ggml.token_type"]
    text = "<|im_start|>ab ab<x>c"
    want = Tokenizer.from_gguf(fields).encode(text, False, True)
    for source in (path, reader, reader.fields):
        assert Tokenizer.from_gguf(source).encode(text, False, True) == want


@pytest.mark.parametrize(("over", "reason"), [
    ({"tokenizer.ggml.model": "bert"}, "unsupported tokenizer model 'bert'"),
    ({"tokenizer.ggml.pre": "deepseek-coder"}, "unsupported pre-tokenizer 'deepseek-coder'"),
    ({"tokenizer.ggml.merges": None}, "no tokenizer.ggml.merges"),
    ({"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": 99, "tokenizer.ggml.pre": "qwen2"},
     None),
    ({"tokenizer.ggml.token_type": [1, 1]}, "token_type has 2 entries"),
])
def test_refusals_name_the_reason(over: dict, reason: str | None):
    fields = {k: v for k, v in _tiny_bpe_fields(**over).items() if v is not None}
    if reason is None:  # an out-of-range BOS id falls back to gpt2's default 11, which is out of range too
        reason = "add_bos_token is true, but there is no BOS token"
    with pytest.raises(UnsupportedTokenizer, match=reason):
        Tokenizer.from_gguf(fields)


def test_ambiguous_fim_role_is_refused():
    fields = _tiny_bpe_fields()
    fields["tokenizer.ggml.tokens"] = [*fields["tokenizer.ggml.tokens"][:-1], "<|fim_pad|>"] + ["<fim_pad>"]
    fields["tokenizer.ggml.token_type"] = [*fields["tokenizer.ggml.token_type"], 3]
    with pytest.raises(UnsupportedTokenizer, match="ambiguous fim_pad"):
        Tokenizer.from_gguf(fields)
