"""Serve an ASGI app (FastAPI) with uvicorn in a background thread of this process.

The socket is bound once, in the constructor (port 0: the OS picks a free port, so there is
no find-a-port-then-close race), and the port is reported. Listeners bind 127.0.0.1 unless
told otherwise; callers that expose anything beyond loopback must require a key.

    server = BackgroundServer(app, name="gym-head").start()
    print(server.url)          # http://127.0.0.1:PORT
    server.stop()
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class BackgroundServer:
    """uvicorn running `app` on `host:port` in a daemon thread."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, name: str = "server"):
        self.app, self.host, self.name = app, host, name
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.port = int(self._socket.getsockname()[1])
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        import uvicorn

        config = uvicorn.Config(self.app, log_level="warning", access_log=False,
                                timeout_keep_alive=30)  # fmt: skip
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
