"""Serve an ASGI app (FastAPI) with uvicorn in a background thread of this process.

The socket is bound once, in the constructor (port 0: the OS picks a free port, so there is
no find-a-port-then-close race), and the port is reported. Listeners bind 127.0.0.1 unless
told otherwise; callers that expose anything beyond loopback must require a key. Given a
`TlsFiles` pair (checked by `check_tls_files` first), uvicorn serves https and `url` says so.

    server = BackgroundServer(app, name="gym-head").start()
    print(server.url)          # http://127.0.0.1:PORT
    server.stop()
"""

from __future__ import annotations

import errno
import hashlib
import ipaddress
import json
import logging
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tempering.errors import UserInputError

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class TlsFiles:
    """A server's PEM certificate (chain) and its unencrypted private key."""

    certfile: str
    keyfile: str


def check_tls_files(
    certfile: str | None,
    keyfile: str | None,
    names: tuple[str, str] = ("ssl_certfile", "ssl_keyfile"),
) -> TlsFiles | None:
    """Both files or neither; each exists and is readable; the pair loads as one identity
    (``ssl.SSLContext.load_cert_chain``). Errors name the setting (``names``: the config keys
    or environment variables that gave the two paths), the path and the fix. Returns None
    when neither is set."""
    if certfile is None and keyfile is None:
        return None
    if certfile is None or keyfile is None:
        given, missing = names if keyfile is None else names[::-1]
        raise ValueError(
            f"{given} is set but {missing} is not: TLS needs both the certificate and its "
            "private key (or neither, for no TLS)"
        )
    for name, path in zip(names, (certfile, keyfile), strict=True):
        if not Path(path).is_file():
            raise ValueError(f"{name}={path!r} does not exist or is not a file; point it at "
                             "a PEM file")  # fmt: skip
        if not os.access(path, os.R_OK):
            raise ValueError(f"{name}={path!r} is not readable by this user (uid "
                             f"{os.getuid()}); fix its permissions")  # fmt: skip
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError) as err:
        raise ValueError(
            f"{names[0]}={certfile!r} and {names[1]}={keyfile!r} do not load as a certificate "
            f"and its key ({err}); both must be PEM, the key must be the certificate's own "
            "private key and unencrypted (no passphrase)"
        ) from None
    return TlsFiles(certfile, keyfile)


class ListenAddressError(OSError, UserInputError):
    """A server cannot listen where it was told to (the port taken, the host not this
    machine's); the message names the setting and the fix."""


class BackgroundServer:
    """uvicorn running `app` on `host:port` in a daemon thread (https when given `tls`).
    `config_key` names where a user sets host and port, for the error when they are wrong."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        name: str = "server",
        tls: TlsFiles | None = None,
        config_key: str | None = None,
    ):
        self.app, self.host, self.name, self.tls = app, host, name, tls
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError as err:
            self._socket.close()
            raise _listen_error(err, host, port, config_key or name) from None
        self.port = int(self._socket.getsockname()[1])
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        import uvicorn

        tls = (
            {"ssl_certfile": self.tls.certfile, "ssl_keyfile": self.tls.keyfile} if self.tls else {}
        )
        config = uvicorn.Config(self.app, log_level="warning", access_log=False,
                                timeout_keep_alive=30, **tls)  # fmt: skip
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            name=f"{self.name}-{self.port}",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._socket.close()


class AccessLog:
    """An ASGI wrapper that appends one JSON row per HTTP request to `path` (JSONL, mode 0600).

    Row: ``time`` (unix s, at arrival), ``method``, ``route`` (the path, no query string),
    ``status``, ``prompt_tokens`` / ``completion_tokens`` (from ``scope["state"]["usage"]``,
    which a route sets as ``request.state.usage = (prompt, completion)``; null when unknown),
    ``latency_ms``, ``client`` (host:port) and ``key_sha256``: the first 16 hex digits of the
    sha256 of the presented ``Authorization: Bearer`` key (null without one) -- enough to
    tell keys apart, never the key. A plain ASGI wrapper, not starlette's ``@middleware``
    (which costs task groups and memory streams per request)."""

    def __init__(self, app: Any, path: str | os.PathLike[str]) -> None:
        self.app, self.path = app, Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._file = os.fdopen(fd, "a", encoding="utf-8")
        self._lock = threading.Lock()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        arrived, start = time.time(), time.perf_counter()
        status: list[int] = []

        async def send_and_note(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self._write(scope, arrived, status[0] if status else 500,
                        1000 * (time.perf_counter() - start))  # fmt: skip

    def _write(self, scope: dict[str, Any], arrived: float, status: int, ms: float) -> None:
        usage = (scope.get("state") or {}).get("usage") or (None, None)
        client = scope.get("client")
        row = {
            "time": round(arrived, 3),
            "method": scope.get("method"),
            "route": str(scope.get("path", ""))[:200],
            "status": status,
            "prompt_tokens": usage[0],
            "completion_tokens": usage[1],
            "latency_ms": round(ms, 2),
            "client": f"{client[0]}:{client[1]}" if client else None,
            "key_sha256": key_fingerprint(dict(scope.get("headers") or []).get(b"authorization")),
        }
        line = json.dumps(row) + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def key_fingerprint(authorization: bytes | None) -> str | None:
    """The first 16 hex digits of sha256(key) of an ``Authorization: Bearer <key>`` header
    value (the whole value when it is not of that form); None when no header was sent."""
    if not authorization:
        return None
    key = authorization[7:] if authorization[:7].lower() == b"bearer " else authorization
    return hashlib.sha256(key).hexdigest()[:16]


def _listen_error(err: OSError, host: str, port: int, key: str) -> ListenAddressError:
    if err.errno == errno.EADDRINUSE:
        fix = "another process listens there; choose another port, or 0 for a free one"
        named = ListenAddressError(f"{key}.port={port} on {host!r}: {fix}")
    else:
        named = ListenAddressError(
            f"{key}.host={host!r} (port {port}): cannot listen there ({err.strerror}); use an "
            "address of this machine, 127.0.0.1 (the default) or 0.0.0.0 (every interface)"
        )
    named.errno = err.errno
    return named
