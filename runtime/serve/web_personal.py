"""Per-user adaptation in the page (issue 51): the same feedback, the same steps and the same settings as
the server's (runtime/serve/personalization.py, runtime/core/feedback_plan.py), with the trainer in the
model worker on the WASM step (wasm/step/learn.h through web/src/step_trainer.js) and each user's state
in the origin's OPFS, so that it survives a reload. Standard library only: it runs in Pyodide.

Python keeps what the engine needs: after each feedback the model worker hands back the user's factors
as PEFT's adapter_model.safetensors, which is written beside its adapter_config.json into Pyodide's file
system and served as an adapter named `user:<digest>` (never a request's `model`), like any adapter the
page loads. A user is a name within the page's origin (the page has one key: "page").
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from runtime.core.adapters import peft_lora_config
from runtime.core.feedback_plan import feedback_steps, refresh_before
from runtime.errors import RequestError
from runtime.serve.personalization import (
    ADAPTER_PREFIX,
    KEEP_VERSIONS,
    PersonalSettings,
    check_feedback,
    package_key,
    sample_reference,
    tokenize_feedback,
    user_digest,
)

KEY = "page"
ROOT = Path("/personal")  # Pyodide's file system: the served versions' folders


class PageUsers:
    """The page's users of one engine. `runner`: the model worker's bridge (web/src/remote_runner.js)."""

    def __init__(self, aengine, runner, settings: PersonalSettings | None = None) -> None:
        self.aengine, self.runner = aengine, runner
        self.settings = settings or PersonalSettings()
        engine = aengine.engine
        self.pkg = engine.pkg
        self.package = package_key(self.pkg)
        self._open: dict[str, dict] = {}  # digest -> the stored meta (version, feedbacks, tokens, reference)
        self.window = int(self.pkg.config["max_positions"])  # then the step's longest feedback step

    def _store(self, digest: str) -> str:
        return f"{self.package}/{digest}"

    def _spec(self) -> dict:
        s = self.settings
        return {"targets": list(s.targets), "layers": self._layers(), "rank": s.rank, "alpha": s.alpha, "lr": s.lr, "ewc": s.ewc,
                "fisherDecay": s.fisher_decay}

    def _layers(self) -> list[int]:
        return self.settings.layers(int(self.pkg.config["num_layers"]))

    async def _call(self, method: str, *args):
        from js import Object
        from pyodide.ffi import to_js

        try:
            got = await getattr(self.runner, method)(*[to_js(a, dict_converter=Object.fromEntries) for a in args])
        except Exception as err:  # the model worker's refusal (another backend, storage), as a request error
            raise RequestError(str(err).removeprefix("Error: "), "user") from err
        return got.to_py() if hasattr(got, "to_py") else got

    async def _opened(self, user: str) -> tuple[str, dict]:
        digest = user_digest(KEY, user)
        if digest not in self._open:
            got = await self._call("learn_open", self._store(digest), self._spec())
            self.window = min(int(self.pkg.config["max_positions"]), int(got["room"]))
            meta = got.get("meta") or {"user": user, "version": 0, "feedbacks": 0, "tokens": 0}
            self._open[digest] = meta
            if got.get("peft") is not None and meta["version"]:
                self._serve(digest, bytes(got["peft"]))
        return digest, self._open[digest]

    def _serve(self, digest: str, weights: bytes) -> None:
        """The user's factors as a PEFT folder, served under the user's adapter name from the next request.
        Folders are numbered past every one before (a forgotten namesake's too: a running request may
        still read one)."""
        last = max((int(p.name[1:]) for p in (ROOT / digest).glob("v*")), default=0)
        folder = ROOT / digest / f"v{last + 1:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "adapter_model.safetensors").write_bytes(weights)
        s = self.settings
        config = peft_lora_config(s.rank, s.alpha, s.targets, self.pkg.name, self._layers())
        (folder / "adapter_config.json").write_text(json.dumps(config))
        self.aengine.add_adapter(ADAPTER_PREFIX + digest, str(folder))
        for old in sorted((ROOT / digest).glob("v*"))[:-KEEP_VERSIONS]:
            shutil.rmtree(old, ignore_errors=True)

    async def adapter_for(self, user: str | None) -> str | None:
        """The engine adapter serving `user`, or None (no user, or nothing learned yet)."""
        if not user:
            return None
        digest, meta = await self._opened(user)
        return ADAPTER_PREFIX + digest if meta["version"] and self.aengine.has_adapter(ADAPTER_PREFIX + digest) else None

    async def _reference(self, meta: dict) -> list[int]:
        """The model's own text EWC++ weighs drift on: sampled once (as the server does), kept with the user."""
        if not meta.get("reference"):
            meta["reference"] = await sample_reference(self.aengine, self.settings)
        return meta["reference"]

    async def feedback(self, user: str, what: dict) -> dict:
        """Learn from one feedback (runtime/serve/feedback_protocol.py's `what`); the user's next requests
        are served the result."""
        s = self.settings
        fb = tokenize_feedback(self.aengine.engine.prompts, what)
        check_feedback(fb, s.max_feedback_tokens)
        started = time.perf_counter()
        digest, meta = await self._opened(user)
        plan = feedback_steps(fb.kind, fb.ids, fb.scored_from, fb.rating, s.chunk, s.epochs, self.window)
        refresh = refresh_before(meta.get("steps", 0), len(plan), s.consolidate_every) if s.ewc else []
        reference = await self._reference(meta) if refresh else None
        updated = {**meta, "feedbacks": meta["feedbacks"] + 1, "tokens": meta["tokens"] + len(fb.ids) - fb.scored_from,
                   "steps": meta.get("steps", 0) + len(plan),
                   "version": meta["version"] + (1 if plan else 0), "updated": time.time()}
        got = await self._call("learn_feedback", self._store(digest), self._spec(), {
            "steps": [[list(st.ids), st.scored_from, bool(st.unlikely), float(st.lr_scale)] for st in plan],
            "refresh": refresh, "reference": reference, "chunk": s.chunk, "meta": updated})
        self._open[digest] = updated
        if plan:
            self._serve(digest, bytes(got["peft"]))
        return {"object": "feedback", "user": user, "kind": fb.kind, "tokens": len(fb.ids) - fb.scored_from,
                "steps": len(plan), "losses": [round(x, 4) for x in got["losses"]], "version": updated["version"],
                "feedbacks": updated["feedbacks"], "consolidated": bool(refresh),
                "seconds": round(time.perf_counter() - started, 3), "learn_seconds": round(got["seconds"], 3)}

    async def forget(self, user: str) -> bool:
        """Reset the user: their stored state is deleted and the base model serves their next request."""
        digest = user_digest(KEY, user)
        self.aengine.remove_adapter(ADAPTER_PREFIX + digest)  # its folders stay: running requests finish on them
        self._open.pop(digest, None)
        return bool(await self._call("learn_forget", self._store(digest)))

    async def folder(self, user: str) -> Path | None:
        """The PEFT folder of the user's newest adapter (engine.userAdapter(): the deep loop, elsewhere)."""
        digest, meta = await self._opened(user)
        versions = sorted((ROOT / digest).glob("v*"))
        return versions[-1] if meta["version"] and versions else None

    async def state(self, user: str) -> dict:
        _, meta = await self._opened(user)
        return {"object": "user", "user": user, "version": meta["version"], "feedbacks": meta["feedbacks"],
                "tokens": meta["tokens"], "targets": list(self.settings.targets), "layers": self._layers(),
                "rank": self.settings.rank}
