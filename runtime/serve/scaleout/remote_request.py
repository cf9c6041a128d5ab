"""What the ingress sends a replica: a request already tokenized, with its routing keys."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.core.sampling import SamplingParams


@dataclass
class RemoteRequest:
    ids: list[int]
    params: SamplingParams
    adapter: str | None = None  # the name requests use; the replica loads it on first use
    adapter_path: str | None = None
    adapter_id: str | None = None  # its content digest: the replica checks it loaded the same weights
    prefix_keys: list[bytes] = field(default_factory=list)  # read by the router (routing.prompt_block_keys)
