"""Discrete-event model of N engine replicas behind a router, on a multi-tenant trace.

Each tenant has its own system prompt (shared by all its requests); tenants' popularity is Zipf.
A replica keeps a prefix cache of blocks (an LRU, as RuvLLM's pool parks released cached blocks)
and prefills one request at a time (tokens not in its cache, at a fixed rate); decoding overlaps.
Routers: random, power of two choices on queue length (Ray Serve's default), and RuvLLM's
prefix-aware scoring (`runtime.serve.scaleout.routing.PrefixAffinity`, the code the Ray router runs)
with power of two choices as its fallback. Prints prefix hit rate and TTFT per router as N grows.

    python benchmarks/routing_sim.py --replicas 1,2,4,8,16,32,64
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.serve.scaleout.routing import PrefixAffinity  # noqa: E402


@dataclass
class Trace:
    arrival: list[float]
    tenant: list[int]
    system_blocks: list[int]  # the tenant's shared blocks (its system prompt's full blocks)
    own_blocks: list[int]  # the request's own blocks (the user's turn)
    output_tokens: list[int]


def make_trace(n_requests: int, tenants: int, rate: float, block: int, rng: random.Random) -> Trace:
    weights = [1 / (k + 1) ** 1.1 for k in range(tenants)]
    system = [rng.randint(500, 4000) // block for _ in range(tenants)]
    t, arrival, tenant, own, out = 0.0, [], [], [], []
    for _ in range(n_requests):
        t += rng.expovariate(rate)
        arrival.append(t)
        tenant.append(rng.choices(range(tenants), weights)[0])
        own.append(rng.randint(50, 400) // block + 1)
        out.append(rng.randint(50, 300))
    return Trace(arrival, tenant, [system[k] for k in tenant], own, out)


class Replica:
    def __init__(self, capacity: int) -> None:
        self.cache: OrderedDict = OrderedDict()
        self.capacity = capacity
        self.prefill_free = 0.0
        self.done: list[float] = []  # finish times of requests it holds

    def queue(self, now: float) -> int:
        while self.done and self.done[0] <= now:
            heapq.heappop(self.done)
        return len(self.done)

    def serve(self, keys: list, now: float, prefill_rate: float, overhead: float, decode_s: float,
              block: int) -> tuple[float, int]:
        """(TTFT, blocks found cached) of a request routed here now."""
        hit = 0
        for k in keys:
            if k not in self.cache:
                break
            hit += 1
        for k in keys:
            self.cache[k] = None
            self.cache.move_to_end(k)
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)
        start = max(now, self.prefill_free)
        end = start + overhead + (len(keys) - hit) * block / prefill_rate
        self.prefill_free = end
        heapq.heappush(self.done, end + decode_s)
        return end - now, hit


def simulate(trace: Trace, n: int, policy: str, args, rng: random.Random) -> dict:
    replicas = [Replica(args.cache_blocks) for _ in range(n)]
    affinity = PrefixAffinity(args.cache_blocks, args.imbalance)
    ttfts, hit_blocks, total_blocks = [], 0, 0
    for i, now in enumerate(trace.arrival):
        t = trace.tenant[i]
        keys = [("s", t, b) for b in range(trace.system_blocks[i])] + [("u", i, b) for b in range(trace.own_blocks[i])]
        queues = {r: replicas[r].queue(now) for r in range(n)}
        choice = None
        if policy == "prefix":
            ranked = affinity.choose(range(n), keys[:args.route_blocks], queues)
            choice = ranked[0] if ranked else None
        if choice is None:
            if policy == "random" or n == 1:
                choice = rng.randrange(n)
            else:  # power of two choices
                a, b = rng.sample(range(n), 2)
                choice = a if queues[a] <= queues[b] else b
        if policy == "prefix":
            affinity.record(choice, keys[:args.route_blocks])
        ttft, hit = replicas[choice].serve(keys, now, args.prefill_rate, args.overhead,
                                           trace.output_tokens[i] * args.decode_step, args.block)
        ttfts.append(ttft)
        hit_blocks += hit
        total_blocks += len(keys)
    ttfts.sort()
    return {"replicas": n, "policy": policy, "hit_rate": round(hit_blocks / total_blocks, 3),
            "ttft_mean_ms": round(1000 * sum(ttfts) / len(ttfts), 1),
            "ttft_p95_ms": round(1000 * ttfts[int(0.95 * (len(ttfts) - 1))], 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", default="1,2,4,8,16,32,64")
    ap.add_argument("--requests-per-replica", type=int, default=300)
    ap.add_argument("--tenants-per-replica", type=int, default=8)
    ap.add_argument("--rate-per-replica", type=float, default=4.0, help="requests per second per replica")
    ap.add_argument("--prefill-rate", type=float, default=10_000, help="prefill tokens per second per replica")
    ap.add_argument("--overhead", type=float, default=0.01, help="seconds per request before its first token")
    ap.add_argument("--decode-step", type=float, default=0.03, help="seconds per generated token")
    ap.add_argument("--cache-blocks", type=int, default=8192, help="prefix-cache blocks per replica")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--imbalance", type=int, default=8)
    ap.add_argument("--route-blocks", type=int, default=32, help="leading blocks the router hashes (as the ingress)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for n in (int(x) for x in args.replicas.split(",")):
        trace = make_trace(args.requests_per_replica * n, args.tenants_per_replica * n, args.rate_per_replica * n,
                           args.block, random.Random(args.seed))
        for policy in ("random", "pow2", "prefix"):
            rows.append(simulate(trace, n, policy, args, random.Random(args.seed + 1)))
    if args.json:
        print(json.dumps(rows))
        return 0
    print("| replicas | router | prefix hit rate | TTFT mean (ms) | TTFT p95 (ms) |")
    print("|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['replicas']} | {r['policy']} | {r['hit_rate']:.3f} | {r['ttft_mean_ms']} | {r['ttft_p95_ms']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
