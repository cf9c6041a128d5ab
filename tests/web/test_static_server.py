"""The bundle's static server: a page that leaves mid-download costs nothing and prints nothing."""

from __future__ import annotations

import socket
import struct
import time
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
