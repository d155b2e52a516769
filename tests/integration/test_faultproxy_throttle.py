"""The fault proxy as a throttled link (the benchmark's S3 rows at 100 MB/s and 1 GB/s): every
byte arrives, and never faster than the rate, however many connections share it."""

from __future__ import annotations

import http.client
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.integration.faultproxy import CHUNK, FaultProxy

DATA = os.urandom(3 << 20)


@pytest.fixture
def upstream():
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(DATA)))
            self.end_headers()
            self.wfile.write(DATA)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address
    server.shutdown()
    server.server_close()


def _get(port: int) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", "/blob")
        return conn.getresponse().read()
    finally:
        conn.close()


@pytest.mark.parametrize("clients", [1, 3])
def test_a_throttled_link_carries_every_byte_no_faster_than_its_rate(upstream, clients):
    rate = 20e6
    proxy = FaultProxy(upstream, rate=rate)
    try:
        port = int(proxy.url.rsplit(":", 1)[1])
        got: list[bytes] = []
        t0 = time.monotonic()
        threads = [threading.Thread(target=lambda: got.append(_get(port))) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
    finally:
        proxy.close()
    assert got == [DATA] * clients
    # One chunk may go ahead of the link (its burst); the rest waits for it, all clients together.
    assert elapsed >= (clients * len(DATA) - 2 * CHUNK) / rate, elapsed
    assert len(proxy.requests) == clients
