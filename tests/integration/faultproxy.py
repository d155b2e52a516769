"""A loopback HTTP proxy between boto3 and the S3 server: it records every request and injects
the failures object stores really produce (throttling, 500s, resets, short and damaged bodies).

boto3 is pointed at the proxy as its endpoint and is otherwise unmodified; the proxy forwards
each request to the real (moto) server unless a rule says otherwise.

With rate= (bytes per second), every answer's body shares one token bucket on its way to the
client: a link of that bandwidth, however many connections use it (the benchmark's throttled S3
rows); there, bodies no rule alters are streamed through, not held whole.
"""

from __future__ import annotations

import http.client
import re
import socket
import socketserver
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

ERROR_BODY = ('<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
              "<RequestId>faultproxy</RequestId></Error>")
ERRORS = {"503": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
          "500": (500, "Internal Server Error", "InternalError", "We encountered an internal error."),
          # S3's answer where the role may read the object but not decrypt it (SSE-KMS): AWS's wording
          "kms-denied": (403, "Forbidden", "AccessDenied",
                         "User: arn:aws:sts::123456789012:assumed-role/gpu-node/i-0abc is not authorized to "
                         "perform: kms:Decrypt on resource: arn:aws:kms:us-east-1:123456789012:key/1234abcd "
                         "because no identity-based policy allows the kms:Decrypt action"),
          # S3's answer to a request signed more than 15 minutes off its own clock
          "skewed": (403, "Forbidden", "RequestTimeTooSkewed",
                     "The difference between the request time and the current time is too large."),
          # OpenStack Swift's S3 layer, to boto3's default upload encoding
          "no-chunked": (501, "Not Implemented", "NotImplemented",
                         "Transferring payloads in multiple chunks using aws-chunked is not supported."),
          # a store without conditional writes, to If-None-Match (AWS's wording before August 2024)
          "no-conditional": (501, "Not Implemented", "NotImplemented",
                             "A header you provided implies functionality that is not implemented")}
# What each action does to the request it matches:
#   503, 500      answer with that error, do not forward (kms-denied: S3's 403 for a KMS key not granted;
#                 skewed, no-chunked, no-conditional: the answers to a skewed clock, to aws-chunked, to If-None-Match)
#   reset         drop the connection (TCP RST) before forwarding
#   reset-after   forward, then drop the connection: the server acted, the client never hears
#   truncate      forward; send the true headers and half the body, then drop the connection
#   short         forward; send half the body with a Content-Length that matches it
#   corrupt       forward; flip one byte in the middle of the body
#   stall         take the request and never answer (the connection stays open until the proxy closes)
#   trickle       forward; send the true headers, then the body TRICKLE bytes at a time, TRICKLE_S apart
#   ignore-range  forward without the Range header: 200 and the whole object, as a proxy that ignores it
#   slow          wait SLOW_S, then forward: a slow link that still moves (no read timeout of 1 s trips)
ACTIONS = {"503", "500", "kms-denied", "skewed", "no-chunked", "no-conditional", "reset", "reset-after", "truncate", "short", "corrupt", "stall", "trickle", "ignore-range",
           "slow"}
BODY_ACTIONS = {"reset-after", "truncate", "short", "corrupt", "trickle"}  # need the whole answer first
TRICKLE, TRICKLE_S = 4, 0.25  # 16 bytes a second: a store that never times out a read and never ends
SLOW_S = 0.7
CHUNK = 256 << 10


class Throttle:
    """One link's bandwidth, shared by every connection: each send reserves its bytes and waits
    until the link would have carried them (a token bucket with a burst of one chunk)."""

    def __init__(self, rate: float):
        self.rate = float(rate)
        self._lock = threading.Lock()
        self._free_at = time.monotonic()  # when the link has carried everything reserved so far

    def take(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            start = max(self._free_at, now - CHUNK / self.rate)  # idle time banks one chunk, no more
            self._free_at = start + n / self.rate
            wait = self._free_at - now - CHUNK / self.rate
        if wait > 0:
            time.sleep(wait)  # the throttle itself: this connection's bytes wait for the link


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
    rate: float | None = None  # bytes per second down to the client, all connections together
    # The bucket's region, as S3 checks it (moto does not): a request signed for another region is
    # answered as S3 answers it, 301 with the bucket's region in x-amz-bucket-region (HEAD: no body).
    bucket_region: str | None = None
    trickling: int = 0  # trickled answers whose body has begun: the client is in its slow read

    def __post_init__(self):
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._throttle = Throttle(self.rate) if self.rate else None
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
        self._closed.set()  # stalled and trickling answers end
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
            if self.bucket_region and signed_for(lower) != self.bucket_region:
                data = b"" if method == "HEAD" else ERROR_BODY.format(
                    code="PermanentRedirect",
                    message="The bucket you are attempting to access must be addressed using the specified endpoint.",
                ).encode()
                sock.sendall(f"HTTP/1.1 301 Moved Permanently\r\nx-amz-bucket-region: {self.bucket_region}\r\n"
                             f"Content-Type: application/xml\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
                continue
            if action == "reset":
                return _reset(sock)
            if action == "stall":
                self._closed.wait()  # the server's answer never comes
                return _reset(sock)
            if action in ERRORS:
                status, reason, code, message = ERRORS[action]
                data = b"" if method == "HEAD" else ERROR_BODY.format(code=code, message=message).encode()
                sock.sendall(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
                             f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
                continue
            if action == "ignore-range":
                headers = [(k, v) for k, v in headers if k.lower() != "range"]
            if action == "slow":
                time.sleep(SLOW_S)  # the link's delay: nothing signals it, it is the fault itself
            if self._throttle and action not in BODY_ACTIONS:  # a link: streamed through, not held whole
                self._stream(sock, method, target, headers, body)
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
                sock.sendall(head.encode())
                self._send(sock, data[: len(data) // 2])
                return _reset(sock)
            if action == "trickle":
                sock.sendall(head.encode())
                view = memoryview(data)
                begun = False
                while view and not self._closed.wait(TRICKLE_S):  # the pace itself: a timer, not a sync
                    try:
                        sock.sendall(view[:TRICKLE])
                    except OSError:  # the client gave up
                        return
                    view = view[TRICKLE:]
                    if not begun:
                        begun = True
                        with self._lock:
                            self.trickling += 1
                continue
            sock.sendall(head.encode())
            self._send(sock, data)

    def _send(self, sock: socket.socket, data) -> None:
        view = memoryview(data)
        while view:
            piece = view[:CHUNK]
            if self._throttle:
                self._throttle.take(len(piece))
            sock.sendall(piece)
            view = view[len(piece):]

    def _stream(self, sock, method, target, headers, body) -> None:
        """Forward one request and stream its answer back, chunk by chunk (throttled)."""
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.request(method, target, body=body,
                         headers={k: v for k, v in headers if k.lower() not in ("expect", "connection")})
            resp = conn.getresponse()
            out = [(k, v) for k, v in resp.getheaders() if k.lower() not in ("transfer-encoding", "connection")]
            length = resp.getheader("content-length")
            if length is None and method != "HEAD":  # chunked upstream: hold it to tell its length
                data = resp.read()
                out = [(k, v) for k, v in out if k.lower() != "content-length"] + [("Content-Length", str(len(data)))]
                sock.sendall(f"HTTP/1.1 {resp.status} {resp.reason}\r\n".encode()
                             + "".join(f"{k}: {v}\r\n" for k, v in out).encode() + b"\r\n")
                self._send(sock, data)
                return
            sock.sendall(f"HTTP/1.1 {resp.status} {resp.reason}\r\n".encode()
                         + "".join(f"{k}: {v}\r\n" for k, v in out).encode() + b"\r\n")
            if method == "HEAD":
                return
            buf = bytearray(CHUNK)
            while n := resp.readinto(buf):
                self._send(sock, memoryview(buf)[:n])
        finally:
            conn.close()

    def _forward(self, method, target, headers, body):
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.request(method, target, body=body,
                         headers={k: v for k, v in headers if k.lower() not in ("expect", "connection")})
            resp = conn.getresponse()
            return resp.status, resp.reason, resp.getheaders(), resp.read()
        finally:
            conn.close()


def signed_for(headers: dict[str, str]) -> str | None:
    """The region a SigV4 request is signed for: its credential scope (KEY/DATE/REGION/s3/aws4_request)."""
    m = re.search(r"Credential=[^/,]+/\d+/([^/,]+)/", headers.get("authorization", ""))
    return m.group(1) if m else None


def _reset(sock: socket.socket) -> None:
    """Close with a TCP RST, as a dropped connection looks to the client."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def main(argv: list[str] | None = None) -> int:
    """python -m tests.integration.faultproxy HOST:PORT [--rate BYTES_PER_S]: serve until killed,
    printing the proxy's URL as the first line of stdout (the benchmark's throttled link)."""
    import argparse
    import sys

    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    p.add_argument("upstream", help="HOST:PORT of the server behind the proxy")
    p.add_argument("--rate", type=float, help="bytes per second to the clients, all connections together")
    a = p.parse_args(argv)
    host, _, port = a.upstream.rpartition(":")
    proxy = FaultProxy((host, int(port)), rate=a.rate)
    print(proxy.url, flush=True)
    try:
        threading.Event().wait()  # until the process is stopped
    except KeyboardInterrupt:
        pass
    proxy.close()
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
