"""The bundle's static server: a page that leaves mid-download costs nothing and prints nothing."""

from __future__ import annotations

import socket
import struct
import time
import urllib.error
import urllib.request

from wasm.serve import serve_in_thread


def test_a_client_reset_mid_download_is_not_an_error(tmp_path, capsys):
    (tmp_path / "big.bin").write_bytes(b"x" * (64 << 20))
    (tmp_path / "small.txt").write_text("ok")
    server, url = serve_in_thread(tmp_path)
    try:
        s = socket.create_connection(server.server_address)
        s.sendall(b"GET /big.bin HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        s.recv(1000)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        s.close()
        time.sleep(0.5)
        assert urllib.request.urlopen(url + "small.txt", timeout=10).read() == b"ok"
    finally:
        server.shutdown()
    assert "ConnectionResetError" not in capsys.readouterr().err


def test_byte_ranges_are_served_as_static_hosts_serve_them(tmp_path):
    """A GGUF's header and tensors are read in ranges (web/src/gguf_source.js): 206 and exactly those bytes,
    an open end to the file's end, 416 past it, the whole file without a Range."""
    data = bytes(range(256)) * 40
    (tmp_path / "m.gguf").write_bytes(data)
    server, url = serve_in_thread(tmp_path)
    try:
        def get(rng: str | None):
            req = urllib.request.Request(url + "m.gguf", headers={"Range": rng} if rng else {})
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return r.status, r.headers.get("Content-Range"), r.read()
            except urllib.error.HTTPError as err:
                return err.code, err.headers.get("Content-Range"), b""

        assert get("bytes=10-19") == (206, f"bytes 10-19/{len(data)}", data[10:20])
        assert get("bytes=10000-") == (206, f"bytes 10000-{len(data) - 1}/{len(data)}", data[10000:])
        assert get(f"bytes={len(data)}-") == (416, f"bytes */{len(data)}", b"")
        assert get(None) == (200, None, data)
    finally:
        server.shutdown()
