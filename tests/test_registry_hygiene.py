"""Model management that must not leak: an evicted model gives back what it held (its tokenizer and
llguidance's vocabulary of it, its engine, its thread); derived models' manifests are parsed once per file
and bounded in size; a derived model that no request could use is refused when created; and a server's
/api/create answers one refusal for any FROM that is not a model it serves, whatever exists on its disk."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import shutil
import threading
import weakref
from pathlib import Path

import httpx
import pytest
from gateway_helpers import FakeServer, registry_dir, tiny_model

from bankml.errors import InvalidRequest
from bankml.pin import fork_record
from bankml.verify import gate_model
from gateway.serving import derived
from gateway.serving.derived import MAX_MANIFEST_BYTES, create
from gateway.serving.registry import Registry
from gateway.serving.request_fields import MAX_STOP_BYTES, MAX_STOPS
from gateway.serving.residency import Residency
from model.messages import GenerateRequest, SamplingParams

BASE = "Base-Model.Q8_0.gguf"


@pytest.fixture(scope="module")
def startup_gated(tmp_path_factory):
    model, fork = tiny_model(tmp_path_factory.mktemp("start"), "Startup-Model.Q8_0.gguf")
    return gate_model(str(model), fork.read_text())


@pytest.fixture
def reg_dir(tmp_path) -> Path:
    d = tmp_path / "reg"
    tiny_model(d, BASE)
    return d


@pytest.fixture
def registry(reg_dir, startup_gated) -> Registry:
    return Registry(startup_gated, str(reg_dir))


def run(registry, name, spec, **kw) -> list[str]:
    return list(create(registry, name, spec, **kw))


def _join(prefix: str) -> None:
    for t in threading.enumerate():
        if t.name.startswith(prefix):
            t.join(120)


# --- 1. an evicted model gives back what it held --------------------------------------------------------


def test_llguidances_vocabulary_does_not_keep_its_tokenizer_alive(tmp_path):
    """model/constraint.py caches llguidance's tokenizer per tokenizer, weakly keyed; its callback held the
    tokenizer strongly, so the entry kept its own key (and ~50 MB per SmolLM2 load) alive forever."""
    import model.constraint as mc
    from model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(str(tiny_model(tmp_path)[0]))
    built = mc.lltokenizer(tokenizer)
    assert built.tokenize_str("hello")  # the callback reaches the tokenizer while it lives
    freed = weakref.ref(tokenizer)
    del tokenizer, built
    gc.collect()
    assert freed() is None


def test_an_evicted_real_engine_gives_back_its_tokenizer_engine_and_thread(tmp_path):
    """Over the real engine and a tiny GGUF: loading a second pin with max_loaded 1 evicts the first; its
    engine, its tokenizer (and llguidance's vocabulary built for it at load) are freed and its engine thread
    has ended."""
    from bankml.config import EngineConfig
    from gateway.app import native_estimate, native_loader

    engine_cfg = EngineConfig(max_seqs=1, compile_cache_dir="")
    model, fork = tiny_model(tmp_path / "startup")
    reg = registry_dir(tmp_path / "reg", ["Model-A.Q8_0.gguf", "Model-B.Q8_0.gguf"])
    gated = gate_model(str(model), fork.read_text())
    registry = Registry(gated, str(reg))
    res = Residency(registry, gated, native_loader(128, engine_cfg, whole_contexts=True), max_loaded=1, ctx=128,
                    estimate=native_estimate(128, engine_cfg), max_seqs=1)
    res.load_startup()
    try:
        async def churn():
            async with res.lease(registry.pin("model-a.q8_0")) as held:
                thread = held.loaded.client.thread
                engine = thread.engine
                refs = [weakref.ref(engine), weakref.ref(engine.tokenizer), weakref.ref(engine.compiled)]
                request = GenerateRequest(list(b"hi"), SamplingParams(temperature=0.0, max_tokens=2), "a")
                async with held.loaded.client.generate(request) as generation:
                    outs = [out async for out in generation]
                del engine
            _join("lltokenizer")  # the load's llguidance build, which holds the tokenizer while it runs
            async with res.lease(registry.pin("model-b.q8_0")):  # evicts model-a
                pass
            await asyncio.gather(*list(res._tasks))
            return refs, thread, outs

        refs, thread, outs = asyncio.run(churn())
        _join("bankml-compile")  # a background compile holds the program cache until its program is done
        _join("lltokenizer")
        gc.collect()
        assert outs[-1].finish_reason is not None
        assert [r.name for r in res.resident()] == ["model-b.q8_0"]
        assert not thread.alive and thread.engine is None
        assert [r() for r in refs] == [None, None, None]
    finally:
        res.stop_all()


# --- 2. manifests: parsed once per file, bounded ----------------------------------------------------------


def test_manifests_are_parsed_once_per_file_identity(registry, reg_dir, monkeypatch):
    run(registry, "one", "FROM base-model.q8_0\nSYSTEM one\n")
    run(registry, "two", "FROM base-model.q8_0\nSYSTEM two\n")
    reads: list[str] = []
    real = derived.read_manifest
    monkeypatch.setattr(derived, "read_manifest", lambda path: reads.append(os.path.basename(path)) or real(path))

    assert [d.name for d in registry.derived.all()] == ["one", "two"]  # first read of each since written
    assert sorted(reads) == ["one.MODEL.json", "two.MODEL.json"]
    for _ in range(5):  # the listings and an unknown name's 404 (it names every served model)
        assert [d.name for d in registry.derived.all()] == ["one", "two"]
        assert registry.derived.get("one").layer.system == "one"
        assert "one" in registry.not_found("nobody").message
    assert len(reads) == 2

    path = reg_dir / "one.MODEL.json"
    path.write_text(path.read_text().replace("one", "uno"))  # another size, another mtime: read again
    with pytest.raises(InvalidRequest, match="edited by hand"):
        registry.derived.get("one")
    with pytest.raises(InvalidRequest, match="edited by hand"):
        registry.derived.get("one")
    assert reads[2:] == ["one.MODEL.json"]


def test_an_oversize_manifest_is_skipped_unread_and_refused(registry, reg_dir, monkeypatch, caplog):
    run(registry, "small", "FROM base-model.q8_0\nSYSTEM hi\n")
    big = reg_dir / "big.MODEL.json"
    with open(big, "wb") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)
    real_open = open
    opened: list[str] = []

    def spy_open(file, *a, **k):
        opened.append(str(file))
        return real_open(file, *a, **k)

    monkeypatch.setattr("builtins.open", spy_open)
    with caplog.at_level(logging.WARNING, logger="bankml.gateway"):
        assert [d.name for d in registry.derived.all()] == ["small"]
    assert f"more than a derived model's manifest may hold ({MAX_MANIFEST_BYTES})" in caplog.text
    with pytest.raises(InvalidRequest, match="big.MODEL.json is 1048577 bytes"):
        registry.derived.get("big")  # the refusal kept for this file identity: not opened again
    assert opened.count(str(big)) == 1
    monkeypatch.setattr(derived.json, "loads", lambda *a, **k: pytest.fail("an oversize manifest was parsed"))
    with pytest.raises(InvalidRequest, match="big.MODEL.json is 1048577 bytes"):
        derived.read_manifest(str(big))


def test_create_refuses_a_manifest_past_the_bound_before_verifying(registry, reg_dir):
    steps = create(registry, "huge", {"from": "base-model.q8_0", "system": "x" * MAX_MANIFEST_BYTES})
    assert next(steps) == "parsing modelfile"
    with pytest.raises(InvalidRequest, match=rf"huge: its manifest would be \d+ bytes, more than .*"
                                             rf"\({MAX_MANIFEST_BYTES}\)"):
        next(steps)  # the base is not verified (hashed) first
    assert not (reg_dir / "huge.MODEL.json").exists()
    assert run(registry, "fits", {"from": "base-model.q8_0", "system": "x" * (MAX_MANIFEST_BYTES // 2)})[-1] == \
        "success"


# --- 3. a derived model must be one a request can use ------------------------------------------------------


def test_stops_past_the_request_limit_are_refused_at_create(registry, reg_dir):
    many = MAX_STOPS + 8
    why = f"'stop' is not supported by bankml serve --native: more than {MAX_STOPS} stop strings (got {many})"
    modelfile = "FROM base-model.q8_0\n" + "".join(f"PARAMETER stop s{i}\n" for i in range(many))
    for spec in (modelfile, {"from": "base-model.q8_0", "parameters": {"stop": [f"s{i}" for i in range(many)]}}):
        with pytest.raises(InvalidRequest) as e:
            run(registry, "chatty", spec)
        assert e.value.message.startswith(why) and "could never answer" in e.value.message
    long_stop = "y" * (MAX_STOP_BYTES + 1)
    with pytest.raises(InvalidRequest, match=f"a stop string of more than {MAX_STOP_BYTES} bytes"):
        run(registry, "chatty", {"from": "base-model.q8_0", "parameters": {"stop": long_stop}})
    # repeat_penalty: > 0 as parsed, but its inverse overflows f32, which every request refuses
    with pytest.raises(InvalidRequest, match="penalty_repeat must be finite and greater than 0"):
        run(registry, "chatty", "FROM base-model.q8_0\nPARAMETER repeat_penalty 1e-45\n")
    assert not (reg_dir / "chatty.MODEL.json").exists()
    run(registry, "parent", "FROM base-model.q8_0\n" + "".join(f"PARAMETER stop s{i}\n" for i in range(MAX_STOPS)))
    assert len(registry.derived.get("parent").layer.stop) == MAX_STOPS
    assert run(registry, "child", "FROM parent\nSYSTEM hi\n")[-1] == "success"  # inherits exactly 32


# --- 4. FROM names a served model, or gets the one refusal --------------------------------------------------


def test_from_anything_but_a_served_model_is_one_refusal(registry, reg_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(reg_dir)  # a relative path to the real pinned file resolves here: refused all the same
    cwd, home = os.getcwd(), os.path.expanduser("~root")
    values = ["/etc/passwd", "/nonexistent", "~root/.bashrc", "~/x.gguf", f"./{BASE}", BASE.lower() + "/..",
              f"../reg/{BASE}", str(reg_dir / BASE), str(reg_dir), "..\\x", "nobody", "a\0b"]
    messages = {}
    for value in values:
        for spec in (f"FROM {value}\n" if "\0" not in value else None, {"from": value}):
            if spec is None:
                continue
            with pytest.raises(InvalidRequest) as e:
                run(registry, "x", spec)
            messages[value] = e.value.message
    templates = {m.replace(v, "<FROM>") for v, m in messages.items()}
    assert templates == {"FROM <FROM>: model '<FROM>' not found: bankml serves pinned models only "
                         "(startup-model.q8_0, base-model.q8_0)"}
    for value, message in messages.items():
        if cwd not in value:
            assert cwd not in message
        assert home not in message or home in value
    assert not (reg_dir / "x.MODEL.json").exists()
    # a served model's names: its pin name, its file name (/v1/models' id)
    for ok in ("base-model.q8_0", BASE):
        assert run(registry, "ok", {"from": ok})[-1] == "success"


def test_api_create_answers_the_same_400_for_an_existing_and_a_missing_path(tmp_path):
    model, fork = tiny_model(tmp_path / "start", "Startup.Q8_0.gguf")
    reg = tmp_path / "reg"
    tiny_model(reg, BASE)
    server = FakeServer(model, fork, registry=reg)
    try:
        def refusal(value: str) -> tuple[int, str]:
            r = httpx.post(server.url("/api/create"), json={"model": "x", "from": value, "stream": False}, timeout=30)
            return r.status_code, json.loads(r.content)["error"].replace(value, "<FROM>")

        answers = {v: refusal(v) for v in ("/etc/passwd", "/nonexistent", "~root/x", str(reg / BASE), "nobody")}
        assert len(set(answers.values())) == 1, answers
        status, error = answers["nobody"]
        assert status == 400 and error.startswith("FROM <FROM>: model '<FROM>' not found")
        r = httpx.get(server.url("/v1/models"), timeout=30)  # off the loop, and the same models
        assert [m["id"] for m in r.json()["data"]] == ["Startup.Q8_0.gguf", BASE]
    finally:
        server.stop()


def test_the_cli_still_takes_a_pinned_path(registry, reg_dir, tmp_path):
    copy = tmp_path / "elsewhere" / BASE
    copy.parent.mkdir()
    shutil.copyfile(reg_dir / BASE, copy)
    (copy.parent / f"{BASE}.FORK.json").write_text(json.dumps(fork_record(copy)))
    assert run(registry, "local", f"FROM ../reg/{BASE}\n", base_dir=str(tmp_path / "elsewhere"))[-1] == "success"
    with pytest.raises(InvalidRequest, match="the registry's Base-Model.Q8_0.gguf is"):
        run(registry, "local", f"FROM ./{BASE}\n", base_dir=str(copy.parent))
