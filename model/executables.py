"""Compiled programs kept on disk as executables, so a restart skips tracing and lowering them.

JAX's persistent compile cache (`jax_compilation_cache_dir`) skips XLA's compile, but each program is
still traced and lowered first, to find its cache key: for SmolLM2's 16 essential programs on 2 CPUs
that is about 2.3 s of a 3 s warm-up, one program at a time under the GIL, where loading the same
executables serialized (`jax.experimental.serialize_executable`) takes about 0.5 s (bench/startup.py).

An entry lives beside JAX's cache, in `<jax_compilation_cache_dir>/bankml-executables/<digest>.bin`;
the digest covers everything a program is built from: the program's key and table, the model config,
the arrays' shapes, dtypes and placements, the sampler variant, the JAX and jaxlib versions, the
backend and its devices, XLA_FLAGS, BANKML_TRITON_CALL, JAX's precision flags and the sources of model/ and kernels/. Any change gives another
digest, so a stale executable is never loaded; an entry that fails to load is ignored (and lowered
again). The directory is trusted as JAX's own cache is: its entries are executables (and pickles).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
from pathlib import Path

import jax
import jaxlib
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

SUBDIR = "bankml-executables"
_PACKAGES = ("model", "kernels")


@functools.cache
def _sources_digest() -> str:
    """sha256 over the .py files of model/ and kernels/ (what a program is traced from), by path."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(path.relative_to(root).as_posix().encode() + b"\0")
            h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def _directory() -> Path | None:
    cache = jax.config.jax_compilation_cache_dir
    return Path(cache) / SUBDIR if cache else None


def digest(*parts: object) -> str:
    """The entry's name for a program built from `parts` (their reprs) in this process's environment."""
    devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
    env = (jax.__version__, jaxlib.__version__, jax.default_backend(), devices,
           getattr(jax.devices()[0].client, "platform_version", ""), os.environ.get("XLA_FLAGS", ""),
           os.environ.get("BANKML_TRITON_CALL", ""), jax.config.jax_enable_x64,
           jax.config.jax_default_matmul_precision, _sources_digest())
    return hashlib.sha256(repr((env, parts)).encode()).hexdigest()


def load(name: str):
    """The executable stored as `name`, or None (no cache directory, no entry, or one that fails)."""
    directory = _directory()
    if directory is None:
        return None
    path = directory / f"{name}.bin"
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    try:
        serialized, in_tree, out_tree = pickle.loads(blob)
        return serialize_executable.deserialize_and_load(serialized, in_tree, out_tree)
    except Exception as e:  # a truncated or foreign entry: lowered again, and overwritten
        log.warning("ignored the stored executable %s: %s", path, e)
        return None


def store(name: str, compiled) -> None:
    """Keep `compiled` as `name` (written whole, then renamed: a reader never sees half an entry)."""
    directory = _directory()
    if directory is None:
        return
    try:
        blob = pickle.dumps(serialize_executable.serialize(compiled))
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f"{name}.{os.getpid()}.tmp"
        tmp.write_bytes(blob)
        os.replace(tmp, directory / f"{name}.bin")
    except Exception as e:  # a read-only cache or an executable that cannot be serialized: lowered next time
        log.warning("could not store an executable in %s: %s", directory, e)
