"""SentencePiece-style BPE (`tokenizer.ggml.model = "llama"`), as llama.cpp's llm_tokenizer_spm_session.

The fragment (spaces already escaped to U+2581) starts as one symbol per code point. Every adjacent
pair whose concatenation is a token is queued with that token's score; the highest score merges first,
the leftmost on ties, and each merge queues the pairs it creates. What is left are tokens, except single
characters the vocabulary lacks, which fall back to `<0xXX>` byte tokens. Unlike byte-level BPE there
are no words: merges run over the whole fragment.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

from model import tokenizer_bpe
from model.tokenizer_bpe import IdsCache, exact_chunks


class SpmError(ValueError):
    """A byte has no `<0xXX>` token and no single-byte token: llama.cpp throws here too."""


class SpmModel:
    def __init__(self, token_to_id: Mapping[str, int], scores: Sequence[float]):
        self.token_to_id = token_to_id
        self.scores = scores
        self._byte_ids: dict[int, int] = {}
        # fragments, mostly lines: a chat prompt repeats its earlier turns
        self._cache = IdsCache(max_entries=1 << 14, max_bytes=64 << 20, max_chars=1 << 12)
        self._junctions: frozenset[str] | None = None

    @property
    def junctions(self) -> frozenset[str]:
        """Every pair of adjacent characters inside a token: only there can two symbols merge."""
        if self._junctions is None:
            self._junctions = frozenset(t[i:i + 2] for t in self.token_to_id for i in range(len(t) - 1))
        return self._junctions

    def byte_to_token(self, byte: int) -> int:
        """llama_vocab::byte_to_token for SPM: `<0xXX>`, else the byte itself as a one-byte token."""
        tid = self._byte_ids.get(byte)
        if tid is None:
            tid = self.token_to_id.get(f"<0x{byte:02X}>")
            if tid is None:
                tid = self.token_to_id.get(bytes([byte]).decode("utf-8", "surrogateescape"))
            if tid is None:
                raise SpmError(f"the vocabulary has no token for byte 0x{byte:02X}")
            self._byte_ids[byte] = tid
        return tid

    def tokenize(self, text: str) -> list[int]:
        ids = self._cache.get(text)
        if ids is None:
            # merges run over the whole fragment; a long one is merged in pieces cut where no token
            # spans the cut, which gives the same tokens (model/tokenizer_bpe.py, exact_chunks)
            limit = tokenizer_bpe.MAX_MERGE_CHARS
            chunks = exact_chunks(text, self.junctions, limit) if len(text) > limit else [text]
            ids = tuple(t for chunk in chunks if chunk for t in self._merge(chunk))
            self._cache.put(text, ids)
        return list(ids)

    def _merge(self, text: str) -> list[int]:
        token_to_id, scores = self.token_to_id, self.scores
        texts: list[str] = list(text)
        n = len(texts)
        nxt = list(range(1, n)) + [-1]
        prv = list(range(-1, n - 1))
        heap: list[tuple[float, int, int, int]] = []

        def push(left: int, right: int) -> None:
            if left == -1 or right == -1:
                return
            merged = texts[left] + texts[right]
            tid = token_to_id.get(merged)
            if tid is not None:
                # llama.cpp's queue: highest score on top, then the lowest left index.
                heapq.heappush(heap, (-float(scores[tid]), left, right, len(merged)))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            a, b = texts[left], texts[right]
            if not a or not b or len(a) + len(b) != size:
                continue  # outdated: one side was merged since this pair was queued
            texts[left] = a + b
            texts[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            push(prv[left], left)
            push(left, nxt[left])

        out: list[int] = []
        i = 0
        while i != -1:
            sym = texts[i]
            tid = token_to_id.get(sym)
            if tid is not None:
                out.append(tid)
            else:
                # Only a single unmerged character can miss: every merge produced a token.
                out.extend(self.byte_to_token(b) for b in sym.encode("utf-8", "surrogateescape"))
            i = nxt[i]
        return out
