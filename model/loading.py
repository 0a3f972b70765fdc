"""Loading a verified model into an engine for the server: the KV pool a model gets when several share
the device (`whole_contexts_bytes`), and `load_engine`, which the engine thread (model/engine_thread.py)
runs; under `--coordinator`, process 0 publishes its load settings for the followers
(model/distributed.py). No jax import at module level: the gateway imports this module."""

from __future__ import annotations

from typing import Any

from bankml.config import PAGE_SIZE
from model.speculative import Speculation


def whole_contexts_bytes(path: str, *, n_ctx: int, max_seqs: int, page_size: int = PAGE_SIZE, cache_type: str = "f16",
                         tensor_parallel: int = 1) -> int:
    """The KV pool of `max_seqs` whole contexts for the model at `path` (K and V of every layer, in
    `cache_type`), from its header as the guard reads it: the pool each engine gets when several models
    share the device. Split over `tensor_parallel` devices, a KV head that is not split is stored once
    per device (model/parallel.py)."""
    import dataclasses

    from bankml.guard import guard_file
    from model.config import Config
    from model.kvcache import page_bytes

    config = Config.from_gguf(guard_file(path).metadata)
    n = tensor_parallel
    if n > 1 and config.n_head_kv % n:
        config = dataclasses.replace(config, n_head_kv=n)
    per_page = page_bytes(config, page_size, cache_type)
    return max_seqs * -(-n_ctx // page_size) * per_page


def load_engine(path: str, *, n_ctx: int, max_seqs: int, prefill_chunk: int, compile_cache_dir: str | None,
                kv_cache_bytes: int = 0, page_size: int = PAGE_SIZE, whole_contexts: bool = False,
                cache_type: str = "f16", speculation: Speculation | None = None,
                tensor_parallel: int = 1) -> tuple[Any, str]:
    """`Engine.load` on a verified file, unwarmed (the caller warms it and logs the time); call it on the
    engine thread. Returns the engine and a few words on the backend for the receipts' "engine".
    whole_contexts (with kv_cache_bytes 0): a pool of max_seqs whole contexts, not most of the device.
    speculation: its drafts and verify steps ([engine] spec_type...; model/speculative.py); None: none.
    tensor_parallel: the devices the model is split over (model/parallel.py)."""
    import jax

    from model.engine import Engine

    if whole_contexts and kv_cache_bytes == 0:
        kv_cache_bytes = whole_contexts_bytes(path, n_ctx=n_ctx, max_seqs=max_seqs, page_size=page_size,
                                              cache_type=cache_type, tensor_parallel=tensor_parallel)

    import dataclasses

    from model import distributed

    cluster = distributed.current()
    if cluster is not None and cluster.leader:  # the others load with exactly these (model/distributed.py)
        distributed.publish_load({"n_ctx": n_ctx, "max_seqs": max_seqs, "prefill_chunk": prefill_chunk,
                                  "compile_cache_dir": compile_cache_dir, "kv_cache_bytes": kv_cache_bytes,
                                  "page_size": page_size, "whole_contexts": whole_contexts,
                                  "cache_type": cache_type, "tensor_parallel": tensor_parallel,
                                  "speculation": None if speculation is None else dataclasses.asdict(speculation)})
    if isinstance(speculation, dict):  # a follower's, as process 0 published it
        speculation = Speculation(**speculation)
    engine = Engine.load(path, verified=True, n_ctx=n_ctx, max_seqs=max_seqs, warmup=False,
                         prefill_chunk=prefill_chunk, compile_cache_dir=compile_cache_dir,
                         kv_cache_bytes=kv_cache_bytes, page_size=page_size, cache_type=cache_type,
                         speculation=speculation, tensor_parallel=tensor_parallel)
    par = getattr(getattr(engine, "weights", None), "parallel", None)
    split = "" if par is None else f", split {par.n} ways" + (
        f" over {par.describe()['processes']} processes" if par.describe()["processes"] > 1 else "")
    return engine, f"JAX {jax.__version__} on {jax.default_backend()}{split}"
