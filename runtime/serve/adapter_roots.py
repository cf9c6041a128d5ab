"""Where `POST /v1/load_lora_adapter` may read adapters from: folders the operator named, nothing else.

Loading at run time is off unless asked for (as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING), and when
on, a path is followed to its real location (symlinks and `..` resolved) and must lie under one of
the roots. A path outside them, a path that does not exist and a folder that is no adapter all get
the same answer, which differs only by the path the client sent: the endpoint tells nothing about
the server's disk. Only an adapter folder inside the roots gets the engine's detailed checks.
"""

from __future__ import annotations

import os
from pathlib import Path

from runtime.core.adapters import OWN_MANIFEST, PEFT_CONFIG
from runtime.errors import RuvLLMError

ENV_ALLOW = "RUVLLM_ALLOW_RUNTIME_LORA_UPDATING"


class AdapterNotFound(Exception):
    """The one answer for every path the server will not load from."""

    def __init__(self, path: str) -> None:
        super().__init__(f"no LoRA adapter at {path!r} in the server's adapter folders")


class AdapterRoots:
    def __init__(self, roots: list[str]) -> None:
        if not roots:
            raise RuvLLMError("loading LoRA adapters at run time needs at least one --lora-root: the folders "
                              "adapters may be loaded from")
        resolved = []
        for root in roots:
            real = Path(os.path.realpath(Path(root).expanduser()))
            if not real.is_dir():
                raise RuvLLMError(f"--lora-root {root}: not a folder")
            resolved.append(real)
        self.roots = resolved

    def confine(self, path: str) -> str:
        """The real folder `path` names, when it is an adapter under a root; else AdapterNotFound."""
        try:
            real = Path(os.path.realpath(Path(path).expanduser()))
            inside = any(real == root or real.is_relative_to(root) for root in self.roots)
            is_adapter = inside and real.is_dir() and any((real / f).is_file() for f in (PEFT_CONFIG, OWN_MANIFEST))
        except (OSError, ValueError):  # an unreadable place, a NUL in the path
            is_adapter = False
        if not is_adapter:
            raise AdapterNotFound(path)
        return str(real)


def runtime_updating_allowed(flag: bool) -> bool:
    """`--allow-runtime-lora-updating`, or RUVLLM_ALLOW_RUNTIME_LORA_UPDATING=1/true."""
    return flag or os.environ.get(ENV_ALLOW, "").strip().lower() in ("1", "true", "yes")
