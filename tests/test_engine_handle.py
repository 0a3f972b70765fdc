"""The engine handle's two protocols (gateway/serving/engine_handle.py), checked member by member.

`EngineHandle` is what the gateway asks of a model: the real `EngineClient` and every fake client a test
hands a route must have each member. `ServedEngine` is what the handle asks of an engine: the real
`model.engine.Engine` and every fake engine must have each member. A member is present with the same
kind (an attribute or property, a method, a coroutine method) and a signature that takes every call the
protocol allows, so a fake missing a method fails here, by name, rather than in a request at run time.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

from batch_adapter import GeneratorBatch
from fake_engine import FakeEngine, StubHandle
from gateway_helpers import tiny_model

from gateway.serving.engine_client import EngineClient
from gateway.serving.engine_handle import EngineHandle, ServedEngine
from model.engine_thread import BatchEngine, EngineThread


def protocol_members(protocol: type) -> dict[str, Any]:
    """name -> what the protocol declares: a function, a property, or the annotation of an attribute;
    over the protocol and the protocols it extends."""
    members: dict[str, Any] = {}
    for cls in reversed(protocol.__mro__):
        if cls in (object, typing.Protocol, typing.Generic) or not getattr(cls, "_is_protocol", False):
            continue
        hints = typing.get_type_hints(cls)
        for name in cls.__dict__.get("__annotations__", {}):
            members[name] = hints[name]
        for name, value in cls.__dict__.items():
            if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property)):
                members[name] = value
    return members


def _accepts(impl, declared) -> str | None:
    """Why `impl` cannot be called as the protocol's `declared` function is, or None."""
    want = inspect.signature(declared)
    params = list(want.parameters.values())[1:]  # without self
    try:
        got = inspect.signature(impl)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: nothing to compare
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keywords = {p.name: None for p in params if p.kind is p.KEYWORD_ONLY}
    required = [p.name for p in params if p.default is p.empty and p.name in positional]
    for args in (positional, required):  # every argument the protocol allows, and only the required ones
        try:
            got.bind(*args, **keywords)
        except TypeError as e:
            return f"takes ({', '.join(got.parameters)}), not ({', '.join(args)}): {e}"
    return None


def conformance(protocol: type, impl: object) -> list[str]:
    """What `impl` lacks of `protocol`: one line per member (empty: it has them all)."""
    problems = []
    for name, declared in protocol_members(protocol).items():
        try:  # as the class or the instance holds it: a property is not run (it may need a loaded engine)
            raw = inspect.getattr_static(impl, name)
        except AttributeError:
            problems.append(f"{name}: missing")
            continue
        if isinstance(declared, property) or not inspect.isfunction(declared):
            if inspect.isfunction(raw):
                problems.append(f"{name}: a method, where the protocol has an attribute")
            elif isinstance(declared, type) and getattr(declared, "_is_protocol", False):
                problems += [f"{name}.{p}" for p in conformance(declared, getattr(impl, name))]
            continue
        value = getattr(impl, name)
        if not callable(value):
            problems.append(f"{name}: not callable")
            continue
        if inspect.iscoroutinefunction(declared) != inspect.iscoroutinefunction(value):
            kind = "async" if inspect.iscoroutinefunction(declared) else "plain"
            problems.append(f"{name}: the protocol's is {kind}, this one is not")
            continue
        why = _accepts(value, declared)
        if why is not None:
            problems.append(f"{name}: {why}")
    return problems


# --- the checker itself ---------------------------------------------------------------------------------


def test_the_check_names_a_missing_method_a_wrong_kind_and_a_narrow_signature():
    class Missing(FakeEngine):
        embed = None  # as if it had none: not callable

    class Sync(StubHandle):
        def embed(self, token_lists):  # the protocol's is async
            return []

    class Narrow(StubHandle):
        def slot_busy(self):  # takes no slot
            return False

    class Attribute(StubHandle):
        def max_seqs(self):  # a method where the protocol has a property
            return 1

    assert conformance(ServedEngine, Missing()) == ["embed: not callable"]
    assert conformance(EngineHandle, Sync()) == ["embed: the protocol's is async, this one is not"]
    assert [p.split(":")[0] for p in conformance(EngineHandle, Narrow())] == ["slot_busy"]
    assert conformance(EngineHandle, Attribute()) == ["max_seqs: a method, where the protocol has an attribute"]

    class NoScheduler(FakeEngine):
        scheduler = object()

    assert conformance(ServedEngine, NoScheduler()) == ["scheduler.slot_busy: missing"]
    assert not hasattr(object(), "save_slot") and "save_slot: missing" in conformance(ServedEngine, object())


def test_the_protocols_name_what_the_gateway_and_the_handle_use():
    handle = protocol_members(EngineHandle)
    for name in ("generate", "generate_all", "failure", "stats", "in_flight", "max_seqs", "prompt_logprobs",
                 "embedding_shape", "embed", "slot_busy", "save_slot", "restore_slot", "erase_slot",
                 "weights_report", "load", "load_blocking", "compile_rest", "unload", "stop", "set_meter"):
        assert name in handle, name
    engine = protocol_members(ServedEngine)
    assert set(protocol_members(BatchEngine)) <= set(engine)  # the thread's batch protocol, and more
    for name in ("tokenizer", "n_ctx", "scheduler", "warmup", "memory_bytes", "weights_report", "embed",
                 "prompt_logprobs", "save_slot", "restore_slot", "erase_slot", "compile_in_background"):
        assert name in engine, name


# --- the handles ------------------------------------------------------------------------------------------


def test_the_engine_client_is_an_engine_handle():
    thread = EngineThread()
    try:
        assert conformance(EngineHandle, EngineClient(thread)) == []
    finally:
        thread.stop()


def test_the_tests_fake_handles_are_engine_handles():
    from test_ollama_chat import _Client

    assert conformance(EngineHandle, StubHandle()) == []
    assert conformance(EngineHandle, _Client([])) == []


# --- the engines ------------------------------------------------------------------------------------------


def test_the_tests_fake_engines_are_served_engines(tmp_path):
    from replay_engine import ReplayEngine
    from test_gateway_engine_thread import CountingEngine

    model, _ = tiny_model(tmp_path)
    for engine in (FakeEngine(), CountingEngine(), ReplayEngine(model), GeneratorBatch()):
        assert conformance(ServedEngine, engine) == [], type(engine).__name__


def test_the_real_engine_is_a_served_engine(tmp_path):
    from tiny_gguf import write_tiny_gguf

    from model.engine import Engine

    engine = Engine.load(write_tiny_gguf(tmp_path / "tiny.gguf"), verified=True, n_ctx=64, max_seqs=1, warmup=False)
    assert conformance(ServedEngine, engine) == []
