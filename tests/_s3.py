"""A real S3 API on loopback for the remote tests: moto's server in a thread, s3fs as the client.

:func:`start` starts ``moto.server.ThreadedMotoServer`` on a free port of 127.0.0.1, creates one bucket and
returns an :class:`S3` with the ``storage_options`` that point s3fs at it (dummy credentials). The ``s3`` fixture of ``tests/conftest.py`` starts one per test session and skips the tests that ask
for it when moto or s3fs is missing. :class:`DroppingProxy` stands between s3fs and the server to cut an
upload off in the middle (the interrupted-upload fault test).
"""

from __future__ import annotations

import socket
import struct
import threading
import uuid
from dataclasses import dataclass, field

from fastckpt.bench.s3 import start_server, storage_options

BUCKET = "fastckpt-tests"


@dataclass
class S3:
    endpoint_url: str
    bucket: str = BUCKET
    server: object = field(default=None, repr=False)

    @property
    def storage_options(self) -> dict:
        """What fastckpt's remote calls take as ``storage_options`` to reach this server."""
        return options_for(self.endpoint_url)

    def url(self, *parts: str) -> str:
        """A fresh key prefix of the bucket (``s3://bucket/<uuid>/<parts>``), so tests never share keys."""
        return "/".join([f"s3://{self.bucket}", uuid.uuid4().hex[:12], *parts])

    def filesystem(self):
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)


def options_for(endpoint_url: str) -> dict:
    return storage_options(endpoint_url)


def start() -> S3:
    """Start the server on a free loopback port, create the bucket; the caller stops ``result.server``."""
    server, endpoint = start_server(BUCKET)
    return S3(endpoint, server=server)


class DroppingProxy:
    """A TCP proxy on loopback in front of ``target`` (host, port) that resets every connection once
    ``drop_after`` bytes from the client have passed through it in all (None: never); the byte count is shared by
    every connection, so it cuts off whatever upload is under way when the budget runs out."""

    def __init__(self, target: tuple[str, int], drop_after: int | None = None):
        self.target = target
        self.drop_after = drop_after
        self.forwarded = 0
        self.dropped = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self.endpoint_url = "http://127.0.0.1:%d" % self._listener.getsockname()[1]
        self._accept = threading.Thread(target=self._serve, daemon=True)
        self._accept.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except (socket.timeout, OSError):
                continue
            upstream = socket.create_connection(self.target)
            self._sockets += [client, upstream]
            for source, sink, counted in ((client, upstream, True), (upstream, client, False)):
                t = threading.Thread(target=self._pipe, args=(source, sink, counted, (client, upstream)), daemon=True)
                t.start()
                self._threads.append(t)

    def _pipe(self, source, sink, counted, both) -> None:
        try:
            while True:
                data = source.recv(1 << 16)
                if not data:
                    break
                if counted:
                    with self._lock:
                        cut = self.drop_after is not None and self.forwarded + len(data) > self.drop_after
                        if not cut:
                            self.forwarded += len(data)
                    if cut:
                        self.dropped += 1
                        client, upstream = both
                        upstream.shutdown(socket.SHUT_RDWR)  # wakes the other pipe, waiting in recv on it
                        # RST, not FIN: the client sees its connection reset in the middle of the request.
                        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        client.close()
                        return
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in both:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._accept.join(timeout=5)
        self._listener.close()
        for s in self._sockets:  # idle keep-alive connections: their pipes are waiting in recv
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=5)
        for s in self._sockets:
            s.close()
