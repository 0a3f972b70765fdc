"""Loopback helpers the benchmarks share: a free port, and one timed GET /health on a fresh connection."""

from __future__ import annotations

import socket
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_once(port: int) -> float:
    """One GET /health on a fresh connection, read to the close (or to its Content-Length); ms."""
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    if not data.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"/health on {port} answered {data[:60]!r}")
    return (time.perf_counter() - t0) * 1e3
