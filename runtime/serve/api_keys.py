"""API keys with names: who a request is, checked in constant time.

A key's name is the request's identity: its metrics label and its concurrency quota. It comes
from the key alone, never from the request's body (OpenAI's `user` field is whatever the client
writes): a request cannot act as another key's user.

Keys are kept as SHA-256 digests only, and a presented key is hashed and compared with every
digest by `hmac.compare_digest`, with no early exit: the time taken says nothing about how much
of a key was right, nor which key matched.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import RuvLLMError

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
ANONYMOUS = "anonymous"  # the identity of every request on a server without keys
KEY_FILE_HELP = ('a JSON file {"keys": [{"name": "alice", "key": "sk-...", "max_concurrent": 4}, '
                 '{"name": "bob", "sha256": "<hex digest of the key>"}]}')


@dataclass(frozen=True)
class ApiKey:
    name: str
    digest: bytes  # SHA-256 of the secret
    max_concurrent: int | None = None  # requests in flight at once; more get a 429


def digest(secret: str | bytes) -> bytes:
    return hashlib.sha256(secret.encode("utf-8") if isinstance(secret, str) else secret).digest()


class ApiKeys:
    def __init__(self, keys: list[ApiKey]) -> None:
        names = [k.name for k in keys]
        if len(set(names)) != len(names):
            raise RuvLLMError("API key names must be unique")
        if len({k.digest for k in keys}) != len(keys):
            raise RuvLLMError("two API keys have the same secret")
        self.keys = list(keys)

    def __bool__(self) -> bool:
        return bool(self.keys)

    @classmethod
    def load(cls, secret: str | None = None, path: str | None = None) -> ApiKeys:
        """`--api-key` (one key, named "default") and/or `--api-key-file`."""
        keys = [ApiKey("default", digest(secret))] if secret else []
        if path:
            keys += read_key_file(path)
        return cls(keys)

    def identify(self, authorization: bytes | None) -> ApiKey | None:
        """The key an `Authorization: Bearer ...` header carries, or None."""
        scheme, _, token = (authorization or b"").strip().partition(b" ")
        presented = digest(token.strip()) if scheme.lower() == b"bearer" else digest(b"\0not a key")
        found = None
        for key in self.keys:  # every digest is compared, matched or not
            if hmac.compare_digest(presented, key.digest):
                found = key
        return found


def read_key_file(path: str) -> list[ApiKey]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise RuvLLMError(f"--api-key-file {path}: cannot read it ({err}); expected {KEY_FILE_HELP}") from None
    entries = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise RuvLLMError(f"--api-key-file {path}: expected {KEY_FILE_HELP}")
    keys = []
    for i, entry in enumerate(entries):
        where = f"--api-key-file {path}: keys[{i}]"
        if not isinstance(entry, dict) or set(entry) - {"name", "key", "sha256", "max_concurrent"}:
            raise RuvLLMError(f"{where}: expected an object with name, key or sha256, and max_concurrent")
        name = entry.get("name")
        if not isinstance(name, str) or not NAME.match(name) or name == ANONYMOUS:
            raise RuvLLMError(f"{where}: 'name' must be 1-64 letters, digits, '.', '_' or '-' (not {ANONYMOUS!r})")
        if ("key" in entry) == ("sha256" in entry):
            raise RuvLLMError(f"{where}: give exactly one of 'key' (the secret) and 'sha256' (its digest)")
        if "key" in entry:
            if not isinstance(entry["key"], str) or len(entry["key"]) < 8:
                raise RuvLLMError(f"{where}: 'key' must be a string of at least 8 characters")
            secret_digest = digest(entry["key"])
        else:
            try:
                secret_digest = bytes.fromhex(entry["sha256"])
            except (TypeError, ValueError):
                secret_digest = b""
            if len(secret_digest) != 32:
                raise RuvLLMError(f"{where}: 'sha256' must be 64 hex digits")
        limit = entry.get("max_concurrent")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise RuvLLMError(f"{where}: 'max_concurrent' must be a positive integer")
        keys.append(ApiKey(name, secret_digest, limit))
    return keys


LOOPBACK = ("127.0.0.1", "::1", "localhost")


def access_warnings(host: str, keys: ApiKeys | None, lora_roots: list[str] | None) -> list[str]:
    """What the operator should hear at start-up: a server others can reach that asks for no key."""
    if host in LOOPBACK or host.startswith("127.") or keys:
        return []
    also = ", and load adapters from the --lora-root folders" if lora_roots is not None else ""
    return [f"serving on {host} with no API key: anyone who can reach this port can use it{also} "
            "(--api-key or --api-key-file)"]
