"""Fixtures for the data tests: a real HTTP server on 127.0.0.1 that serves a temporary folder."""

from __future__ import annotations

import collections
import functools
import threading
import time
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest


@dataclass
class FileServer:
    root: Path
    url: str = ""
    delay_s: float = 0.0
    """Seconds each GET sleeps before answering (to widen race windows)."""
    gets: collections.Counter = field(default_factory=collections.Counter)
    """GET requests seen, by URL path."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, name: str) -> int:
        with self.lock:
            return sum(n for path, n in self.gets.items() if path.rsplit("/", 1)[-1] == name)

    def total(self) -> int:
        with self.lock:
            return sum(self.gets.values())


class _Handler(SimpleHTTPRequestHandler):
    state: FileServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        with self.state.lock:
            self.state.gets[self.path] += 1
        if self.state.delay_s:
            time.sleep(self.state.delay_s)
        super().do_GET()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's signature
        pass


@pytest.fixture
def file_server(tmp_path: Path):
    """Serves tmp_path/'srv' at file_server.url (ending in /); counts every GET."""
    root = tmp_path / "srv"
    root.mkdir()
    state = FileServer(root)
    handler = type("Handler", (_Handler,), {"state": state})
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}/"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
