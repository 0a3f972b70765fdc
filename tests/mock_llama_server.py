"""A small stand-in for llama.cpp's llama-server, for the P0 gateway tests (and the bench without one).

    python tests/mock_llama_server.py -m MODEL --host H --port P [any llama-server flags]
        [--mock-record FILE] [--mock-exit-during-startup] [--mock-loading-s S]
        [--mock-model-path PATH] [--mock-reply TEXT]

It takes llama-server's command line (unknown flags are ignored), so the gateway can `--spawn` it
through a wrapper script, and answers what the gateway asks llama-server, in llama-server's shapes
(compact JSON, chunked SSE): GET /health (503 "Loading model" for --mock-loading-s, then 200),
GET /props (`model_path`: -m, or --mock-model-path), GET /v1/models, POST /v1/chat/completions
(plain or streamed: the reply "Savante knows." in word pieces, 7 prompt tokens (3 of them cached) and
2 completion tokens; a stream states them in its last chunk's timings, and in a usage chunk only when
stream_options.include_usage asks, as llama-server does; with "max_tokens": N and
`pieces_from_max_tokens` set, N pieces instead).

Switches while it runs: POST /mock/config with a JSON object sets any of `model_path`,
`props_status`, `chat_status` (answered with llama-server's error object), `reply`, `oversize`
("length": announces a Content-Length of `oversize_bytes` and sends little; "chunked": a chunked
non-streamed body of `oversize_bytes`; "line": a stream whose first event is `oversize_bytes` long),
`stream_delay_ms`, `pieces_from_max_tokens`. GET /mock/last answers the raw body of the last chat
request, GET /mock/stats how many streams lost their client before the end. --mock-record writes {"pid", "argv"} on start; --mock-exit-during-startup writes a few
lines on stderr and exits 1 before it ever listens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BUILD = "b0-mock"


def compact(v) -> bytes:
    return json.dumps(v, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


class MockState:
    def __init__(self, model_path: str, reply: str, loading_s: float):
        self.lock = threading.Lock()
        self.ready_at = time.monotonic() + loading_s
        self.config = {
            "model_path": model_path, "props_status": 200, "chat_status": 200, "reply": reply,
            "oversize": None, "oversize_bytes": (64 << 20) + 1, "stream_delay_ms": 0,
            "pieces_from_max_tokens": False,
        }
        self.last_body = b""
        self.aborted_streams = 0  # streams whose client went away before the end


def pieces_of(text: str) -> list[str]:
    """Word pieces, each with its following space, as a tokenizer would stream them."""
    out, start = [], 0
    for i, ch in enumerate(text):
        if ch == " ":
            out.append(text[start:i + 1])
            start = i + 1
    if start < len(text):
        out.append(text[start:])
    return out


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "mock-llama-server"
    # the head and the body go out in two writes: with Nagle on, the second waits for a delayed ACK (40 ms)
    disable_nagle_algorithm = True
    state: MockState

    def log_message(self, *args) -> None:
        pass

    # --- writing -------------------------------------------------------------------------------

    def _send(self, status: int, body: bytes, content_type: str = "application/json; charset=utf-8") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _start_chunked(self, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _error(self, status: int, message: str, type_: str) -> None:
        self._send(status, compact({"error": {"code": status, "message": message, "type": type_}}))

    # --- routes --------------------------------------------------------------------------------

    def do_GET(self) -> None:
        st = self.state
        with st.lock:
            cfg = dict(st.config)
        if self.path == "/health":
            if time.monotonic() < st.ready_at:
                return self._error(503, "Loading model", "unavailable_error")
            return self._send(200, b'{"status":"ok"}')
        if self.path == "/props":
            if cfg["props_status"] != 200:
                return self._error(cfg["props_status"], "mock /props failure", "server_error")
            return self._send(200, compact({
                "default_generation_settings": {"n_ctx": 4096, "params": {"temperature": 0.8}},
                "total_slots": 1, "model_path": cfg["model_path"], "chat_template": "{{ messages }}",
                "build_info": BUILD}))
        if self.path == "/v1/models":
            name = os.path.basename(cfg["model_path"])
            return self._send(200, compact({"models": [{"name": name, "model": name}], "object": "list",
                                            "data": [{"id": name, "object": "model", "owned_by": "llamacpp"}]}))
        if self.path == "/mock/last":
            return self._send(200, st.last_body, "application/octet-stream")
        if self.path == "/mock/stats":
            return self._send(200, compact({"aborted_streams": st.aborted_streams}))
        self._error(404, "File Not Found", "not_found_error")

    def do_POST(self) -> None:
        st = self.state
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/mock/config":
            with st.lock:
                st.config.update(json.loads(body))
            return self._send(200, b'{"ok":true}')
        if self.path != "/v1/chat/completions":
            return self._error(404, "File Not Found", "not_found_error")
        with st.lock:
            st.last_body = body
            cfg = dict(st.config)
        try:
            req = json.loads(body)
        except ValueError:
            return self._error(500, "mock: body is not JSON", "server_error")
        if cfg["chat_status"] != 200:
            return self._error(cfg["chat_status"], "mock chat failure", "invalid_request_error")
        if cfg["oversize"] == "length":
            return self._announce_too_much(cfg["oversize_bytes"])
        texts = pieces_of(cfg["reply"])
        if cfg["pieces_from_max_tokens"] and isinstance(req.get("max_tokens"), int):
            texts = [f"t{i} " for i in range(req["max_tokens"])]
        if req.get("stream") is True:
            return self._stream(req, texts, cfg)
        if cfg["oversize"] == "chunked":
            return self._chunked_body(cfg["oversize_bytes"])
        self._send(200, compact({
            "choices": [{"finish_reason": "stop", "index": 0,
                         "message": {"role": "assistant", "content": "".join(texts)}}],
            "created": int(time.time()), "model": "mock", "system_fingerprint": BUILD, "object": "chat.completion",
            "usage": {"completion_tokens": len(texts), "prompt_tokens": 7, "total_tokens": 7 + len(texts)},
            "id": "chatcmpl-mock", "timings": {"prompt_n": 7, "predicted_n": len(texts)}}))

    def _announce_too_much(self, n: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(n))
        self.end_headers()
        self.wfile.write(b'{"choices":[')
        self.wfile.flush()
        self.close_connection = True

    def _chunked_body(self, n: int) -> None:
        self._start_chunked("application/json")
        block = b" " * (1 << 16)
        sent = 0
        try:
            while sent < n:
                part = block[:min(len(block), n - sent)]
                self._chunk(part)
                sent += len(part)
            self._chunk(b"{}")
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the gateway gave up reading, as it should
            pass
        self.close_connection = True

    def _stream(self, req: dict, texts: list[str], cfg: dict) -> None:
        created = int(time.time())

        def event(choice: dict, **extra) -> bytes:
            return b"data: " + compact({"choices": [choice], "created": created, "id": "chatcmpl-mock",
                                        "model": "mock", "system_fingerprint": BUILD,
                                        "object": "chat.completion.chunk", **extra}) + b"\n\n"

        self._start_chunked("text/event-stream")
        try:
            if cfg["oversize"] == "line":
                block = b"x" * (1 << 16)
                self._chunk(b"data: ")
                for _ in range(cfg["oversize_bytes"] // len(block) + 1):
                    self._chunk(block)
            self._chunk(event({"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}))
            for piece in texts:
                if cfg["stream_delay_ms"]:
                    time.sleep(cfg["stream_delay_ms"] / 1e3)
                self._chunk(event({"finish_reason": None, "index": 0, "delta": {"content": piece}}))
            # as llama-server: the last chunk has timings; usage comes in a chunk of its own, when asked for
            timings = {"cache_n": 3, "prompt_n": 4, "predicted_n": len(texts)}
            self._chunk(event({"finish_reason": "stop", "index": 0, "delta": {}}, timings=timings))
            if (req.get("stream_options") or {}).get("include_usage") is True:
                usage = {"completion_tokens": len(texts), "prompt_tokens": 7, "total_tokens": 7 + len(texts)}
                self._chunk(b"data: " + compact({"choices": [], "created": created, "id": "chatcmpl-mock",
                                                 "model": "mock", "object": "chat.completion.chunk",
                                                 "usage": usage, "timings": timings}) + b"\n\n")
            self._chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client went away
            with self.state.lock:
                self.state.aborted_streams += 1
            self.close_connection = True


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-m", dest="model", default="")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--mock-record")
    p.add_argument("--mock-exit-during-startup", action="store_true")
    p.add_argument("--mock-loading-s", type=float, default=0.0)
    p.add_argument("--mock-model-path")
    p.add_argument("--mock-reply", default="Savante knows.")
    args, _ = p.parse_known_args(argv)
    if args.mock_record:  # written whole, then renamed: a reader never sees half of it
        with open(args.mock_record + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "argv": argv}, f)
        os.replace(args.mock_record + ".tmp", args.mock_record)
    print(f"build: 0 (mock) with {sys.executable}", file=sys.stderr, flush=True)
    print(f"main: loading model from {args.model}", file=sys.stderr, flush=True)
    if args.mock_exit_during_startup:
        time.sleep(0.2)
        print(f"llama_model_load: error loading model: mock cannot read {args.model}", file=sys.stderr)
        print("main: exiting due to model loading error", file=sys.stderr, flush=True)
        return 1
    Handler.state = MockState(args.mock_model_path or args.model, args.mock_reply, args.mock_loading_s)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    print(f"main: server is listening on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
