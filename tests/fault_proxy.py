"""A proxy between lambjax and the GCS emulator (tests/gcs_emulator.py) that fails requests
as real buckets do: a chosen share of them is answered 429 (rate limit), 503 (backend
unavailable) or 403 (write access revoked: not retried by the clients), has its connection
reset, or stalls before it is answered.

It runs in the test process (a thread), on a free local port; `url` replaces the emulator's
in what lambjax reads (`environment`). Each request is read whole, then either failed or sent
on to the emulator and its answer read whole and returned, with the emulator's address in a
JSON body or a Location header (the resumable upload sessions) replaced by the proxy's, so
that every later request of the client comes back through it.

  proxy = FaultProxy(emulator.url)
  proxy.inject(share=0.1, kinds=("429", "503", "reset"))       # transient
  proxy.inject(share=1.0, kinds=("403",), match=uploads)       # persistent, writes only
  proxy.inject(share=0.0)                                      # healthy again
"""

import http.client
import http.server
import json
import random
import socket
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable

KINDS = ("429", "503", "403", "reset", "stall")

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def uploads(method: str, path: str, agent: str) -> bool:
    """Requests that write objects (simple, multipart and resumable uploads)."""
    return method in ("POST", "PUT") and path.startswith("/upload/")


def gcsfs_uploads(method: str, path: str, agent: str) -> bool:
    """Uploads by gcsfs: lambjax's own files, the metrics mirror, Orbax's small files (its
    arrays go through tensorstore)."""
    return uploads(method, path, agent) and agent.startswith("python-gcsfs")


def every(method: str, path: str, agent: str) -> bool:
    return True


class FaultProxy:
    def __init__(self, upstream: str, seed: int = 0):
        self.upstream = upstream.rstrip("/")
        host, port = self.upstream.split("//", 1)[1].split(":")
        self._upstream_address = (host, int(port))
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self.share, self.kinds, self.match, self.stall_s = 0.0, KINDS, every, 2.0
        self.counts: Counter = Counter()  # "forwarded", and each kind injected
        self._server = _Server(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def inject(
        self,
        share: float,
        kinds: tuple[str, ...] = ("429", "503", "reset"),
        match: Callable[[str, str, str], bool] = every,
        stall_s: float = 2.0,
    ) -> None:
        """From now on, fail `share` of the requests that `match(method, path, user_agent)`
        selects, each with one of `kinds` drawn at random."""
        assert set(kinds) <= set(KINDS), kinds
        with self._lock:
            self.share, self.kinds, self.match, self.stall_s = share, kinds, match, stall_s

    def injected(self) -> int:
        return sum(n for kind, n in self.counts.items() if kind in KINDS)

    def environment(self, env: dict) -> dict:
        """`env` with every GCS client lambjax uses pointed at the proxy (lambjax.storage)."""
        env = dict(env)
        for name in (
            "STORAGE_EMULATOR_HOST",
            "TENSORSTORE_GCS_HTTP_URL",
            "CLOUD_STORAGE_EMULATOR_ENDPOINT",
        ):
            env[name] = self.url
        return env

    def fault(self, method: str, path: str, agent: str) -> str | None:
        """The fault for this request, if one is drawn."""
        with self._lock:
            self.counts[f"agent {agent.split('/')[0]}"] += 1
            chosen = self.share and self.match(method, path, agent)
            if chosen and self._random.random() < self.share:
                kind = self._random.choice(self.kinds)
            else:
                kind = "forwarded"
            self.counts[kind] += 1
        return None if kind == "forwarded" else kind

    def forward(self, method: str, path: str, headers: dict, body: bytes):
        """(status, headers, body) of the emulator's answer, its address replaced."""
        connection = http.client.HTTPConnection(*self._upstream_address, timeout=120)
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            payload = response.read()
            dropped = _HOP_BY_HOP - ({"content-length"} if method == "HEAD" else set())
            answer = [(k, v) for k, v in response.getheaders() if k.lower() not in dropped]
            status = response.status
        finally:
            connection.close()
        answer = [(k, v.replace(self.upstream, self.url)) for k, v in answer]
        if "json" in dict((k.lower(), v) for k, v in answer).get("content-type", ""):
            payload = payload.replace(self.upstream.encode(), self.url.encode())
            payload = payload.replace(
                json.dumps(self.upstream)[1:-1].encode(), json.dumps(self.url)[1:-1].encode()
            )
        return status, answer, payload

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        """Quiet for the connections the proxy resets and those a client dropped."""
        if not isinstance(sys.exc_info()[1], (ConnectionError, OSError)):
            super().handle_error(request, client_address)


def _handler(proxy: FaultProxy):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet: the counts say what happened
            pass

        def read_body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def handle_any(self):
            body = self.read_body()
            kind = proxy.fault(self.command, self.path, self.headers.get("User-Agent", ""))
            if kind == "reset":  # RST, as a dropped connection arrives
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                self.close_connection = True
                self.connection.close()
                return
            if kind in ("429", "503", "403"):
                code = int(kind)
                message = json.dumps({"error": {"code": code, "message": "injected fault"}})
                self.reply(code, [("Content-Type", "application/json")], message.encode())
                return
            if kind == "stall":
                time.sleep(proxy.stall_s)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            try:
                status, answer, payload = proxy.forward(self.command, self.path, headers, body)
            except OSError:
                self.reply(502, [], b"")
                return
            self.reply(status, answer, payload, head=self.command == "HEAD")

        def reply(self, status: int, headers, payload: bytes, head: bool = False):
            try:
                self.send_response(status)
                for key, value in headers:
                    self.send_header(key, value)
                if not head:  # a HEAD answer keeps the emulator's Content-Length
                    self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if not head:
                    self.wfile.write(payload)
            except (BrokenPipeError, ConnectionResetError):  # the client read what it needed
                self.close_connection = True

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = handle_any

    return Handler
