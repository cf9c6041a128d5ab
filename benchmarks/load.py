"""A bounded load generator for `ruvllm serve`, loopback only (not a test).

    python benchmarks/load.py --package PKG --concurrency 64 --requests 500
    python benchmarks/load.py --url http://127.0.0.1:8080 --model NAME --concurrency 16 --requests 100

Sends exactly --requests streaming chat requests, at most --concurrency at a time, and stops;
prints JSON: throughput, TTFT and end-to-end latency percentiles, inter-token latency, errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from urllib.parse import urlparse

import httpx

TOPICS = "the sea,a lighthouse,winter,a clockmaker,the moon,bread,an old map,a violin".split(",")


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(1000 * s[min(len(s) - 1, int(round(q * (len(s) - 1))))], 1)


async def one(client: httpx.AsyncClient, model: str, i: int, max_tokens: int, stats: dict) -> None:
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0.7, "seed": i,
            "messages": [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]} ({i})."}]}
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                stats["errors"][str(resp.status_code)] = stats["errors"].get(str(resp.status_code), 0) + 1
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    stats["errors"]["stream"] = stats["errors"].get("stream", 0) + 1
                    return
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        stats["itl"].append(now - last)
                    last = now
                    tokens += 1
    except httpx.HTTPError as err:
        stats["errors"][type(err).__name__] = stats["errors"].get(type(err).__name__, 0) + 1
        return
    stats["ttft"].append((first or time.perf_counter()) - t0)
    stats["latency"].append(time.perf_counter() - t0)
    stats["tokens"] += tokens


async def run(url: str, model: str, concurrency: int, requests: int, max_tokens: int, timeout: float) -> dict:
    stats = {"ttft": [], "latency": [], "itl": [], "tokens": 0, "errors": {}}
    limit = asyncio.Semaphore(concurrency)

    async def bounded(i: int) -> None:
        async with limit:
            await one(client, model, i, max_tokens, stats)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=timeout,
                                 limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        await asyncio.gather(*(bounded(i) for i in range(requests)))
    wall = time.perf_counter() - t0
    ok = len(stats["latency"])
    return {"requests": requests, "concurrency": concurrency, "ok": ok, "errors": stats["errors"],
            "wall_s": round(wall, 2), "requests_per_s": round(ok / wall, 2),
            "output_tokens_per_s": round(stats["tokens"] / wall, 1),
            "ttft_ms": {"p50": pct(stats["ttft"], 0.5), "p90": pct(stats["ttft"], 0.9), "p99": pct(stats["ttft"], 0.99)},
            "latency_ms": {"p50": pct(stats["latency"], 0.5), "p90": pct(stats["latency"], 0.9),
                           "p99": pct(stats["latency"], 0.99)},
            "itl_ms": {"p50": pct(stats["itl"], 0.5), "p99": pct(stats["itl"], 0.99)},
            "mean_output_tokens": round(stats["tokens"] / ok, 1) if ok else 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (loopback only)")
    ap.add_argument("--model", default=None, help="model name (default: the server's first)")
    ap.add_argument("--package", default=None, help="start `ruvllm serve PACKAGE` on a free loopback port")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    if args.requests < 1 or args.concurrency < 1 or args.requests > 100_000:
        ap.error("--requests must be 1..100000 and --concurrency >= 1")
    server = None
    url = args.url
    if args.package:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen([sys.executable, "-m", "runtime", "serve", args.package, "--port", str(port),
                                   "--max-concurrent", str(max(args.concurrency, 1)), "--log-level", "warning"],
                                  env={**os.environ, "HF_HUB_OFFLINE": "1"})
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or server.poll() is not None:
                server.kill()
                sys.exit("the server did not start")
            time.sleep(0.2)
    if not url:
        ap.error("give --url or --package")
    host = urlparse(url).hostname or ""
    if not (host == "localhost" or host.startswith("127.") or host == "::1"):
        ap.error("load is only ever sent to loopback (127.0.0.0/8, localhost, ::1)")
    try:
        model = args.model or httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        result = asyncio.run(run(url, model, args.concurrency, args.requests, args.max_tokens, args.timeout))
        result["model"] = model
        print(json.dumps(result, indent=2))
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    if result.get("errors"):
        sys.exit(1)


if __name__ == "__main__":
    main()
