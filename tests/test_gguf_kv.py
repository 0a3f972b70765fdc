"""The GGUF key/value reader (model/tokenizer_gguf.read_kv): asking for some keys gives exactly those of
the whole section, the arrays of strings it steps over unread included, and a truncated one is refused."""

from __future__ import annotations

import pytest
from tiny_gguf import write_tiny_gguf

from model.tokenizer_gguf import GGUFReadError, read_kv


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(repr(a[k]) == repr(b[k]) for k in a)


@pytest.mark.parametrize("prefixes", [("tokenizer.",), ("general.",), ("llama.",), ("nothing.",)])
def test_a_prefix_reads_the_same_values_as_the_whole_section(tmp_path, prefixes):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", n_layer=1)
    everything = read_kv(path, prefixes=())
    assert any(isinstance(v, list) and v and isinstance(v[0], str) for v in everything.values())
    assert _same(read_kv(path, prefixes), {k: v for k, v in everything.items() if k.startswith(prefixes)})


def test_a_truncated_vocabulary_is_refused_even_when_skipped(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", n_layer=1)
    data = path.read_bytes()
    tokens = data.index(b"tokenizer.ggml.tokens")
    path.write_bytes(data[: tokens + 200])  # cut inside the vocabulary
    with pytest.raises(GGUFReadError):
        read_kv(path, prefixes=("llama.pooling_type",))
