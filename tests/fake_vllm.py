"""A stand-in for a vLLM server's HTTP side, for tests of the trainer's protocol without vLLM: the routes a test
answers, JSON in and out, served from a thread (`FakeVLLM(...).start()`) or from a spawned process that owns a
device (`serve_forever`, then `wait_until_up` in the parent).

A route handler takes a `Request` and returns the JSON payload (status 200), `Reply(payload, status)`, or `DROP`
(the connection is shut mid-request, as a server process dying would). `get_routes(...)` gives the GET routes the
weight sync reads (`/get_world_size`, `/server_info`); a route nobody answers replies `{}` unless `fallback` says
otherwise. The real server is tested against in tests/test_vllm_client.py and the `vllm`-marked tests.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

DROP = object()  # a handler's return value: shut the connection without a reply


@dataclass
class Reply:
    payload: Any
    status: int = 200


@dataclass
class Request:
    method: str  # "GET" | "POST"
    route: str  # the path without the query, e.g. "/update_weights"
    query: str  # what follows "?" ("" when nothing does)
    body: dict = field(default_factory=dict)  # the JSON body of a POST ({} when empty)


Handler = Callable[[Request], Any]


def server_info_payload(dtype: str = "torch.bfloat16", backend: str | None = None,
                        gpu_memory_utilization: float | None = None, env_vars: str | None = None,
                        insecure_serialization: bool | None = None) -> dict:
    """A `/server_info` payload with only the fields the trainer reads (grpo/server_facts.py, grpo/weight_sync.py)."""
    vllm_config: dict = {"model_config": {"dtype": dtype}}
    if backend is not None:
        vllm_config["weight_transfer_config"] = {"backend": backend}
    if gpu_memory_utilization is not None:
        vllm_config["cache_config"] = {"gpu_memory_utilization": gpu_memory_utilization}
    info: dict = {"vllm_config": vllm_config}
    if insecure_serialization is not None:
        info["vllm_env"] = {"VLLM_ALLOW_INSECURE_SERIALIZATION": insecure_serialization}
    if env_vars is not None:
        info["system_env"] = {"env_vars": env_vars}
    return info


def get_routes(info: dict | Callable[[], dict], world_size: int = 1) -> dict[str, Handler]:
    """The GET routes a weight sync starts with; `info` is the `/server_info` payload or a function making it."""
    return {"/get_world_size": lambda request: {"world_size": world_size},
            "/server_info": lambda request: info() if callable(info) else info}


class FakeVLLM:
    """An HTTP server answering `routes` ({route: handler}, both methods) on 127.0.0.1:`port` (0: a free one)."""

    def __init__(self, routes: dict[str, Handler], port: int = 0, fallback: Handler | None = None):
        self.routes, self.fallback = dict(routes), fallback or (lambda request: {})
        fake = self

        class _Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, method: str) -> None:
                route, _, query = self.path.partition("?")
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else {}
                result = fake.routes.get(route, fake.fallback)(Request(method, route, query, body or {}))
                if result is DROP:
                    self.connection.shutdown(2)
                    return
                reply = result if isinstance(result, Reply) else Reply(result)
                data = json.dumps(reply.payload).encode()
                self.send_response(reply.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802 (http.server API)
                self._answer("GET")

            def do_POST(self):  # noqa: N802 (http.server API)
                self._answer("POST")

        self.http = ThreadingHTTPServer(("127.0.0.1", port), _Handler)
        self.http.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def start(self) -> FakeVLLM:
        """Serve from a daemon thread; returns self."""
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        return self

    def serve_forever(self) -> None:
        """Serve from this thread (the body of a spawned process playing the server)."""
        self.http.serve_forever()

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()

    def __enter__(self) -> FakeVLLM:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_until_up(base_url: str, process, timeout: float = 120.0) -> None:
    """Poll `/get_world_size` until a fake started in `process` (a multiprocessing.Process) answers."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(f"{base_url}/get_world_size", timeout=2)
            return
        except httpx.TransportError:
            assert time.monotonic() < deadline and process.is_alive(), f"the fake vLLM at {base_url} did not start"
            time.sleep(0.5)
