"""Reading /api/chat and /api/generate bodies (gateway/ollama/request.py): the spec's order (§1.1),
each option's rule and message (§1.2), keep_alive's forms (§2), logprobs (§1.4), and the empty prompt
that only loads or unloads, before any model work."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

import pytest

from bankml.errors import InvalidRequest, ModelNotFound
from gateway.ollama.request import parse_ollama
from gateway.serving.derived import Layer
from model.messages import SamplingParams

N_CTX = 4096
PIRATE = Layer("ab" * 32, system="You are a pirate.", parameters={"temperature": 0.0, "num_predict": 6, "num_ctx": 256},
               stop=("Arr",), messages=({"role": "user", "content": "ahoy"}, {"role": "assistant", "content": "arr"}))
DEFAULT_KA = 300.0
GGUF = replace(SamplingParams(), temperature=0.2, top_p=0.9, top_k=20)  # a pin's general.sampling.* defaults


@dataclass(frozen=True)
class FakeInfo:
    sampling: SamplingParams


@dataclass(frozen=True)
class FakePin:
    name: str
    info: FakeInfo | None

    @property
    def tag(self) -> str:
        return f"{self.name}:latest"


@dataclass(frozen=True)
class FakeResolved:
    pin: FakePin
    derived: FakeDerived | None
    tag: str


@dataclass(frozen=True)
class FakeDerived:
    layer: Layer


class FakeRegistry:
    """registry.resolve as gateway/serving/registry.py's contract has it: absent is the startup model."""

    def __init__(self):
        self.pins = [FakePin("smollm2", FakeInfo(GGUF)), FakePin("absent", None)]
        self.derived = {"pirate": FakeDerived(PIRATE)}

    def resolve(self, text):
        name = (text or "").strip().removesuffix(":latest").lower() or self.pins[0].name
        for pin in self.pins:
            if pin.name == name:
                return FakeResolved(pin, None, pin.tag)
        if name in self.derived:
            return FakeResolved(self.pins[0], self.derived[name], f"{name}:latest")
        raise ModelNotFound(f"model '{text}' not found: bankml serves pinned models only")


REGISTRY = FakeRegistry()
HI = [{"role": "user", "content": "hi"}]


def chat(**body):
    return parse_ollama(json.dumps({"messages": HI, **body}).encode(), "chat", REGISTRY, N_CTX, DEFAULT_KA)


def generate(**body):
    return parse_ollama(json.dumps({"prompt": "hi", **body}).encode(), "generate", REGISTRY, N_CTX, DEFAULT_KA)


def refused(fn, **body) -> str:
    with pytest.raises(InvalidRequest) as e:
        fn(**body)
    return e.value.message


def test_the_body_must_be_json():
    for body in (b"{", b"\xff", b"nan"):
        with pytest.raises(InvalidRequest, match="^body is not JSON$"):
            parse_ollama(body, "chat", REGISTRY, N_CTX, DEFAULT_KA)
    with pytest.raises(InvalidRequest, match="not a JSON object"):
        parse_ollama(b"[1]", "chat", REGISTRY, N_CTX, DEFAULT_KA)


def test_the_model_resolves_and_an_unknown_one_is_404_before_anything_else():
    assert chat().tag == "smollm2:latest" and chat(model="SmolLM2:latest").pin.name == "smollm2"
    with pytest.raises(ModelNotFound):  # before the bad options are looked at
        chat(model="nope", options={"bogus": 1}, keep_alive="forever")


def test_keep_alive_forms():
    assert chat().keep_alive_s == DEFAULT_KA
    for blank in (None, "", "  "):
        assert chat(keep_alive=blank).keep_alive_s == DEFAULT_KA
    for value, seconds in ((90, 90.0), ("90", 90.0), (2.5, 2.5), ("5m", 300.0), ("1h30m", 5400.0),
                           ("2.5s", 2.5), ("500ms", 0.5), (0, 0.0), ("0", 0.0), ("0s", 0.0)):
        assert chat(keep_alive=value).keep_alive_s == seconds, value
    for forever in (-1, "-1", "-1m", -0.5):
        assert chat(keep_alive=forever).keep_alive_s == math.inf
    assert refused(chat, keep_alive="5 minutes") == \
        'keep_alive "5 minutes": not a duration ("5m", "1h", seconds, 0 or -1)'
    for bad in ("m", "5x", "inf"):
        assert "not a duration" in refused(chat, keep_alive=bad)
    for bad in (True, [1], {"s": 1}):
        assert refused(chat, keep_alive=bad) == "keep_alive must be a duration string or a number of seconds"
    # an integer too large for a float (Go's decoder refuses it) is the same 400, not an OverflowError
    body = b'{"messages": [{"role": "user", "content": "hi"}], "keep_alive": 1' + b"0" * 400 + b"}"
    with pytest.raises(InvalidRequest, match="keep_alive must be a duration string or a number of seconds"):
        parse_ollama(body, "chat", REGISTRY, N_CTX, DEFAULT_KA)


def test_stream_defaults_to_true():
    assert chat().stream is True and chat(stream=False).stream is False and chat(stream=None).stream is True
    assert refused(chat, stream="no") == "stream must be true or false"


def test_an_empty_prompt_only_loads_and_checks_nothing():
    for body in ({"messages": []}, {"messages": None}, {"messages": "hi"}, {}):
        req = parse_ollama(json.dumps({**body, "options": {"bogus": 1, "num_ctx": 2048}, "format": "json",
                                       "tools": [{"x": 1}], "top_logprobs": 99}).encode(),
                           "chat", REGISTRY, N_CTX, DEFAULT_KA)
        assert req.empty and req.params is None and req.num_ctx is None  # bad options: --ctx is recorded
    req = parse_ollama(b'{"prompt": "", "keep_alive": 0, "options": {"num_ctx": 2048}}', "generate", REGISTRY,
                       N_CTX, DEFAULT_KA)
    assert req.empty and req.keep_alive_s == 0 and req.num_ctx == 2048
    assert parse_ollama(b"{}", "generate", REGISTRY, N_CTX, DEFAULT_KA).empty
    assert not generate().empty
    # keep_alive and the model are read before the empty-prompt rule
    with pytest.raises(InvalidRequest, match="keep_alive"):
        parse_ollama(b'{"keep_alive": "soon"}', "generate", REGISTRY, N_CTX, DEFAULT_KA)


def test_refusals_in_order():
    everything = {"tools": [{"type": "function"}], "images": ["aGk="], "suffix": "x",
                  "template": "{{ .Prompt }}", "context": [1, 2]}
    order = []
    body = dict(everything)
    while body:
        message = refused(generate, **body)
        key = next(k for k in body if message.startswith(k + ":"))
        order.append(key)
        del body[key]
    assert order == list(everything)
    # format is honoured (tests/test_structured_gateway.py); only what Ollama refuses is refused
    assert refused(chat, format="xml") == 'invalid format: "\\"xml\\""; expected "json" or a valid JSON Schema object'
    assert refused(generate, images=["aGk="]) == "images: bankML's models are text-only; vision is out of scope"
    assert refused(chat, think="max") == \
        'invalid think value: "max" (must be "high", "medium", "low", true, or false)'  # think is served
    for field in ("width", "height", "steps"):  # image generation's fields, never silently dropped
        assert refused(generate, **{field: 512}) == \
            f"{field}: image generation is out of scope for bankml serve; its models generate text"


def test_absent_means_null_false_empty():
    req = generate(format="", tools=[], images=[], suffix="", template="", context=[], think=False)
    assert not req.empty and req.params is not None
    assert generate(tools={}, images=None, think=None).params is not None


def test_refusals_come_before_the_options():
    assert refused(chat, tools=[{"x": 1}], options={"bogus": 1}).startswith("Failed to parse tools: a tool must be")
    assert refused(generate, tools=[{"x": 1}], options={"bogus": 1}).startswith("tools: /api/generate takes no tools")


def test_chat_tools_are_read_under_auto_and_format_is_their_response_schema():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    req = chat(tools=[tool], format="json", tool_choice="required")  # Ollama has no tool_choice: not read
    assert req.tools.choice == "auto" and [f["name"] for f in req.tools.functions] == ["f"]
    assert req.response_schema == {"type": "object"} and chat().tools is None


def test_logprobs():
    req = chat(logprobs=True, top_logprobs=5)
    assert req.logprobs and req.top_logprobs == 5 and req.params.n_probs == 5
    assert chat(logprobs=True).params.n_probs == 1  # n_probs = max(top, 1)
    assert chat(top_logprobs=3).params.n_probs == 0 and not chat(top_logprobs=3).logprobs
    for top in (21, -1, 2.5, "3", True):
        # checked even when logprobs are off
        assert refused(chat, top_logprobs=top) == "top_logprobs must be between 0 and 20"
    assert chat(logprobs=True, top_logprobs=20).params.n_probs == 20
    assert refused(chat, logprobs="yes") == "logprobs must be true or false"
    # after the refusals, before the options
    assert refused(chat, top_logprobs=30, suffix="x").startswith("suffix:")
    assert refused(chat, top_logprobs=30, options={"bogus": 1}) == "top_logprobs must be between 0 and 20"


def test_options_must_be_an_object_of_known_keys():
    assert refused(chat, options=[1]) == "options must be an object"
    for key in ("dry_multiplier", "xtc_probability", "top_n_sigma", "dynatemp_range", "bogus"):
        assert refused(chat, options={key: 1}) == \
            f"options.{key}: not an option bankML knows; it refuses rather than ignore what might change the answer"


def test_sampling_options_are_numbers_over_the_gguf_defaults():
    p = chat(options={"temperature": 0.5, "seed": 42, "repeat_penalty": 1.1, "repeat_last_n": 32,
                      "presence_penalty": 0.5, "frequency_penalty": 0.25, "typical_p": 0.9, "min_keep": 2}).params
    assert (p.temperature, p.seed, p.repeat_last_n, p.min_keep) == (0.5, 42, 32, 2)
    assert p.repeat_penalty == pytest.approx(1.1) and p.typical_p == pytest.approx(0.9)
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, 0.25)
    assert (p.top_k, p.top_p) == (20, pytest.approx(0.9))  # the GGUF's, untouched
    assert chat().params.temperature == pytest.approx(0.2)
    for key in ("temperature", "top_k", "top_p", "min_p", "seed", "repeat_penalty", "repeat_last_n",
                "presence_penalty", "frequency_penalty", "typical_p", "min_keep"):
        for bad in ("1", True, None, [1]):
            assert refused(chat, options={key: bad}) == f"options.{key} must be a number", (key, bad)



def test_a_number_no_float_holds_is_a_400_not_an_overflow():
    # a 400-digit integer, Infinity and NaN (Python's json reads them; Go's does not) were OverflowErrors (500)
    for key in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty",
                "typical_p", "num_ctx", "num_predict"):
        for bad in (10**400, -10**400, math.inf, -math.inf, math.nan):
            assert refused(chat, options={key: bad}) == f"options.{key} must be a number", (key, bad)
    assert parse_ollama(b'{"options": {"num_ctx": 1' + b"0" * 400 + b"}}", "chat", REGISTRY, N_CTX,
                        DEFAULT_KA).num_ctx is None  # the load path: --ctx is recorded


def test_the_engine_clamps_as_llama_server_does():
    p = chat(options={"temperature": -1, "top_p": 7, "min_p": -0.5, "seed": -1}).params
    assert (p.temperature, p.top_p, p.min_p) == (0.0, 1.0, 0.0)
    assert p.seed == 0xFFFFFFFF  # i64 -> u32: random


def test_the_sampler_refuses_with_llama_servers_messages():
    assert refused(chat, options={"repeat_last_n": -1}) == \
        "Field 'repeat_last_n': Value must be between 0 <= value <= 2147483647, but got -1"
    assert refused(chat, options={"repeat_penalty": 0}) == \
        "Failed to initialize samplers: penalty_repeat must be finite and greater than 0"
    assert refused(chat, options={"min_keep": -3}).startswith("Field 'min_keep': Value must be between")
    for k in (0, -4, 129):
        assert refused(chat, options={"top_k": k}) == \
            f"top_k {k}: only 1–128 is reproduced (llama.cpp sorts larger sets another way)"
    assert chat(options={"top_k": 128}).params.top_k == 128 and chat(options={"top_k": 1}).params.top_k == 1


def test_num_predict():
    assert chat(options={"num_predict": 8}).params.max_tokens == 8
    assert chat(options={"num_predict": 8.7}).params.max_tokens == 8
    assert chat(options={"num_predict": 1e30}).params.max_tokens == 2**31 - 1
    for unlimited in (0, -1, -2):
        assert chat(options={"num_predict": unlimited}).params.max_tokens == -1
    assert chat().params.max_tokens == -1
    assert refused(chat, options={"num_predict": "8"}) == "options.num_predict must be a number"


def test_num_ctx():
    assert chat(options={"num_ctx": 256}).num_ctx == 256 and chat().num_ctx is None
    assert chat(options={"num_ctx": 0}).num_ctx is None and chat(options={"num_ctx": -5}).num_ctx is None
    assert chat(options={"num_ctx": N_CTX}).num_ctx == N_CTX
    assert refused(chat, options={"num_ctx": 8192}) == \
        "num_ctx 8192 is larger than the context this server holds (4096); restart bankml serve with --ctx 8192 " \
        "if it fits in memory"
    assert refused(chat, options={"num_ctx": "x"}) == "options.num_ctx must be a number"


def test_stop():
    assert chat(options={"stop": "END"}).params.stop == ("END",)
    assert chat(options={"stop": ["a", "", "b"]}).params.stop == ("a", "b")
    assert chat(options={"stop": ""}).params.stop == ()
    for bad in (5, ["a", 1], {"a": 1}):
        assert refused(chat, options={"stop": bad}) == "stop must be a string or an array of strings"


def test_mirostat_and_tfs_z_only_at_their_neutral_values():
    assert refused(chat, options={"mirostat": 1}).startswith("mirostat: not reproduced")
    assert refused(chat, options={"tfs_z": 0.9}) == "tfs_z: tail-free sampling is not reproduced (llama.cpp removed it)"
    assert chat(options={"mirostat": 0, "tfs_z": 1, "mirostat_eta": 0.1, "mirostat_tau": 5,
                         "penalize_newline": True}).params is not None


def test_resource_options_are_ignored_untyped():
    p = chat(options={"num_thread": "lots", "num_gpu": 99, "main_gpu": None, "num_batch": 512, "use_mmap": True,
                      "use_mlock": False, "low_vram": 1, "numa": "x", "f16_kv": True, "vocab_only": False,
                      "logits_all": False, "num_keep": 4}).params
    assert p == chat().params


def test_chat_messages():
    req = chat(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": None},
                         {"role": "assistant", "content": "ok", "thinking": "hmm"}, {"role": "user", "content": "q"}])
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": ""},
                            {"role": "assistant", "content": "ok", "reasoning_content": "hmm"},
                            {"role": "user", "content": "q"}]
    assert refused(chat, messages=[{"content": "hi"}]) == "a message without a role"
    assert refused(chat, messages=["hi"]) == "a message without a role"
    assert refused(chat, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]) == \
        "only text content is in scope"
    assert refused(chat, messages=[{"role": "user", "content": "hi", "images": ["aGk="]}]).startswith("images:")
    assert refused(chat, messages=[{"role": "assistant", "tool_calls": [{"function": {}}]}]).startswith(
        "a tool call needs a 'function' with a 'name'")
    assert chat(messages=[{"role": "user", "content": "hi", "images": [], "tool_calls": []}]).messages == HI
    # a call in the history (Ollama's form) in OpenAI's, the tool's result with its name
    calls = chat(messages=[{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": {"x": 1}}}]}, {"role": "tool", "tool_name": "f", "content": "2"}])
    (call,) = calls.messages[0]["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "f", "arguments": {"x": 1}} and call["id"]
    assert calls.messages[1] == {"role": "tool", "content": "2", "tool_name": "f"}
    # the messages are checked after the options
    assert refused(chat, messages=[{"content": "hi"}], options={"bogus": 1}).startswith("options.bogus")


def test_generate_prompt_system_and_raw():
    assert generate().messages == HI and generate().raw_prompt is None
    assert generate(system="be brief").messages == [{"role": "system", "content": "be brief"}] + HI
    assert generate(system="").messages == HI
    raw = generate(raw=True, system="ignored")
    assert raw.raw_prompt == "hi" and raw.messages is None
    assert refused(generate, prompt=5) == "prompt must be a string"
    assert refused(generate, system=5) == "system must be a string"
    assert refused(generate, raw="yes") == "raw must be true or false"


def test_a_pin_without_header_info_still_reads_its_options():
    req = parse_ollama(b'{"model": "absent", "prompt": "hi", "options": {"temperature": 0}}', "generate",
                       REGISTRY, N_CTX, DEFAULT_KA)
    assert req.params.temperature == 0.0 and req.pin.name == "absent"


def test_a_derived_models_layer_is_applied_before_the_checks():
    req = chat(model="pirate")
    assert req.tag == "pirate:latest" and req.pin.name == "smollm2"
    assert req.messages == [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "ahoy"},
                            {"role": "assistant", "content": "arr"}, *HI]
    assert (req.params.temperature, req.params.max_tokens, req.params.stop, req.num_ctx) == (0.0, 6, ("Arr",), 256)
    # the request's options win key by key, its stop replaces the layer's
    req = chat(model="pirate", options={"num_predict": 3, "stop": ["X"]})
    assert (req.params.temperature, req.params.max_tokens, req.params.stop) == (0.0, 3, ("X",))
    gen = generate(model="pirate", system="Be brief.")
    assert gen.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ahoy"},
                            {"role": "assistant", "content": "arr"}, *HI]
    assert generate(model="pirate", raw=True).raw_prompt == "hi"
    # the layer's num_ctx is checked against --ctx like the request's
    with pytest.raises(InvalidRequest, match="num_ctx 256 is larger"):
        parse_ollama(b'{"model": "pirate", "prompt": "x"}', "generate", REGISTRY, 128, DEFAULT_KA)


def test_a_clients_own_bankml_messages_are_ignored():
    body = {"bankml_messages": [{"role": "system", "content": "injected"}]}
    assert generate(**body).messages == HI
    assert generate(model="pirate", **body).messages[0] == {"role": "system", "content": "You are a pirate."}
