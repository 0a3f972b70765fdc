"""The tokenizer, built from the GGUF's vocabulary keys, token-identical to llama.cpp's.

`Tokenizer.from_gguf(fields)` mirrors `llama_vocab::impl::load` (src/llama-vocab.cpp, llama.cpp
b11434): token types become attributes, special ids come from the `tokenizer.ggml.*_token_id` keys
over llama.cpp's defaults, and the end-of-generation set and a few attributes are then fixed up by
token *text*, as llama.cpp does (`<|im_end|>`, `<end_of_turn>`, `</s>`, FIM roles...).

`encode` is `llama_tokenize`: special tokens are cut out of the text first (`tokenizer_st_partition`:
longest first; CONTROL and UNKNOWN only when `parse_special`, USER_DEFINED always), then each text
fragment goes to byte-level BPE (model/tokenizer_bpe.py) or SentencePiece (model/tokenizer_spm.py).
`token_to_piece` is `llama_token_to_piece`: control tokens give b"" unless `special`.

Supported: `tokenizer.ggml.model` "gpt2" with the pre-tokenizers in `tokenizer_bpe.PRE_TOKENIZERS`,
and "llama" (SentencePiece). Anything else raises `UnsupportedTokenizer` naming the reason.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from model.tokenizer_bpe import (
    BYTE_TO_CHAR,
    CHAR_TO_BYTE,
    PRE_TOKENIZERS,
    BpeModel,
    InvalidText,
    TokenLimitExceeded,
    WordTooLong,
    parse_merges,
)
from model.tokenizer_gguf import gguf_fields
from model.tokenizer_spm import SpmModel

__all__ = ["InvalidText", "TokenAttr", "TokenLimitExceeded", "Tokenizer", "UnsupportedTokenizer", "WordTooLong",
           "gguf_fields"]


class UnsupportedTokenizer(ValueError):
    """The GGUF's tokenizer is one we cannot reproduce exactly. The message is the reason."""


class TokenAttr(enum.IntFlag):
    """llama_token_attr (include/llama.h)."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8
    SINGLE_WORD = 1 << 9


# GGUF token types (llama_token_type) -> attributes.
_TYPE_ATTR = {0: TokenAttr.UNDEFINED, 1: TokenAttr.NORMAL, 2: TokenAttr.UNKNOWN, 3: TokenAttr.CONTROL,
              4: TokenAttr.USER_DEFINED, 5: TokenAttr.UNUSED, 6: TokenAttr.BYTE}
_SPECIAL_ATTRS = TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN
_ASCII_SPACE = " \t\n\v\f\r"  # C isspace, which llama.cpp's LSTRIP/RSTRIP use

# Text-detected roles, in llama_vocab::impl::load's words. Each FIM role must resolve to one token:
# llama.cpp takes whichever its hash map yields first, so two candidates would make us guess.
_EOT_NAMES = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_FIM_NAMES = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_NAMES = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
              "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
              "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
              "<｜end▁of▁sentence｜>", "[e~[")
_ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss

_ID_KEYS = {
    "bos": ("tokenizer.ggml.bos_token_id",),
    "eos": ("tokenizer.ggml.eos_token_id",),
    "eot": ("tokenizer.ggml.eot_token_id",),
    "eom": ("tokenizer.ggml.eom_token_id",),
    "unk": ("tokenizer.ggml.unknown_token_id",),
    "sep": ("tokenizer.ggml.seperator_token_id",),
    "pad": ("tokenizer.ggml.padding_token_id",),
    "mask": ("tokenizer.ggml.mask_token_id",),
    "fim_pre": ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
    "fim_suf": ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
    "fim_mid": ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"),
    "fim_pad": ("tokenizer.ggml.fim_pad_token_id",),
    "fim_rep": ("tokenizer.ggml.fim_rep_token_id",),
    "fim_sep": ("tokenizer.ggml.fim_sep_token_id",),
}
# llama.cpp's default special ids per model, before the GGUF keys.
_DEFAULT_IDS = {"llama": {"bos": 1, "eos": 2, "unk": 0}, "gpt2": {"bos": 11, "eos": 11}}


class Tokenizer:
    """A GGUF vocabulary and the tokenizer it names. Build it with `from_gguf`."""

    def __init__(self, *, model: str, pre: str, tokens: Sequence[str], attrs: Sequence[int],
                 special_ids: Mapping[str, int | None], add_bos: bool, add_eos: bool,
                 add_space_prefix: bool, eog_ids: Iterable[int], merges: Sequence[str] = (),
                 scores: Sequence[float] = ()):
        self.model = model
        self.pre = pre
        self.tokens = tuple(tokens)
        self.attrs = [int(a) for a in attrs]
        self.token_to_id = {t: i for i, t in enumerate(self.tokens)}
        self.special_ids = dict(special_ids)
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.add_space_prefix = add_space_prefix
        self.eog_ids: frozenset[int] = frozenset(eog_ids)
        if model == "gpt2":
            self._bpe: BpeModel | None = BpeModel(self.token_to_id, parse_merges(merges), PRE_TOKENIZERS[pre])
            self._spm: SpmModel | None = None
        else:
            self._bpe = None
            self._spm = SpmModel(self.token_to_id, list(scores) if len(scores) else [0.0] * len(self.tokens))
        self._pieces: dict[tuple[int, bool], bytes] = {}
        self._cover: int | None = None  # min_tokens' figures, computed at its first use
        self._sounding = b""
        self._build_special_index()

    # --- construction ----------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, fields: Any) -> Tokenizer:
        """Build from GGUF key/values: a path, a `GGUFReader`, its `.fields`, or a dict of decoded values
        (see `gguf_fields`). Raises `UnsupportedTokenizer` with the reason for anything we cannot honour."""
        kv = gguf_fields(fields, ("tokenizer.", "general."))
        model = kv.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise UnsupportedTokenizer(
                f"unsupported tokenizer model {model!r}: this engine tokenizes 'gpt2' (byte-level BPE) "
                "and 'llama' (SentencePiece)")
        tokens = kv.get("tokenizer.ggml.tokens")
        if tokens is None or not len(tokens):
            raise UnsupportedTokenizer("the GGUF has no tokenizer.ggml.tokens")
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # as llama.cpp does
        if len(set(tokens)) != len(tokens):
            raise UnsupportedTokenizer("duplicate token text in tokenizer.ggml.tokens")
        n_vocab = len(tokens)

        pre = ""
        add_bos, add_eos, add_space_prefix = (True, False, True) if model == "llama" else (False, False, False)
        merges: Sequence[str] = ()
        if model == "gpt2":
            pre = kv.get("tokenizer.ggml.pre") or "default"
            if pre not in PRE_TOKENIZERS:
                raise UnsupportedTokenizer(
                    f"unsupported pre-tokenizer {pre!r}: this engine runs {', '.join(sorted(PRE_TOKENIZERS))}")
            merges = kv.get("tokenizer.ggml.merges")
            if merges is None:
                raise UnsupportedTokenizer("the GGUF has no tokenizer.ggml.merges for its gpt2 tokenizer")
            add_bos = PRE_TOKENIZERS[pre].add_bos
        add_space_prefix = bool(kv.get("tokenizer.ggml.add_space_prefix", add_space_prefix))

        types = kv.get("tokenizer.ggml.token_type")
        if types is not None and len(types) < n_vocab:
            raise UnsupportedTokenizer(f"tokenizer.ggml.token_type has {len(types)} entries for {n_vocab} tokens")
        type_attr = {t: int(a) for t, a in _TYPE_ATTR.items()}
        attrs = [type_attr.get(t, 0) for t in _as_list(types)[:n_vocab]] if types is not None \
            else [int(TokenAttr.NORMAL)] * n_vocab
        scores = kv.get("tokenizer.ggml.scores")
        if scores is not None and len(scores) < n_vocab:
            raise UnsupportedTokenizer(f"tokenizer.ggml.scores has {len(scores)} entries for {n_vocab} tokens")
        scores = [float(s) for s in _as_list(scores)[:n_vocab]] if scores is not None else []

        ids: dict[str, int | None] = {role: None for role in _ID_KEYS}
        ids.update(_DEFAULT_IDS[model])
        for role, keys in _ID_KEYS.items():
            if ids[role] is not None and ids[role] >= n_vocab:
                ids[role] = None
            for key in keys:
                value = kv.get(key)
                if value is not None and 0 <= int(value) < n_vocab:
                    ids[role] = int(value)
        if "tokenizer.ggml.add_bos_token" in kv:
            add_bos = bool(kv["tokenizer.ggml.add_bos_token"])
        if "tokenizer.ggml.add_eos_token" in kv:
            add_eos = bool(kv["tokenizer.ggml.add_eos_token"])
        if add_bos and ids["bos"] is None:
            raise UnsupportedTokenizer("tokenizer.ggml.add_bos_token is true, but there is no BOS token")
        if add_eos and ids["eos"] is None:
            raise UnsupportedTokenizer("tokenizer.ggml.add_eos_token is true, but there is no EOS token")

        eog = _fix_up_by_text(tokens, attrs, ids)
        name = str(kv.get("general.name", "")).lower()
        if "phi-3" in name or "phi3" in name:
            _phi3_rstrip(tokens, attrs)
        return cls(model=model, pre=pre, tokens=tokens, attrs=attrs, special_ids=ids, add_bos=add_bos,
                   add_eos=add_eos, add_space_prefix=add_space_prefix, eog_ids=eog, merges=merges,
                   scores=scores)

    def _build_special_index(self) -> None:
        # llama.cpp's cache_special_tokens: CONTROL, USER_DEFINED or UNKNOWN, longest (in bytes) first.
        special = [i for i, a in enumerate(self.attrs) if a & _SPECIAL_ATTRS]
        special.sort(key=lambda i: -len(self.tokens[i].encode("utf-8", "surrogateescape")))
        self._special_rank = {tid: rank for rank, tid in enumerate(special)}
        # A trie over their text finds the ones a given text contains without scanning them all.
        trie: dict = {}
        for tid in special:
            node = trie
            for ch in self.tokens[tid]:
                node = node.setdefault(ch, {})
            node[None] = tid
        self._trie = trie
        self._first_chars = re.compile("[" + "".join(re.escape(c) for c in trie) + "]") if trie else None

    # --- properties the engine uses ----------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    @property
    def bos_id(self) -> int | None:
        return self.special_ids["bos"]

    @property
    def eos_id(self) -> int | None:
        return self.special_ids["eos"]

    @property
    def bos_token(self) -> str:
        """The BOS text a chat template sees (llama.cpp: the piece with special=true), "" without one."""
        return "" if self.bos_id is None else self.token_to_piece(self.bos_id, special=True).decode("utf-8", "replace")

    @property
    def eos_token(self) -> str:
        return "" if self.eos_id is None else self.token_to_piece(self.eos_id, special=True).decode("utf-8", "replace")

    # --- text -> tokens ----------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool, parse_special: bool, limit: int | None = None) -> list[int]:
        """`llama_tokenize(text, add_special, parse_special)`. `add_special` adds BOS (and EOS) as the GGUF's
        add_bos_token / add_eos_token say; `parse_special` lets control tokens written in the text count.

        With `limit`, a text that makes more than `limit` tokens raises TokenLimitExceeded with the count
        known when it stopped: at once, when its bytes alone need more tokens than that (`min_tokens`),
        else as soon as the tokens made pass the limit. The work is then bounded by the limit, not by
        the text. Without it, a text of any size is tokenized whole (in linear time: model/tokenizer_bpe.py
        merges a very long word in exact pieces, or refuses it)."""
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidText("the text is not valid Unicode (it holds a lone surrogate)") from None
        if limit is not None and text:
            at_least = self.min_tokens(text)
            if at_least > limit:
                raise TokenLimitExceeded(at_least)
        out: list[int] = []
        fragments = self._partition(text, parse_special) if text else []
        if add_special and self.add_bos:
            out.append(self.bos_id)
        if self._spm is not None:
            prev_special = True  # SentencePiece prefixes a space to text that follows a special token
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                else:
                    if self.add_space_prefix and prev_special:
                        frag = " " + frag
                    out.extend(self._spm.tokenize(frag.replace(" ", "\u2581")))
                    prev_special = False
                if limit is not None and len(out) > limit:
                    raise TokenLimitExceeded(len(out))
        else:
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    self._bpe.tokenize(frag, out, limit, self.min_tokens)
                if limit is not None and len(out) > limit:
                    raise TokenLimitExceeded(len(out))
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens `text` makes: its bytes over the most any token covers, less the
        bytes that may make no token at all (a byte with no token of its own is dropped; whitespace
        next to an LSTRIP/RSTRIP special is stripped)."""
        if self._cover is None:
            special, strip = int(_SPECIAL_ATTRS), int(TokenAttr.LSTRIP | TokenAttr.RSTRIP)  # int ops: fast

            def cover(t: str, attr: int) -> int:  # the most text bytes one token can stand for
                if attr & special:
                    return len(t.encode("utf-8", "surrogateescape"))
                if self._bpe is not None:
                    return len(t)  # one byte per byte-level character
                return len(t.encode("utf-8", "surrogateescape")) - 2 * t.count("\u2581")  # U+2581 is a space

            self._cover = max(1, max(cover(t, a) for t, a in zip(self.tokens, self.attrs, strict=True)))
            silent = set()
            if self._bpe is not None:
                silent = {b for b in range(256) if BYTE_TO_CHAR[b] not in self.token_to_id}
            if any(a & strip for a in self.attrs):
                silent |= set(_ASCII_SPACE.encode())
            self._sounding = bytes(b for b in range(256) if b not in silent)
        data = text.encode("utf-8", "surrogatepass")
        n_silent = len(data.translate(None, self._sounding)) if len(self._sounding) < 256 else 0
        return -(-(len(data) - n_silent) // self._cover)

    def _specials_in(self, text: str) -> list[int]:
        """The special tokens whose text occurs in `text`, in llama.cpp's partition order."""
        if self._first_chars is None:
            return []
        found: set[int] = set()
        trie, n = self._trie, len(text)
        for m in self._first_chars.finditer(text):
            node, p = trie, m.start()
            while p < n:
                node = node.get(text[p])
                if node is None:
                    break
                p += 1
                tid = node.get(None)
                if tid is not None:
                    found.add(tid)
        return sorted(found, key=self._special_rank.__getitem__)

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """tokenizer_st_partition: cut special tokens out of the text, longest first, left to right."""
        fragments: list[str | int] = [text]
        for tid in self._specials_in(text):
            attr = self.attrs[tid]
            if not parse_special and attr & (TokenAttr.CONTROL | TokenAttr.UNKNOWN):
                continue
            piece = self.tokens[tid]
            out: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or piece not in frag:
                    out.append(frag)
                    continue
                start = 0
                while True:
                    match = frag.find(piece, start)
                    if match == -1:
                        if start < len(frag):
                            out.append(frag[start:])
                        break
                    left = frag[start:match]
                    if attr & TokenAttr.LSTRIP:
                        left = left.rstrip(_ASCII_SPACE)
                    if left:
                        out.append(left)
                    out.append(tid)
                    start = match + len(piece)
                    if attr & TokenAttr.RSTRIP:
                        while start < len(frag) and frag[start] in _ASCII_SPACE:
                            start += 1
            fragments = out
        return fragments

    # --- tokens -> text ----------------------------------------------------------------------------

    def token_to_piece(self, token: int, special: bool) -> bytes:
        """llama_token_to_piece: the bytes a token stands for. Control and unknown tokens give b"" unless
        `special`; user-defined tokens give their text."""
        key = (token, special)
        piece = self._pieces.get(key)
        if piece is None:
            piece = self._piece(token, special)
            self._pieces[key] = piece
        return piece

    def _piece(self, token: int, special: bool) -> bytes:
        if not 0 <= token < len(self.tokens):
            raise IndexError(f"token id {token} is outside the vocabulary of {len(self.tokens)}")
        attr, text = self.attrs[token], self.tokens[token]
        if not special and attr & (TokenAttr.UNKNOWN | TokenAttr.CONTROL):
            return b""
        if attr & (TokenAttr.UNKNOWN | TokenAttr.CONTROL | TokenAttr.USER_DEFINED):
            return text.encode("utf-8", "surrogateescape")
        if attr & TokenAttr.NORMAL:
            if self._spm is not None:
                return text.replace("\u2581", " ").encode("utf-8", "surrogateescape")
            return _decode_byte_level(text)
        if attr & TokenAttr.BYTE:
            return bytes([int(text[3:5], 16)])
        return b""  # UNUSED / UNDEFINED: nothing, as llama.cpp

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        """The text of a token sequence (invalid UTF-8 becomes U+FFFD). `special=True` renders control
        tokens, as llama-server's /detokenize does."""
        return b"".join(self.token_to_piece(t, special) for t in ids).decode("utf-8", "replace")


def _as_list(values: Any) -> list:
    tolist = getattr(values, "tolist", None)  # numpy arrays: one C call instead of 262k scalar boxes
    return tolist() if callable(tolist) else list(values)


def _decode_byte_level(text: str) -> bytes:
    """llama_decode_text: GPT-2 byte alphabet back to bytes; an unmapped character is spelled out."""
    out = bytearray()
    for ch in text:
        b = CHAR_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
        else:
            utf8 = ch.encode("utf-8", "surrogateescape")
            out += b"[UNK_BYTE_0x" + utf8.hex().encode() + text.encode("utf-8", "surrogateescape") + b"]"
    return bytes(out)


def _fix_up_by_text(tokens: Sequence[str], attrs: list[int], ids: dict[str, int | None]) -> set[int]:
    """llama.cpp's text-based fix-ups: find EOT/EOM/FIM roles by name, make end-of-generation names
    CONTROL, and collect the EOG set. Mutates `attrs` and `ids`; returns the EOG ids."""
    index = {t: i for i, t in enumerate(tokens)}
    control = int(TokenAttr.CONTROL)

    def found(names: Sequence[str]) -> list[int]:
        return sorted(index[n] for n in names if n in index)

    if ids["eot"] is None and (cands := found(_EOT_NAMES)):
        ids["eot"] = cands[0]  # every candidate is also an EOG name below, so the choice changes nothing
    if ids["eom"] is None and (cands := found(("<|eom_id|>",))):
        ids["eom"] = cands[0]
    for role, names in _FIM_NAMES.items():
        if ids[role] is not None:
            continue
        cands = found(names)
        if len(cands) > 1:
            raise UnsupportedTokenizer(
                f"ambiguous {role} token: the vocabulary has {', '.join(repr(tokens[i]) for i in cands)}")
        if cands:
            ids[role] = cands[0]
            attrs[cands[0]] |= control

    eog = {ids[r] for r in ("fim_pad", "fim_rep", "fim_sep") if ids[r] is not None}
    for tid in found(_EOG_NAMES):
        eog.add(tid)
        attrs[tid] |= control
    for tid in found(_ALWAYS_USER_DEFINED):
        attrs[tid] = int(TokenAttr.USER_DEFINED)
    eog.update(ids[r] for r in ("eos", "eot", "eom") if ids[r] is not None)

    # o200k_harmony / solar-open: <|end|> is not an end of generation there.
    texts = {tokens[t] for t in eog}
    if "<|end|>" in texts and ({"<|return|>", "<|call|>"} <= texts or {"<|calls|>", "<|flush|>"} <= texts):
        end = index["<|end|>"]
        eog.discard(end)
        attrs[end] = int(TokenAttr.USER_DEFINED)
    # gemma4 / paddleocr: </s> is text there.
    if "<|tool_response>" in texts and "</s>" in texts:
        s = index["</s>"]
        eog.discard(s)
        attrs[s] = int(TokenAttr.NORMAL)
    return eog


def _phi3_rstrip(tokens: Sequence[str], attrs: list[int]) -> None:
    """llama.cpp sets RSTRIP on Phi-3's special tokens by model name (llama_vocab::impl::load)."""
    for i, a in enumerate(attrs):
        if a & _SPECIAL_ATTRS:
            attrs[i] |= int(TokenAttr.RSTRIP)
    index = {t: i for i, t in enumerate(tokens)}
    if "</s>" in index:
        attrs[index["</s>"]] |= int(TokenAttr.RSTRIP)
    for name in ("<unk>", "<s>", "<|endoftext|>"):
        if name in index:
            attrs[index[name]] &= ~int(TokenAttr.RSTRIP)
