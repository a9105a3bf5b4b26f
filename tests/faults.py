"""A TCP proxy a test owns, in front of PostgreSQL or the broker, that it can cut and restore.

`cut()` closes every connection through the proxy and refuses new ones (each is accepted and closed at once, as a
server that is going down does), which is what a restart or a network outage looks like to the clients; `restore()`
lets connections through again. The machine's services are never touched, so sessions side by side are unaffected.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit


class TcpProxy:
    """Forwards 127.0.0.1:<port> (a free port) to `target`; one thread per connection, both directions in it."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._server.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut = False
        self._closed = False
        self.accepted = 0
        self.refused = 0
        self._thread = threading.Thread(target=self._accept_loop, name=f"proxy-{self.port}", daemon=True)
        self._thread.start()

    @classmethod
    def for_url(cls, url: str, default_port: int) -> TcpProxy:
        parts = urlsplit(url)
        return cls(parts.hostname or "127.0.0.1", parts.port or default_port)

    def url(self, url: str) -> str:
        """`url` with its host and port replaced by the proxy's."""
        parts = urlsplit(url)
        userinfo = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
        return urlunsplit(parts._replace(netloc=f"{userinfo}127.0.0.1:{self.port}"))

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._open) // 2

    def cut(self) -> None:
        """Close every connection through the proxy and refuse new ones until `restore`."""
        with self._lock:
            self._cut = True
            sockets, self._open = list(self._open), set()
        for sock in sockets:
            _close(sock)

    def restore(self) -> None:
        with self._lock:
            self._cut = False

    def close(self) -> None:
        self._closed = True
        self.cut()
        _close(self._server)
        self._thread.join(5)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                refuse = self._cut
            if refuse:
                self.refused += 1
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                if self._cut:  # cut while connecting
                    _close(client)
                    _close(upstream)
                    continue
                self._open.update((client, upstream))
                self.accepted += 1
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        try:
            while True:
                readable, _, _ = select.select([a, b], [], [], 1.0)
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    peers[sock].sendall(data)
        except (OSError, ValueError):  # closed by `cut` (a closed socket's fileno is -1: ValueError in select)
            return
        finally:
            with self._lock:
                self._open.discard(a)
                self._open.discard(b)
            _close(a)
            _close(b)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


@contextlib.contextmanager
def proxy_for(url: str, default_port: int) -> Iterator[TcpProxy]:
    proxy = TcpProxy.for_url(url, default_port)
    try:
        yield proxy
    finally:
        proxy.close()


def release_producer_app(app: Any) -> None:
    """Let a test's own producer app go without closing what other apps share.

    kombu keeps broker connection pools in a process-wide registry keyed by broker URL: two apps on the same
    broker share one pool, and `app.pool.force_close_all()` closes it for every one of them ("Acquire on closed
    pool" in every later test that publishes to that broker). Stale connections need no closing: redis-py
    reconnects on its own, and celery_fanin.broker.publish replaces an AMQP connection the broker closed.
    """
    from celery_fanin import FanIn

    found = FanIn.find(app)
    if found is not None:
        found.dispose()
    app.close()
