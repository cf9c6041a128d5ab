"""What one oversized request costs `ruvllm serve` and everyone else on it (not a test; loopback only).

    python benchmarks/abuse.py --package PKG        # starts `ruvllm serve PKG` on a free loopback port

Sends the requests of the "one request must not stall the server" issue: a 100 MB body (declared and
chunked), a 20 MB chat message, a prompt of ten contexts in 5 MB, and a small chat request's latency
alone and while another process sends 4 MB (or 600 KB, tokenized) prompts without pause. Prints JSON:
status, seconds, and the server's peak RSS growth per oversized request (reset through
/proc/PID/clear_refs), latencies as medians in ms.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

MB = 1 << 20
WORDS = "apple river stone cloud seven orange music window paper tiger light north garden silver bridge summer".split()
HAMMER = """
import sys, httpx
url, body = sys.argv[1], open(sys.argv[2], "rb").read()
with httpx.Client(timeout=120) as client:
    for i in range(10 ** 9):
        r = client.post(url + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        if i == 0:
            print(r.status_code, flush=True)
"""


def words(n_bytes: int) -> str:
    rng = random.Random(1)
    return " ".join(rng.choice(WORDS) for _ in range(n_bytes // 5))[:n_bytes]


class Server:
    def __init__(self, package: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", package, "--port", str(port),
                                      "--log-level", "warning"], env={**os.environ, "HF_HUB_OFFLINE": "1"})
        deadline = time.time() + 180
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.time() > deadline or self.proc.poll() is not None:
                self.proc.kill()
                sys.exit("the server did not start")
            time.sleep(0.2)

    def peak_reset(self) -> int:
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")
        return self.peak()

    def peak(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
        return 0


def timed(server: Server, path: str, **kw) -> dict:
    before = server.peak_reset()
    t0 = time.perf_counter()
    r = httpx.post(server.url + path, timeout=600, **kw)
    out = {"status": r.status_code, "seconds": round(time.perf_counter() - t0, 3),
           "rss_growth_mb": round((server.peak() - before) / MB, 1)}
    if r.status_code >= 400:
        out["code"] = r.json()["error"]["code"]
    return out


def small_latency(url: str, model: str, n: int = 9) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    times = []
    with httpx.Client(base_url=url, timeout=120) as client:
        client.post("/v1/chat/completions", json=body)
        for _ in range(n):
            t0 = time.perf_counter()
            client.post("/v1/chat/completions", json=body).raise_for_status()
            times.append(time.perf_counter() - t0)
    return round(1000 * statistics.median(times), 1)


def while_hammered(server: Server, model: str, text: str) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": model, "messages": [{"role": "user", "content": text}]}, f)
    hammer = subprocess.Popen([sys.executable, "-c", HAMMER, server.url, f.name], stdout=subprocess.PIPE, text=True)
    try:
        hammer.stdout.readline()
        return small_latency(server.url, model)
    finally:
        hammer.kill()
        hammer.wait()
        os.unlink(f.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--package", required=True, help="the package (or alias) `ruvllm serve` runs")
    args = ap.parse_args()
    server = Server(args.package)
    try:
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        chunk = b"x" * MB
        ctype = {"Content-Type": "application/json"}
        result = {
            "body_100mb_declared": timed(server, "/v1/chat/completions", content=iter([chunk] * 100),
                                         headers={**ctype, "Content-Length": str(100 * MB)}),
            "body_100mb_chunked": timed(server, "/v1/chat/completions", content=iter([chunk] * 100), headers=ctype),
            "chat_20mb": timed(server, "/v1/chat/completions",
                               json={"model": model, "messages": [{"role": "user", "content": words(20 * MB)}]}),
            "chat_10_contexts_5mb": timed(server, "/v1/chat/completions",
                                          json={"model": model, "messages": [{"role": "user", "content": words(5 * MB)}]}),
            "chat_600kb_tokenized": timed(server, "/v1/chat/completions",
                                          json={"model": model, "messages": [{"role": "user", "content": words(600_000)}]}),
            "small_ms_alone": small_latency(server.url, model),
            "small_ms_while_4mb_prompts_refused": while_hammered(server, model, words(4 * MB)),
            "small_ms_while_600kb_prompts_refused": while_hammered(server, model, words(600_000)),
            "model": model,
        }
        print(json.dumps(result, indent=2))
    finally:
        server.proc.terminate()
        server.proc.wait(timeout=60)


if __name__ == "__main__":
    main()
