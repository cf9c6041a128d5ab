"""README.md's native examples, run as a newcomer would type them (its page example: tests/web)."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import ROOT, readme_block, run_cli

pytestmark = pytest.mark.slow


def commands() -> list[list[str]]:
    """The native block's `ruvllm ...` lines, without their comments."""
    lines = [shlex.split(line, comments=True) for line in readme_block("native").splitlines()]
    assert all(words[0] == "ruvllm" for words in lines if words)
    return [words[1:] for words in lines if words]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_native_commands_and_the_openai_example(smol_cache, smol_gguf, tmp_path):
    from tests.exporter.test_streamed_export import write_mixed_gguf

    env = {"RUVLLM_CACHE_DIR": str(smol_cache)}
    served = None
    for args in commands():
        if args[0] == "generate" and args[1].endswith(".gguf"):  # a GGUF of the reader's own: a tiny one here
            gguf = tmp_path / "model.Q4_K_M.gguf"
            write_mixed_gguf(gguf, smol_gguf)
            proc = run_cli("generate", str(gguf), *args[2:], "--max-tokens", "8",
                           env={"RUVLLM_CACHE_DIR": str(tmp_path / "cache")})
        elif args[0] == "generate":
            proc = run_cli(*args, env=env)
        elif args[0] == "chat":
            proc = subprocess.run([sys.executable, "-m", "runtime", *args], input="Hi!\n/quit\n", capture_output=True,
                                  text=True, env={**os.environ, **env}, timeout=300, cwd=str(ROOT))
        else:
            assert args == ["serve"], args
            served = args
            continue
        assert proc.returncode == 0 and proc.stdout.strip(), (args, proc.stderr[-2000:])
    assert served, "the README shows `ruvllm serve`"
    port = free_port()  # 8080 as the README says, unless something here holds it
    server = subprocess.Popen([sys.executable, "-m", "runtime", *served, "--port", str(port)], cwd=str(ROOT),
                              env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                assert server.poll() is None, server.stderr.read()[-2000:]
                time.sleep(0.2)
        code = readme_block("openai").replace("127.0.0.1:8080", f"127.0.0.1:{port}")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=str(ROOT))
        assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-2000:]
    finally:
        server.terminate()
        server.wait(30)


def test_the_python_example(smol_cache):
    proc = subprocess.run([sys.executable, "-c", readme_block("python")], capture_output=True, text=True,
                          timeout=300, cwd=str(ROOT), env={**os.environ, "RUVLLM_CACHE_DIR": str(smol_cache)})
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-2000:]
