"""A loopback HTTP proxy between boto3 and the S3 server: it records every request and injects
the failures object stores really produce (throttling, 500s, resets, short and damaged bodies).

boto3 is pointed at the proxy as its endpoint and is otherwise unmodified; the proxy forwards
each request to the real (moto) server unless a rule says otherwise.
"""

from __future__ import annotations

import http.client
import socket
import socketserver
import struct
import threading
from dataclasses import dataclass, field
from typing import Callable

ERROR_BODY = ('<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
              "<RequestId>faultproxy</RequestId></Error>")
ERRORS = {"503": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
          "500": (500, "Internal Server Error", "InternalError", "We encountered an internal error.")}
# What each action does to the request it matches:
#   503, 500      answer with that error, do not forward
#   reset         drop the connection (TCP RST) before forwarding
#   reset-after   forward, then drop the connection: the server acted, the client never hears
#   truncate      forward; send the true headers and half the body, then drop the connection
#   short         forward; send half the body with a Content-Length that matches it
#   corrupt       forward; flip one byte in the middle of the body
ACTIONS = {"503", "500", "reset", "reset-after", "truncate", "short", "corrupt"}


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]

    @property
    def is_blob(self) -> bool:
        return "/blobs/" in self.path

    @property
    def is_index(self) -> bool:
        return "/index/" in self.path


@dataclass
class Rule:
    action: str
    match: Callable[[Request], bool]
    times: int | None  # None: every matching request
    fired: int = 0


@dataclass
class FaultProxy:
    upstream: tuple[str, int]
    requests: list[Request] = field(default_factory=list)
    rules: list[Rule] = field(default_factory=list)

    def __post_init__(self):
        self._lock = threading.Lock()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                proxy._serve(self.request)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def inject(self, action: str, match: Callable[[Request], bool], times: int | None = 1) -> Rule:
        assert action in ACTIONS, action
        rule = Rule(action, match, times)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()
            self.rules.clear()

    def _decide(self, req: Request) -> str | None:
        with self._lock:
            self.requests.append(req)
            for rule in self.rules:
                if (rule.times is None or rule.fired < rule.times) and rule.match(req):
                    rule.fired += 1
                    return rule.action
        return None

    # -- one client connection: HTTP/1.1 requests until it closes ---------------------------------

    def _serve(self, sock: socket.socket) -> None:
        rfile = sock.makefile("rb")
        while True:
            line = rfile.readline(65537)
            if not line.strip():
                return
            method, target, _ = line.decode("latin-1").split(" ", 2)
            headers: list[tuple[str, str]] = []
            while (h := rfile.readline(65537)) not in (b"\r\n", b"\n", b""):
                k, v = h.decode("latin-1").split(":", 1)
                headers.append((k.strip(), v.strip()))
            lower = {k.lower(): v for k, v in headers}
            if lower.get("expect", "").lower() == "100-continue":
                sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            body = rfile.read(int(lower.get("content-length") or 0))
            action = self._decide(Request(method, target, lower))
            if action == "reset":
                return _reset(sock)
            if action in ERRORS:
                status, reason, code, message = ERRORS[action]
                data = b"" if method == "HEAD" else ERROR_BODY.format(code=code, message=message).encode()
                sock.sendall(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
                             f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
                continue
            status, reason, out_headers, data = self._forward(method, target, headers, body)
            if action == "reset-after":
                return _reset(sock)
            length = len(data)
            if action == "corrupt" and data:
                data = bytearray(data)
                data[len(data) // 2] ^= 0xFF
                data = bytes(data)
            elif action == "short" and data:
                data = data[: len(data) // 2]
                length = len(data)
            if method == "HEAD":  # a HEAD tells the object's length and carries no body
                length = int(dict((k.lower(), v) for k, v in out_headers).get("content-length", 0))
            head = f"HTTP/1.1 {status} {reason}\r\n" + "".join(
                f"{k}: {v}\r\n" for k, v in out_headers
                if k.lower() not in ("content-length", "transfer-encoding", "connection"))
            head += f"Content-Length: {length}\r\n\r\n"
            if action == "truncate" and data:
                sock.sendall(head.encode() + data[: len(data) // 2])
                return _reset(sock)
            sock.sendall(head.encode() + data)

    def _forward(self, method, target, headers, body):
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.request(method, target, body=body,
                         headers={k: v for k, v in headers if k.lower() not in ("expect", "connection")})
            resp = conn.getresponse()
            return resp.status, resp.reason, resp.getheaders(), resp.read()
        finally:
            conn.close()


def _reset(sock: socket.socket) -> None:
    """Close with a TCP RST, as a dropped connection looks to the client."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
