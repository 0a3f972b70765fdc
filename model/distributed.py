"""One model across processes (and machines): `jax.distributed`, with process 0 leading.

Every process runs `join` before JAX starts its backends: it joins the cluster through JAX's coordinator
(`jax.distributed.initialize`; on a CPU, JAX's gloo collectives), then each tells the others, through the
coordinator's key-value store, the sha256 its own gate verified (or why its gate refused). A process whose
file differs, or was refused, is named on every process, and every process refuses to start: none waits
for a peer that will never join. Then all devices of all processes form one mesh, and the model is split
over it (model/parallel.py), each process holding its own devices' shares.

Process 0 runs the gateway and the scheduler as one process does; the others run the engine only, in
lockstep (`follow`): every program the step runner dispatches (model/runner.py: a prompt into the token
history, a prefill chunk, a decode or verify step, a sampling step, a reset) is published first, as its
name and its host arrays (`Lockstep.publish`: a JSON head and an .npz body, no pickle), in order, under
a sequence number, and each other process runs the same program on the same arrays. Multi-controller
JAX asks exactly that: the same programs, in the same order, on the same global shapes. The engine's
settings that shape its programs (context, sequences, pages, cache type, speculation, the split) are
process 0's, published once before the load (`publish_load` / `receive_load`), so a follower cannot
disagree with them.

What does not span processes yet is refused with the reason (model/engine.py): embeddings, prompt
scoring and slot files, which run programs outside the step runner.

Ending: process 0 publishes "stop" when its engine stops. A process that dies is seen by the others
through the coordinator's heartbeats (`HEARTBEAT_S`); JAX then ends them, so nothing waits forever.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

HEARTBEAT_S = 10  # a process silent this long is dead to the others (JAX's default: 100 s)
JOIN_TIMEOUT_S = 300  # every process must join within this (JAX's initialization_timeout)
COMPILE_TIMEOUT_S = 1800  # how long the others wait for the slowest process to compile a program
KEEP_OPS = 4096  # published steps kept in the store for a slow follower; older ones are deleted
POLL_MS = 1000


class DistributedRefused(RuntimeError):
    """The cluster cannot serve this model: a process's file differs or its gate refused (named)."""


@dataclass(frozen=True)
class Cluster:
    """This process's place in the cluster."""

    process_id: int
    num_processes: int
    coordinator: str

    @property
    def leader(self) -> bool:
        return self.process_id == 0


_cluster: Cluster | None = None
_abandoned: str | None = None  # why process 0 stopped its server after a failed step


def current() -> Cluster | None:
    """The cluster this process joined, or None (one process)."""
    return _cluster


def _client():
    from jax._src import distributed  # the coordinator's key-value store: JAX's own, no other transport

    return distributed.global_state.client


def join(coordinator: str, num_processes: int, process_id: int, *, sha256: str | None,
         refused: str | None = None) -> Cluster:
    """Join the cluster and agree on the model (module docstring). `sha256`: what this process's gate
    verified; `refused`: why its gate refused (then every process refuses, naming it). Raises
    DistributedRefused on every process when the processes disagree."""
    global _cluster
    import jax

    if not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id {process_id} is not in 0..{num_processes - 1}")
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu") or not _has_accelerator():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    else:  # XLA:GPU would share each program's autotuning among the processes compiling it at the same time;
        # ours compile on their own schedules (a follower compiles what it replays), so each tunes alone
        os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                                         "--xla_gpu_shard_autotuning=false"]))
    jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=JOIN_TIMEOUT_S,
                               heartbeat_timeout_seconds=HEARTBEAT_S, shutdown_timeout_seconds=HEARTBEAT_S)
    client = _client()
    client.key_value_set(f"bankml/pin/{process_id}", json.dumps({"sha256": sha256, "refused": refused}))
    pins = {}
    for pid in range(num_processes):
        pins[pid] = json.loads(client.blocking_key_value_get(f"bankml/pin/{pid}", JOIN_TIMEOUT_S * 1000))
    problems = [f"process {pid}'s gate refused its file: {p['refused']}" for pid, p in pins.items() if p["refused"]]
    lead = pins[0]["sha256"]
    problems += [f"process {pid}'s file has sha256 {p['sha256']}, process 0's {lead}"
                 for pid, p in pins.items() if pid and not p["refused"] and p["sha256"] != lead]
    if problems:
        raise DistributedRefused("; ".join(problems))
    _cluster = Cluster(process_id, num_processes, coordinator)
    # every process starts its backend now, together: each waits for the others' device topology
    log.info("process %d of %d joined %s (%d devices in all, %d here); every process verified sha256 %s",
             process_id, num_processes, coordinator, jax.device_count(), jax.local_device_count(), lead)
    return _cluster


def _has_accelerator() -> bool:
    """Whether a GPU platform is installed (before JAX starts: its plugins, not its backends)."""
    import importlib.util

    return any(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin",
                                                                  "jax_rocm7_plugin"))


def smallest(name: str, value: int) -> int:
    """The smallest of every process's `value` (each posts its own, then reads all): what every process
    must agree on though each measures its own, as the KV pool's pages from its device's free memory."""
    client = _client()
    client.key_value_set(f"bankml/{name}/{_cluster.process_id}", str(int(value)))
    return min(int(client.blocking_key_value_get(f"bankml/{name}/{pid}", JOIN_TIMEOUT_S * 1000))
               for pid in range(_cluster.num_processes))


def publish_load(settings: dict) -> None:
    """Process 0: the engine's settings, before it loads (the others load with these)."""
    _client().key_value_set("bankml/load", json.dumps(settings))


def receive_load() -> dict:
    """A follower: process 0's engine settings (waits until it publishes them)."""
    return json.loads(_client().blocking_key_value_get("bankml/load", JOIN_TIMEOUT_S * 1000))


class Lockstep:
    """The step runner's programs, in order: process 0 publishes each, the others receive them."""

    def __init__(self):
        self._client = _client()
        self._n = 0
        self._lock = threading.Lock()
        self._seen: set[tuple] = set()  # the programs every process has compiled

    def compiled(self, key: tuple) -> None:
        """Before a program's first run anywhere: wait until every process has compiled it. A program's
        collectives give a late process 30 s (gloo's, fixed in XLA), and a compile on a busy machine, or
        one a follower's warm-up still holds, takes longer. Every process sees the same programs in the
        same order, so each reaches the same barriers; the ones after are free."""
        if key in self._seen:
            return
        self._client.wait_at_barrier(f"bankml/compiled/{len(self._seen)}", COMPILE_TIMEOUT_S * 1000)
        self._seen.add(key)

    def publish(self, op: str, args: tuple) -> None:
        with self._lock:
            self._client.key_value_set_bytes(f"bankml/op/{self._n}", encode(op, args))
            if self._n >= KEEP_OPS:
                self._client.key_value_delete(f"bankml/op/{self._n - KEEP_OPS}")
            self._n += 1

    def receive(self, stop: threading.Event | None = None) -> tuple[str, tuple]:
        """The next op (blocks; polls `stop` every POLL_MS)."""
        key = f"bankml/op/{self._n}"
        while True:
            try:
                data = self._client.blocking_key_value_get_bytes(key, POLL_MS)
                break
            except Exception as e:  # a timeout: nothing yet
                if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
                    raise
                if stop is not None and stop.is_set():
                    return "stop", ()
        self._n += 1
        return decode(data)


# --- the wire format: a JSON head naming each argument's kind, the arrays in an .npz --------------------


def encode(op: str, args: tuple) -> bytes:
    """An op and its arguments (None, bool, int, float, str, numpy arrays, and dataclasses of arrays such
    as model/sampler_chain.py's ChainArrays) as bytes: no pickle, so a follower runs no code it is sent."""
    kinds, arrays = [], {}
    for i, a in enumerate(args):
        if a is None or isinstance(a, (bool, int, float, str)):
            kinds.append({"value": a})
        elif isinstance(a, np.ndarray | np.generic):
            arrays[f"a{i}"] = np.asarray(a)
            kinds.append({"array": f"a{i}"})
        elif hasattr(a, "__dataclass_fields__"):
            names = [f.name for f in fields(a)]
            for name in names:
                arrays[f"a{i}.{name}"] = np.asarray(getattr(a, name))
            kinds.append({"dataclass": type(a).__name__, "fields": names})
        else:
            raise TypeError(f"lockstep: {op}'s argument {i} is a {type(a).__name__}: not sent to the other processes")
    body = io.BytesIO()
    np.savez(body, **arrays)
    head = json.dumps({"op": op, "args": kinds}).encode()
    return len(head).to_bytes(4, "little") + head + body.getvalue()


def decode(data: bytes) -> tuple[str, tuple]:
    from model.sampler_chain import ChainArrays  # the one dataclass the runner sends

    size = int.from_bytes(data[:4], "little")
    head = json.loads(data[4:4 + size])
    arrays = np.load(io.BytesIO(data[4 + size:]), allow_pickle=False)
    args = []
    for i, kind in enumerate(head["args"]):
        if "array" in kind:
            args.append(arrays[kind["array"]])
        elif "dataclass" in kind:
            if kind["dataclass"] != ChainArrays.__name__:
                raise ValueError(f"lockstep: unknown dataclass {kind['dataclass']!r}")
            args.append(ChainArrays(**{name: arrays[f"a{i}.{name}"] for name in kind["fields"]}))
        else:
            args.append(kind["value"])
    return head["op"], tuple(args)


def follow(path: str, load: Callable[..., tuple[Any, str]]) -> int:
    """A follower's life: load the model with process 0's settings (`load`: model/loading.py's
    load_engine), compile what process 0 compiles first, then run every op it publishes until it stops.
    Returns the exit code; a failure (process 0 gone, a step that failed) ends this process at once."""
    pid = _cluster.process_id
    logging.basicConfig(level=logging.INFO, format=f"bankml serve [{pid}]: %(message)s", stream=sys.stderr)
    try:
        engine, backend = load(path, **receive_load())
        log.info("process %d: loaded %s (%s); following process 0", pid, path, backend)
        engine.warmup(essential=True)  # compile-only, as process 0 does: its first steps need not wait for us
        compiling = engine.compile_in_background()
        lockstep = Lockstep()
        runner = engine.runner
        runner.barrier = lockstep.compiled
        while True:
            op, args = lockstep.receive()
            if op == "stop":
                log.info("process %d: process 0 stopped; stopping", pid)
                engine.compiled.stop_background()
                if compiling is not None:  # a compile cut off by the exit aborts the process
                    compiling.join()
                return 0
            runner.apply(op, args)
    except Exception as e:  # process 0 is gone or never published, or a step failed: out of step for good
        log.error("process %d: %s: %s; stopping", pid, type(e).__name__, str(e)[:500])
        sys.stderr.flush()
        os._exit(1)  # JAX's own exit would wait on the coordinator that is gone


def abandon(why: str) -> None:
    """Process 0, after a step failed across processes: stop the server (SIGTERM: it drains and closes
    as on Ctrl-C); the others stop when the coordinator goes."""
    import signal

    global _abandoned
    log.error("a step of the model split across %d processes failed (%s): stopping the server",
              _cluster.num_processes if _cluster else 0, why)
    _abandoned = why
    os.kill(os.getpid(), signal.SIGTERM)


def leave(code: int) -> int:
    """Process 0, once its server stopped: the exit code; after `abandon`, this process ends here (JAX's
    own exit would wait for the process that is gone, then abort)."""
    if _abandoned is None:
        return code
    log.error("stopped: %s", _abandoned)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(3)


def lead(runner) -> None:
    """Process 0: `runner`'s ops are published to the others from now on, and "stop" when this process
    exits."""
    import atexit

    lockstep = Lockstep()
    runner.lockstep = lockstep
    runner.barrier = lockstep.compiled
    atexit.register(lambda: lockstep.publish("stop", ()))
