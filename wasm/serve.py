"""A static file server for the bundle with the headers multi-threaded WASM needs.

SharedArrayBuffer (onnxruntime-web's threads) is only available to a cross-origin isolated page:
`Cross-Origin-Opener-Policy: same-origin` and `Cross-Origin-Embedder-Policy: require-corp`. Any
static server works if it sends these two headers (and serves .mjs as JavaScript, .wasm as
application/wasm).
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import threading
from pathlib import Path

ISOLATION = {
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Embedder-Policy": "require-corp",
    "Cross-Origin-Resource-Policy": "same-origin",
}


class Handler(http.server.SimpleHTTPRequestHandler):
    mounts: dict[str, Path] = {}  # URL prefix -> folder, besides the root
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map,
                      ".mjs": "text/javascript", ".js": "text/javascript", ".wasm": "application/wasm",
                      ".json": "application/json", ".whl": "application/zip", ".onnx": "application/octet-stream",
                      ".data": "application/octet-stream", ".zip": "application/zip"}

    def translate_path(self, path: str) -> str:
        for prefix, folder in self.mounts.items():
            if path.startswith(prefix):
                rest = path[len(prefix):].split("?", 1)[0].split("#", 1)[0]
                return str(folder / rest.lstrip("/"))
        return super().translate_path(path)

    def send_head(self):
        """GET with a byte range (`bytes=a-b` or `bytes=a-`): 206 and those bytes, as every static host
        serves them; the page reads a GGUF's header and tensors that way (web/src/gguf_source.js)."""
        wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "").strip())
        path = self.translate_path(self.path)
        if not wanted or os.path.isdir(path):
            return super().send_head()
        try:
            f = open(path, "rb")  # noqa: SIM115 (closed by the server's copy, as SimpleHTTPRequestHandler's is)
        except OSError:
            self.send_error(404, "File not found")
            return None
        size = os.fstat(f.fileno()).st_size
        start, end = int(wanted[1]), min(int(wanted[2]) if wanted[2] else size - 1, size - 1)
        if start >= size or start > end:
            f.close()
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        self.send_response(206)
        self.send_header("Content-Type", self.guess_type(path))
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        f.seek(start)
        return _Span(f, end - start + 1)

    def end_headers(self) -> None:
        self.send_header("Accept-Ranges", "bytes")
        for key, value in ISOLATION.items():
            self.send_header(key, value)
        if self.path.endswith((".html", "/", ".json")):
            self.send_header("Cache-Control", "no-cache")
        super().end_headers()

    def log_message(self, *args) -> None:
        pass


class _Span:
    """The next `left` bytes of an open file, as a file the server copies out."""

    def __init__(self, f, left: int) -> None:
        self.f, self.left = f, left

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        data = self.f.read(n)
        self.left -= len(data)
        return data

    def close(self) -> None:
        self.f.close()


class BundleServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """A page that leaves mid-download (a reload, a closed tab) resets its connection: nothing to report."""
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)


def make_server(root: Path, host: str = "127.0.0.1", port: int = 8000,
                mounts: dict[str, Path] | None = None) -> http.server.ThreadingHTTPServer:
    handler = type("BundleHandler", (Handler,), {"mounts": dict(mounts or {})})
    return BundleServer((host, port), functools.partial(handler, directory=str(root)))


def serve_in_thread(root: Path, mounts: dict[str, Path] | None = None) -> tuple[http.server.ThreadingHTTPServer, str]:
    server = make_server(root, port=0, mounts=mounts)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"
