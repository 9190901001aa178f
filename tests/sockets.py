"""Network stand-ins for outages: a gate in front of a real Postgres that can be shut (every
connection cut, the port closed) and opened again, and a server that hangs up on everyone."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from sqlalchemy.engine import make_url

from eaglegen.stack import free_port

_ACCEPT_POLL_S = 0.1


class TcpGate:
    """A loopback TCP port forwarding to a real service. Shut, it cuts every connection and
    its port is closed (a connection is refused, as from a database host that went away);
    opened again, it forwards new connections on the same port."""

    def __init__(self, family: socket.AddressFamily, address: Any) -> None:
        self.port = free_port()
        self._family = family
        self._address = address
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None

    @classmethod
    def to_database(cls, database_url: str) -> TcpGate:
        """A gate to the Postgres of ``database_url`` (TCP, or the Unix socket of an
        embedded one)."""
        url = make_url(database_url)
        port = url.port or 5432
        folder = url.query.get("host")
        if url.host is None and isinstance(folder, str):
            return cls(socket.AF_UNIX, f"{folder}/.s.PGSQL.{port}")
        return cls(socket.AF_INET, (url.host or "127.0.0.1", port))

    def database_url(self, database_url: str) -> str:
        """``database_url`` through this gate."""
        url = make_url(database_url).set(host="127.0.0.1", port=self.port)
        return url.difference_update_query(["host"]).render_as_string(hide_password=False)

    def open(self) -> None:
        """Listen and forward."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(_ACCEPT_POLL_S)
        with self._lock:
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def shut(self) -> None:
        """Close the port and cut every connection through it."""
        with self._lock:
            listener, self._listener = self._listener, None
            sockets, self._sockets = self._sockets, set()
        if listener is not None:
            listener.close()
        for each in sockets:
            _cut(each)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except TimeoutError:
                if self._listener is not listener:
                    return
                continue
            except OSError:
                return
            client.settimeout(None)
            upstream = socket.socket(self._family, socket.SOCK_STREAM)
            try:
                upstream.connect(self._address)
            except OSError:
                _cut(client)
                upstream.close()
                continue
            with self._lock:
                if self._listener is not listener:  # shut meanwhile
                    _cut(client)
                    _cut(upstream)
                    return
                self._sockets.update((client, upstream))
            for source, target in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(source, target), daemon=True).start()


def _pump(source: socket.socket, target: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            target.sendall(data)
    except OSError:
        return
    finally:
        _cut(source)
        _cut(target)


def _cut(sock: socket.socket) -> None:
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


@contextmanager
def database_gate(database_url: str) -> Iterator[TcpGate]:
    """An open gate to the Postgres of ``database_url``, shut at the end."""
    gate = TcpGate.to_database(database_url)
    gate.open()
    try:
        yield gate
    finally:
        gate.shut()


class HangUpServer:
    """A loopback port that accepts every connection and closes it at once, counting them:
    a server that is down, whose callers can be counted."""

    def __init__(self) -> None:
        self.port = free_port()
        self.connections = 0
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", self.port))
        self._listener.listen(64)
        self._listener.settimeout(_ACCEPT_POLL_S)
        self._running = True
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        """Its base URL."""
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> HangUpServer:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._running = False
        self._thread.join(timeout=5)
        self._listener.close()

    def _serve(self) -> None:
        while self._running:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            _cut(client)
