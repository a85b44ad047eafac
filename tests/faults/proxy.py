"""A fault-injecting HTTP proxy in front of a real vLLM server.

Every request is forwarded unchanged unless a rule for its route says otherwise: answer 503, reset the connection
without an answer, stall (hold the request like a SIGSTOPped server), delay it (a latency spike: forwarded after
`delay_s`), or rewrite the JSON answer. `down()` resets
every connection, as a killed server would; `up()` brings it back. Rules can be limited to the next n requests.
"""

from __future__ import annotations

import http.client
import json
import socket
import struct
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse


@dataclass
class Rule:
    route: str  # path prefix, e.g. "/metrics"
    action: str  # "503" | "reset" | "stall" | "delay" | "rewrite"
    remaining: int | None = None  # None = every matching request
    rewrite: object = None  # callable(dict) -> dict for "rewrite"
    stall_s: float = 3600.0
    delay_s: float = 1.0


class FaultProxy:
    def __init__(self, upstream: str):
        parsed = urlparse(upstream)
        self.upstream_host, self.upstream_port = parsed.hostname, parsed.port
        self.rules: list[Rule] = []
        self.hits: dict[str, int] = {}
        self.is_down = False
        self._lock = threading.Lock()
        self._release = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                proxy._handle(self)

            do_POST = do_GET

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # a client that gave up (a delayed request): quiet
                pass

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    # ---- control ---------------------------------------------------------------------------------------------------
    def add(self, route: str, action: str, remaining: int | None = None, **kw) -> Rule:
        rule = Rule(route, action, remaining, **kw)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()
        self._release.set()
        self._release = threading.Event()
        self.is_down = False

    def down(self) -> None:
        self.is_down = True

    def up(self) -> None:
        self.is_down = False

    def close(self) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()

    # ---- request path ----------------------------------------------------------------------------------------------
    def _match(self, path: str) -> Rule | None:
        with self._lock:
            self.hits[path.split("?")[0]] = self.hits.get(path.split("?")[0], 0) + 1
            for rule in self.rules:
                if path.startswith(rule.route) and (rule.remaining is None or rule.remaining > 0):
                    if rule.remaining is not None:
                        rule.remaining -= 1
                    return rule
        return None

    @staticmethod
    def _reset(handler) -> None:
        """Close with RST: the client sees a connection reset, not an answer."""
        handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        handler.close_connection = True
        handler.connection.close()

    def _handle(self, handler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else None
        if self.is_down:
            return self._reset(handler)
        rule = self._match(handler.path)
        if rule is not None and rule.action == "reset":
            return self._reset(handler)
        if rule is not None and rule.action == "stall":
            self._release.wait(rule.stall_s)
            return self._reset(handler)
        if rule is not None and rule.action == "delay":
            time.sleep(rule.delay_s)
        if rule is not None and rule.action == "503":
            return self._send(handler, 503, b'{"error": {"message": "injected: service unavailable"}}')
        conn = http.client.HTTPConnection(self.upstream_host, self.upstream_port, timeout=600)
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in ("host", "connection")}
        try:
            conn.request(handler.command, handler.path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
        except OSError:
            return self._reset(handler)
        finally:
            conn.close()
        if rule is not None and rule.action == "rewrite":
            data = json.dumps(rule.rewrite(json.loads(data))).encode()
        self._send(handler, response.status, data, response.getheader("Content-Type", "application/json"))

    @staticmethod
    def _send(handler, status: int, data: bytes, content_type: str = "application/json") -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
