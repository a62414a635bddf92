"""`PrefixAwareRouter`: Ray Serve's request router for the engine replicas.

Runs in the ingress (inside its `DeploymentHandle`). For each request it returns ranks of
candidates; Ray probes the first rank's queue lengths and takes the least loaded replica that
accepts (queue below `max_ongoing_requests`), else it moves to the next rank:

    1. the key's home: the replica that rendezvous hashing (ray_serve/prefix.py) picks for the
       request's prefix key (the hash of its prompt's first KV blocks), which is where earlier
       requests with that prefix went and left their blocks cached; skipped when it is busy:
       `imbalance` or more requests ahead of the least loaded replica (Ray's cached queue lengths);
    2. power of two choices: the less loaded of two random replicas (Ray's default policy).

Where it runs: in the ingress's handle (`forward.remote`: Ray probes the rank and reserves a slot)
or, under the direct front (ray_serve/direct.py), in the prefix router's handle, which only picks
(`choose_replica(_reserve=False)`: the first replica of the first rank, no probe). A replica's
load is Ray's cached queue length where Ray has one (the ingress's probes and its own requests),
else the replica's own count of the HTTP requests it holds (`ONGOING_STAT`, its
`record_routing_stats`, which the controller fetches every `request_routing_stats_period_s`);
each rank is ordered by load, so a pick-only caller gets the less loaded of the two.

A request without a key (a prompt shorter than one KV block, or a route that has no prompt) goes
straight to 2. A retry names the replica that could not answer it (`avoid_replica`: its engine had
died, ray_serve/replica.py), which is left out of the candidates while there are others. The home is a pure function of the key and the live replicas, so every ingress
replica agrees on it and nothing is stored per prefix; when a replica dies, only its keys move.
Ray's node-locality and model-multiplexing preferences (its mixins) are not used: one model, and
where a prefix's blocks are cached matters more than which node a replica is on.
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from llmserve.ray_serve.prefix import rendezvous_order

PREFIX_KEY = "prefix_key"
"""The keyword argument of `EngineReplica.forward` that carries the routing key."""
AVOID_REPLICA = "avoid_replica"
"""The keyword argument that names a replica a retry must not go to (its id)."""
ONGOING_STAT = "ongoing_requests"
"""A replica's routing stats entry: the HTTP requests it holds (direct.py's `DirectEngineReplica`)."""


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 4) -> None:
        """`imbalance`: how many more ongoing requests than the least loaded replica make a
        prefix's home busy (its request then goes by load alone)."""
        if imbalance < 1:
            raise ValueError(f"imbalance must be >= 1, not {imbalance}")
        self.imbalance = imbalance

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        if (avoid := kwargs.get(AVOID_REPLICA)) is not None:
            others = [r for r in candidate_replicas if r.replica_id.unique_id != avoid]
            candidate_replicas = others or candidate_replicas
        if not candidate_replicas:
            return []
        ranks = []
        key = kwargs.get(PREFIX_KEY)
        if key is not None:
            home = self._home(key, candidate_replicas)
            if not self._busy(home, candidate_replicas):
                ranks.append([home])
        two = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        ranks.append(sorted(two, key=self._load))
        return ranks

    @staticmethod
    def _home(key: int, replicas: list[RunningReplica]) -> RunningReplica:
        by_id = {r.replica_id.unique_id: r for r in replicas}
        return by_id[rendezvous_order(key, list(by_id))[0]]

    def _busy(self, home: RunningReplica, replicas: list[RunningReplica]) -> bool:
        """`imbalance` or more ongoing requests ahead of the least loaded replica (unknown loads
        count as idle: Ray's probe of the rank, where it probes, then gives the real ones)."""
        lengths = {r.replica_id: self._load(r) for r in replicas}
        return lengths[home.replica_id] - min(lengths.values()) >= self.imbalance

    def _load(self, replica: RunningReplica) -> int:
        """Ray's cached queue length, else the replica's own count (0 when neither is known)."""
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        return cached if cached is not None else int(replica.routing_stats.get(ONGOING_STAT, 0))
