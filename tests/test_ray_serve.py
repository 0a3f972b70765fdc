"""Replicas on Ray Serve (bankml/ray_app.py): a two-node Ray cluster on this machine (two `ray start`,
one CPU each), two replicas of a tiny model behind Ray's HTTP proxy. Through the proxy: chats with the
openai and ollama clients whose receipts verify against `GET /bankml/receipt-key`, the same key from
every replica, a shared system prompt landing on the same replica, a replica with a bad pin refused
with the reason, and replicas killed under load (the actor, then its child server) replaced with no
request left hanging. Skipped without Ray (`pip install 'bankml[ray]'`)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
psutil = pytest.importorskip("psutil")

from gateway_helpers import free_port, tiny_model  # noqa: E402

from bankml import signing  # noqa: E402
from bankml.config import LimitsConfig  # noqa: E402
from bankml.errors import ConfigInvalid  # noqa: E402
from bankml.ray_app import REPLICA_HEADER, AffinityRouter, AppArgs, _score  # noqa: E402
from bankml.ray_app import app as build_app  # noqa: E402
from bankml.replica import affinity_key  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(1800)]  # the first test also starts the cluster

APP = "bankml"
MODEL_NAME = "tiny-model.q8_0"
# Deadlines for a busy machine (CI, beside the suite's other workers, where a child's warm-up takes
# minutes): they only cost time when something is wrong.
SILENCE_S = 180  # the ingress's read_timeout_s: the longest a child may be silent in an answer
CLIENT_S = SILENCE_S + 60  # a client waits longer, so a silent stream ends with the ingress's error event
REPLACED_S = 600  # a killed replica's successor: a new actor, its child's gate, load and warm-up


# --- the arguments and the key, without a cluster ----------------------------------------------------


def test_scale_to_zero_and_unknown_arguments_are_refused():
    with pytest.raises(ConfigInvalid, match="scale to zero is refused"):
        AppArgs.parse({"model": "m.gguf", "fork": "m.json", "min_replicas": "0", "max_replicas": "2"})
    with pytest.raises(ConfigInvalid, match="unknown argument 'replica'"):
        AppArgs.parse({"model": "m.gguf", "fork": "m.json", "replica": "2"})
    with pytest.raises(ConfigInvalid, match="routing='hash'"):
        AppArgs.parse({"model": "m.gguf", "fork": "m.json", "routing": "hash"})
    a = AppArgs.parse({"model": "m.gguf", "fork": "m.json", "max_replicas": "3"})
    assert a.autoscaling_config() == {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4.0}


def test_the_affinity_key_is_the_system_prompt_and_first_message():
    chat = {"messages": [{"role": "system", "content": "S" * 10}, {"role": "user", "content": "first"},
                         {"role": "assistant", "content": "x"}, {"role": "user", "content": "later"}]}
    assert affinity_key(json.dumps(chat).encode(), 512) == "S" * 10 + "\nfirst"
    assert affinity_key(json.dumps(chat).encode(), 4) == "SSSS"
    anthropic = {"system": [{"type": "text", "text": "be brief"}], "messages": [{"role": "user", "content": "q"}]}
    assert affinity_key(json.dumps(anthropic).encode(), 512) == "be brief\nq"
    assert affinity_key(json.dumps({"prompt": "abc", "system": "sys"}).encode(), 512) == "sys\nabc"
    assert affinity_key(b"", 512) is None and affinity_key(b"[1]", 512) is None and affinity_key(b"{", 512) is None


# --- the cluster --------------------------------------------------------------------------------------


class _Id:
    def __init__(self, unique_id: str):
        self.unique_id = unique_id


class _Candidate:
    def __init__(self, unique_id: str):
        self.replica_id = _Id(unique_id)


class _Pending:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.routing_context = type("Context", (), {"should_backoff": False})()


def _route(router: AffinityRouter, candidates: list, **kwargs) -> list[list[str]]:
    import asyncio

    ranks = asyncio.run(router.choose_replicas(candidates, _Pending(**kwargs)))
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_affinity_fills_a_keys_replica_to_the_bound_then_its_next_replica():
    """Bounded loads: a key's requests go to its first replica in rendezvous order until that one has
    `affinity_bound` answers under way, then to its second, and so on; all at the bound: the first in
    the key's order within one answer of the least loaded. No cluster: the router's own choice."""
    router = AffinityRouter.__new__(AffinityRouter)  # Ray's constructor wants a running deployment
    router.initialize_state(affinity_bound=2)
    candidates = [_Candidate(f"replica-{i}") for i in range(3)]
    key = "You are a librarian."
    order = sorted((c.replica_id.unique_id for c in candidates), key=lambda rid: _score(key, rid), reverse=True)
    placed = []
    for _ in range(6):
        ranks = _route(router, candidates, affinity=key)
        assert len(ranks) == 2 and len(ranks[0]) == 1 and set(ranks[0] + ranks[1]) == set(order)
        placed.append(ranks[0][0])
        router.on_request_routed(None, _Id(ranks[0][0]), None)
    assert placed == [order[0]] * 2 + [order[1]] * 2 + [order[2]] * 2
    # all at the bound: the first in the key's order within one answer of the least loaded
    assert _route(router, candidates, affinity=key) == [[order[0]], order[1:]]
    router.on_request_routed(None, _Id(order[0]), None)
    assert _route(router, candidates, affinity=key) == [[order[0]], order[1:]]  # 3 against 2: still its own
    router.on_request_routed(None, _Id(order[0]), None)
    assert _route(router, candidates, affinity=key) == [[order[1]], [order[0], order[2]]]  # 4 against 2: not
    for n in range(3):
        router.on_request_completed(_Id(order[0]), f"r{n}")
    assert _route(router, candidates, affinity=key)[0] == [order[0]]  # room again on the key's own replica
    router.on_request_completed(_Id(order[1]), "r2")
    assert _route(router, candidates, affinity=key, avoid=(order[0],))[0] == [order[1]]  # a retry avoids one
    assert len(_route(router, candidates)[0]) == 2  # no key: two at random (power of two choices)


def _ray_processes(temp_dir: str) -> list[psutil.Process]:
    """The processes of the cluster this module started: every one names its session under temp_dir."""
    out: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        if any(temp_dir in part for part in p.info["cmdline"] or []):
            try:  # a raylet's workers and agents (renamed `ray::...`) and the bankml servers under them
                out.update({c.pid: c for c in [p, *p.children(recursive=True)]})
            except psutil.NoSuchProcess:
                pass
    return list(out.values())


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes on this machine, one CPU each; stopped at the end by the pids of its own processes,
    never `ray stop`, which would stop any other Ray on the machine. Ray's token authentication is off
    for this loopback cluster, explicitly: Ray 2.60 turns it on for a head that finds ~/.ray/auth_token,
    which a second `ray start` does not then send, and this process read its mode when it imported ray.
    Serve's controller gives its HTTP proxy 5 s to start and kills it past that (Ray's
    RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S), which fails `serve.start` on a busy machine (CI, beside the
    suite's other workers: "killed by `ray.kill`... never ran"): the nodes' processes get minutes."""
    temp_dir = tempfile.mkdtemp(prefix="rbk", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    ray_env = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}
    saved = {k: os.environ.get(k) for k in (*ray_env, "RAY_ADDRESS")}
    os.environ.update(ray_env)  # the driver (this process) and the `ray start` below
    os.environ.pop("RAY_ADDRESS", None)
    gcs = free_port()
    common = ["--num-cpus", "1", "--disable-usage-stats", "--temp-dir", temp_dir]
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]
    try:
        for args in (["--head", "--port", str(gcs), "--include-dashboard=false"], ["--address", f"127.0.0.1:{gcs}"]):
            r = subprocess.run([*ray_cli, "start", *args, *common], capture_output=True, text=True, timeout=REPLACED_S)
            assert r.returncode == 0, r.stderr[-3000:]
        ray.init(address=f"127.0.0.1:{gcs}", logging_level="WARNING", log_to_driver=False)
        deadline = time.monotonic() + REPLACED_S
        while len([n for n in ray.nodes() if n["Alive"]]) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        yield temp_dir
    finally:
        try:
            if ray.is_initialized():
                serve.shutdown()
                ray.shutdown()
        finally:
            _stop_processes(_ray_processes(temp_dir))
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _stop_processes(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.fixture(scope="module")
def served(cluster, tmp_path_factory):
    """Two replicas of a tiny model behind Ray's proxy (loopback, a port of its own); the base URL."""
    directory = tmp_path_factory.mktemp("ray")
    model, fork = tiny_model(directory)
    before = os.environ.get("BANKML_CONFIG_DIR")  # the session's (conftest.py): given back at the end
    os.environ["BANKML_CONFIG_DIR"] = str(directory / "config")  # the builder makes the key here
    port = free_port()
    http = {"host": "127.0.0.1", "port": port}
    try:
        serve.start(http_options=http, proxy_location="HeadOnly")
    except TimeoutError:  # the driver waits 60 s for the proxy (a constant); a busy machine takes longer
        serve.start(http_options=http, proxy_location="HeadOnly")  # the controller above, its proxy on the way
    serve.run(build_app({"model": str(model), "fork": str(fork), "replicas": "2", "startup_timeout_s": str(REPLACED_S),
                         "read_timeout_s": str(SILENCE_S)}), name=APP, route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    _wait_for_the_proxy(base, timeout_s=REPLACED_S)
    yield {"base": base, "directory": directory, "model": model, "fork": fork}
    serve.delete(APP)
    if before is None:
        os.environ.pop("BANKML_CONFIG_DIR", None)
    else:
        os.environ["BANKML_CONFIG_DIR"] = before


def _wait_for_the_proxy(base: str, timeout_s: float) -> None:
    """Until Ray's proxy answers its own health route (`/-/healthz`) with 200."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(base + "/-/healthz", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"Ray's proxy at {base} did not answer in {timeout_s:.0f} s"
        time.sleep(0.5)


def _post(base: str, path: str, body: dict, timeout_s: float = CLIENT_S) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=timeout_s)


def _public_key(base: str):
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    return load_pem_public_key(httpx.get(base + "/bankml/receipt-key", timeout=CLIENT_S).json()["public_key"].encode())


def _chat(system: str, user: str, max_tokens: int = 4, stream: bool = False) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": max_tokens, "stream": stream, "temperature": 0}


def _seen_replicas(base: str, tries: int = 60) -> dict[str, dict]:
    """GET /bankml/receipt-key until both replicas have answered: {replica id: its key info}."""
    seen: dict[str, dict] = {}
    for _ in range(tries):
        r = httpx.get(base + "/bankml/receipt-key", timeout=CLIENT_S)
        assert r.status_code == 200, r.text
        seen[r.headers[REPLICA_HEADER]] = r.json()
        if len(seen) == 2:
            break
    return seen


# --- through Ray's proxy ------------------------------------------------------------------------------


def test_two_replicas_run_one_on_each_node(served):
    assert len([n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU") == 1.0]) == 2
    status = serve.status().applications[APP]
    assert status.status == "RUNNING", status
    assert status.deployments["Replica"].replica_states.get("RUNNING") == 2
    assert len(_seen_replicas(served["base"])) == 2  # one CPU each: two replicas need both nodes


def test_every_replica_gives_the_same_receipt_key(served):
    seen = _seen_replicas(served["base"])
    assert len(seen) == 2 and len({json.dumps(info, sort_keys=True) for info in seen.values()}) == 1
    key_file = served["directory"] / "config" / signing.KEY_FILE
    assert next(iter(seen.values()))["key_id"] == signing.read_key(str(key_file), "key").key_id


def test_openai_client_chat_plain_and_streamed_with_receipts_that_verify(served):
    openai = pytest.importorskip("openai")
    base = served["base"]
    key = _public_key(base)
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=CLIENT_S, max_retries=0)
    answer = client.chat.completions.create(**_chat("You are terse.", "Hello"))
    assert answer.choices[0].message.content and answer.usage.completion_tokens == 4
    receipt = answer.model_extra["bankml_receipt"]
    assert signing.verify(receipt, key) == receipt["key_id"]
    assert receipt["response_sha256"] == hashlib.sha256(answer.choices[0].message.content.encode()).hexdigest()
    chunks = list(client.chat.completions.create(**_chat("You are terse.", "Hello again", 6, stream=True)))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    receipts = [c.model_extra["bankml_receipt"] for c in chunks if c.model_extra.get("bankml_receipt")]
    assert len(receipts) == 1 and signing.verify(receipts[0], key)
    assert receipts[0]["response_sha256"] == hashlib.sha256(text.encode()).hexdigest()


def test_a_stream_passes_through_incrementally(served):
    """The first event arrives well before the last: Ray's proxy and the ingress do not buffer."""
    at: list[float] = []
    start = time.monotonic()
    with httpx.stream("POST", served["base"] + "/v1/chat/completions", timeout=CLIENT_S,
                      json=_chat("Count.", "Go", 200, stream=True)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers[REPLICA_HEADER]
        for line in r.iter_lines():
            if line.startswith("data: "):
                at.append(time.monotonic() - start)
    assert len(at) > 100 and at[0] < at[-1] - 0.05, (at[0], at[-1])


def test_ollama_client_chat_and_its_receipt_on_the_wire(served):
    ollama = pytest.importorskip("ollama")
    base = served["base"]
    client = ollama.Client(host=base, timeout=CLIENT_S)
    greedy = {"num_predict": 4, "temperature": 0}
    answer = client.chat(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], options=greedy)
    assert answer.message.content and answer.eval_count == 4
    streamed = list(client.chat(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], stream=True,
                                options=greedy))
    assert streamed[-1].done and "".join(p.message.content for p in streamed) == answer.message.content
    # the client drops what Ollama does not have: the receipt is read on the wire
    r = _post(base, "/api/chat", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
                                  "stream": False, "options": {"num_predict": 4}})
    receipt = r.json()["bankml_receipt"]
    assert signing.verify(receipt, _public_key(base)) == receipt["key_id"]


def test_the_gateways_own_rules_still_answer(served):
    """The child judges every request: its 415, its 404, its Host rule, passed back as they are."""
    base = served["base"]
    r = httpx.post(base + "/v1/chat/completions", content=b"{}", timeout=CLIENT_S)
    assert r.status_code == 415 and r.headers[REPLICA_HEADER]
    assert httpx.get(base + "/no-such-route", timeout=CLIENT_S).status_code == 404
    r = httpx.get(base + "/health", headers={"host": "example.com"}, timeout=CLIENT_S)
    assert r.status_code == 403 and "loopback" in r.text


def test_an_oversized_body_is_refused_by_the_ingress_in_each_apis_shape(served):
    """The ingress reads a body only up to the gateway's bound; its 413 is in the route's dialect."""
    base, big = served["base"], b"x" * (LimitsConfig().max_body_bytes + 1)
    headers = {"content-type": "application/json"}
    r = httpx.post(base + "/api/chat", content=big, headers=headers, timeout=CLIENT_S)
    assert r.status_code == 413 and set(r.json()) == {"error"}  # Ollama's
    r = httpx.post(base + "/v1/messages", content=big, headers=headers, timeout=CLIENT_S)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"  # Anthropic's
    r = httpx.post(base + "/v1/chat/completions", content=big, headers=headers, timeout=CLIENT_S)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413  # OpenAI's


def test_a_shared_system_prompt_lands_on_the_same_replica(served):
    base = served["base"]
    ids = set(_seen_replicas(base))
    chosen: dict[str, str] = {}
    for i in range(8):
        system = f"You are assistant number {i}. Answer in one word."
        first = _post(base, "/v1/chat/completions", _chat(system, "Hello")).headers[REPLICA_HEADER]
        again = _post(base, "/v1/chat/completions", _chat(system, "Hello")).headers[REPLICA_HEADER]
        assert first == again, system
        key = affinity_key(json.dumps(_chat(system, "Hello")).encode(), 512)
        assert first == max(ids, key=lambda rid: _score(key, rid))  # the rendezvous hash's choice
        chosen[system] = first
    assert set(chosen.values()) <= ids
    # bursts, one after the other: below affinity_bound (4) at once, every request stays on the key's
    # replica (3, not 4: the router may hear of the last burst's ends a moment after the next begins)
    system = "One long system prompt for a burst of clients, longer than the key. " * 10
    key = affinity_key(json.dumps(_chat(system, "Hello")).encode(), 512)
    owner = max(ids, key=lambda rid: _score(key, rid))
    for _ in range(3):
        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda i: _post(base, "/v1/chat/completions", _chat(system, f"Hello {i}", 30)).headers[
                REPLICA_HEADER], range(3)))
        assert got == [owner] * 3, got


def test_a_replica_with_a_bad_pin_is_refused_with_the_reason(served, tmp_path):
    model, fork = tiny_model(tmp_path, "Bad-Pin.Q8_0.gguf")
    record = json.loads(fork.read_text())
    record["files"][0]["sha256"] = "0" * 64
    fork.write_text(json.dumps(record))
    with pytest.raises(Exception) as refused:  # serve.run raises once the deployment has failed
        serve.run(build_app({"model": str(model), "fork": str(fork), "replicas": "1", "num_cpus": "0"}),
                  name="badpin", route_prefix="/badpin")
    try:
        deployment = serve.status().applications["badpin"].deployments["Replica"]
        assert deployment.status == "DEPLOY_FAILED"
        says = f"Bad-Pin.Q8_0.gguf sha256 {hashlib.sha256(model.read_bytes()).hexdigest()} != pinned {'0' * 64}"
        assert says in deployment.message and "refused" in deployment.message
        assert "Deploying application badpin failed" in str(refused.value)
    finally:
        serve.delete("badpin")
    assert _post(served["base"], "/v1/chat/completions", _chat("x", "y")).status_code == 200  # the others serve on


# --- replicas that die under load ---------------------------------------------------------------------


class Load:
    """Streamed chats at once, each in a thread, their prompts chosen so that `per_replica` land on each
    replica (the router's rendezvous hash, over the replica ids the proxy showed)."""

    def __init__(self, base: str, replica_ids: set[str], per_replica: int, max_tokens: int, victim: str):
        """The victim's streams are long (still streaming when it is killed), the others' short, so the
        survivors end soon even on a busy machine."""
        self.prompts: list[dict] = []
        counts = dict.fromkeys(replica_ids, 0)
        i = 0
        while min(counts.values()) < per_replica:
            body = _chat(f"Client {i}, a distinct prompt.", "Tell a story", max_tokens, stream=True)
            key = affinity_key(json.dumps(body).encode(), 512)
            owner = max(replica_ids, key=lambda rid: _score(key, rid))
            if owner != victim:
                body = _chat(f"Client {i}, a distinct prompt.", "Tell a story", 48, stream=True)
                if affinity_key(json.dumps(body).encode(), 512) != key:
                    raise AssertionError("max_tokens must not change the affinity key")
            if counts[owner] < per_replica:
                counts[owner] += 1
                self.prompts.append(body)
            i += 1
        self.results: list[dict] = [{} for _ in self.prompts]
        self._streaming = threading.Semaphore(0)
        self.threads = [threading.Thread(target=self._one, args=(base, i), daemon=True)
                        for i in range(len(self.prompts))]
        for t in self.threads:
            t.start()

    def _one(self, base: str, i: int) -> None:
        result = self.results[i]
        try:
            with httpx.stream("POST", base + "/v1/chat/completions", json=self.prompts[i], timeout=CLIENT_S) as r:
                result["replica"], result["status"] = r.headers.get(REPLICA_HEADER), r.status_code
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    if len(lines) == 3:
                        self._streaming.release()
                result["events"] = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
                result["done"] = "data: [DONE]" in lines
        except Exception as e:  # noqa: BLE001 (the test reports it)
            result["raised"] = repr(e)

    def wait_streaming(self, timeout_s: float = CLIENT_S) -> None:
        """Until every stream has its first tokens."""
        deadline = time.monotonic() + timeout_s
        for _ in self.threads:
            assert self._streaming.acquire(timeout=max(0.0, deadline - time.monotonic())), self.results

    def finish(self, timeout_s: float = 600) -> list[dict]:  # a stream silent SILENCE_S ends (the ingress) anyway
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a request hung"
        return self.results


def _wait_replaced(base: str, gone: str, timeout_s: float = REPLACED_S) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = serve.status().applications[APP].deployments["Replica"].replica_states
        if states.get("RUNNING") == 2 and len(states) == 1:
            seen = _seen_replicas(base, tries=40)
            if len(seen) == 2 and gone not in seen:
                return set(seen)
        time.sleep(1)
    raise AssertionError(f"the replica {gone} was not replaced within {timeout_s} s: {serve.status()}")


def _check_outcomes(results: list[dict], victim: str) -> None:
    assert all("raised" not in r for r in results), results
    assert all(r["status"] == 200 for r in results), results
    for r in results:
        if r["replica"] == victim:  # cut: the stream ends with an error event, not a hang
            assert not r["done"] and "error" in r["events"][-1], r
        else:
            assert r["done"] and "error" not in r["events"][-1], r
    assert sum(r["replica"] == victim for r in results) == sum(r["replica"] != victim for r in results) == 2


def test_a_killed_replica_actor_ends_its_streams_with_an_error_and_is_replaced(served):
    base = served["base"]
    ids = set(_seen_replicas(base))
    victim = min(ids)
    load = Load(base, ids, 2, 2000, victim)
    load.wait_streaming()
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#Replica#{victim}", namespace="serve"), no_restart=True)
    _check_outcomes(load.finish(), victim)
    _wait_replaced(base, victim)
    assert _post(base, "/v1/chat/completions", _chat("after", "Hello")).status_code == 200


def test_a_killed_child_server_ends_its_streams_with_an_error_and_is_replaced(served):
    base = served["base"]
    ids = set(_seen_replicas(base))
    victim, pid = min(ids), None
    handle = serve.get_deployment_handle("Replica", APP)
    for _ in range(40):  # the handle picks a replica at random: ask until the victim answers
        identity = handle.identity.remote().result(timeout_s=CLIENT_S)
        if identity["replica"] == victim:
            pid = identity["child_pid"]
            break
    assert pid is not None
    load = Load(base, ids, 2, 2000, victim)
    load.wait_streaming()
    os.kill(pid, signal.SIGKILL)
    _check_outcomes(load.finish(), victim)
    _wait_replaced(base, victim)
    assert _post(base, "/v1/chat/completions", _chat("after", "Hello")).status_code == 200
