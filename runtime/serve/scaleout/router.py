"""Ray Serve's request-router extension point with RuvLLM's prefix scoring (`routing.PrefixAffinity`).

Ray Serve keeps replicas, queue lengths, probing, backoff and locality; this class only ranks. The
router lives in the process that owns the deployment handle (the ingress replica), so each ingress
replica keeps its own model of where prefixes went.
"""

from __future__ import annotations

import random

from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from runtime.serve.scaleout import routing


def _prefix_keys(pending_request: PendingRequest | None) -> list[bytes]:
    if pending_request is None:
        return []
    for arg in list(pending_request.args) + list(pending_request.kwargs.values()):
        keys = getattr(arg, "prefix_keys", None)
        if keys is not None:
            return keys
    return []


class PrefixAwareRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """First rank: the replica holding the longest cached prefix of the prompt (unless its queue is
    `imbalance` longer than the shortest); then power of two choices, whose winner a new prefix is
    recorded on at once."""

    def initialize_state(self, imbalance: int = 8, capacity_blocks: int = 1 << 16) -> None:
        self.affinity = routing.PrefixAffinity(capacity_blocks, imbalance)
        # Ray Serve pickles this module by value into the handle's process: shared state goes through
        # `routing`, which is imported by reference there
        routing.LIVE_ROUTERS[self._deployment_id.name] = self

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        keys = _prefix_keys(pending_request)
        cache = self.replica_queue_len_cache
        queues = {rid: cache.get(rid) for rid in by_id}
        preferred = self.affinity.choose(list(by_id), keys, queues)
        pair = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        if preferred:
            return [[by_id[preferred[0]]], pair]
        # power of two choices, decided here so that the choice is recorded at once: requests of one new
        # prefix routed concurrently (a burst) then follow the first instead of spreading before any of
        # them is routed. If Ray Serve finds the winner full, on_request_routed records where it went.
        pair.sort(key=lambda r: queues.get(r.replica_id) or 0)
        if keys:
            self.affinity.record(pair[0].replica_id, keys)
        return [[r] for r in pair]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        keys = _prefix_keys(pending_request)
        if keys:
            self.affinity.record(replica_id, keys)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for gone in [r for r in self.affinity.replicas() if r not in live]:
            self.affinity.forget(gone)

    def replica_stats(self) -> list[dict]:
        """Each replica's engine stats, as its `record_routing_stats` last reported them."""
        return [dict(r.routing_stats or {}) for r in self._replicas.values()]
