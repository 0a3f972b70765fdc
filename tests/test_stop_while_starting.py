"""A stop signal that arrives while the server still starts (its after-start listeners run) still stops
it (gateway/http/shutdown.py, Shutdown.take_signals). Sanic runs those listeners inside
`loop.run_until_complete`, where a plain `app.stop()` ends that run instead of the server's: the server
then served on as if never signalled (CI: a SIGTERM sent on the "listening on" line waited 15 s)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# the server as sanic_app builds it for --native, with one more after-start listener that takes its
# time (as a slow start-up's) after the server has said it listens
SERVER = textwrap.dedent("""
    import asyncio, sys
    sys.path.insert(0, sys.argv[1])
    from sanic import Sanic
    from bankml.config import LimitsConfig
    from gateway.http.loopback import make_protocol
    from gateway.http.sanic_app import bind, sanic_app
    from gateway.http.shutdown import Shutdown

    limits = LimitsConfig()
    shutdown = Shutdown(2.0, watchdog=None)
    app = sanic_app("stop_while_starting", limits, {}, "", None, shutdown, access_log=False)
    sock = bind("127.0.0.1", 0)
    shutdown.add_listener(sock)

    @app.after_server_start
    async def slow_start(app):
        print("listening", flush=True)
        await asyncio.sleep(3)

    @app.before_server_stop
    async def stopping(app):
        print("stopping", flush=True)

    @app.after_server_stop
    async def stopped(app):
        print("stopped", flush=True)

    app.prepare(sock=sock, protocol=make_protocol(limits, shutdown), single_process=True, motd=False,
                access_log=False)
    Sanic.serve_single(app)
""")


@pytest.mark.parametrize("signals", [[signal.SIGTERM], [signal.SIGINT], [signal.SIGTERM, signal.SIGINT, signal.SIGTERM]])
def test_a_signal_during_the_after_start_listeners_stops_the_server(signals):
    """One signal, or several (each asks the stop once: the before-stop listeners still run)."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(ROOT)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "listening", proc.stderr.read()[-2000:]
        for sig in signals:  # the slow listener is still running
            proc.send_signal(sig)
            time.sleep(0.05)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out.split() == ["stopping", "stopped"], (out, err[-2000:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
