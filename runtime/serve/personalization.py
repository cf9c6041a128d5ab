"""Per-user adaptation as served (issue 51): each user's MicroLoRA, learned from the feedback their client
sends, kept on disk as a PEFT folder, and applied to that user's requests only (native only: numpy).

Who a user is: the `user` field of a request (OpenAI's), within the API key that made it. Two keys'
"alice" are two users, so a key can neither read nor reset another key's users. A user with nothing
learned yet is served by the base model (a new adapter's B is zero: it would change nothing).

Feedback (`feedback`): a text the user wrote ("learn from this text": their style, their subjects), an
answer they preferred to a conversation (learned as the reply to it), or a rating of an answer: above
zero it is learned as preferred, at that fraction of the step size; below zero the unlikelihood loss
pushes its tokens down (lora_gradients). Each is a few Adam steps on the user's factors (the instant
loop), then a new version of the adapter is served to the user's next requests. Every
`consolidate_every` steps (a new user's first included) the EWC++ Fisher is measured again on the model's
own text (micro_lora.consolidate, feedback_plan.refresh_before), which holds the factors near what the
model did well.

On disk, per package (its name and the digest of its manifest):
    <state>/<package>/<user digest>/user.json            the user's name and key, counts, the version served
                                    trainer.safetensors  factors, EWC++ start and Fisher, Adam's moments
                                    v<N>/                the adapter as PEFT writes it (what the engine serves)
                                    forgotten            marks a user reset: the folder is to be deleted
The newest KEEP_VERSIONS versions stay, so a request admitted on one still finds it while a newer one
is served; older versions, and a forgotten user's, are deleted RETIRE_SECONDS later (a running request
may load its adapter into a slot again after a preemption), or when the next process starts (only folders
marked forgotten: a new user's folder has no user.json either until its first feedback is written, which
another process on the same state folder may be doing).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from runtime.core.feedback_plan import feedback_steps, refresh_before
from runtime.errors import RequestError

ADAPTER_PREFIX = "user:"  # engine adapter names of users' adapters: never a request's `model`
KEEP_VERSIONS = 3
RETIRE_SECONDS = 300.0
FORGOTTEN = "forgotten"  # the marker forget() leaves in a user's folder
REFERENCE_MESSAGES = [{"role": "user", "content": "Tell me about something you know well, in detail."}]


@dataclass
class PersonalSettings:
    """What a user's adapter is and how it learns (`ruvllm serve --personalize-*`)."""

    # every projection of the last third of the layers at rank 2, EWC++ 2: on 8 users of SmolLM2, -5.6 %
    # perplexity, the general text +0.1 % (at most +0.5 %); every layer with EWC++ 4 gave -5.8 % but one
    # user +1.4 %; q and v alone at rank 4 -3.5 % (docs/PERFORMANCE.md, sessions 35 and 46). Two passes, each
    # step 2 % of a projection's weight RMS (4e-3 on SmolLM2's), the Fisher measured again every 4 steps:
    # what a 1,024-token feedback gives in about 9 s on SmolLM2 (session 48)
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    rank: int = 2
    # the share of the layers adapted, the last ones: on SmolLM2 the lower two thirds of an all-layer
    # user's adapter gave a quarter of its benefit and most of its forgetting
    top_layers: float = 1 / 3
    alpha: float = 8.0
    lr: float = 0.02  # Adam's step, a share of each adapted projection's weight RMS (micro_lora.rates)
    epochs: int = 2
    chunk: int = 256  # tokens a step when learning from a text
    ewc: float = 2.0  # EWC++ strength (0: off)
    fisher_decay: float = 0.5
    consolidate_every: int = 4  # a user's trainer steps between EWC++'s Fisher refreshes
    reference_tokens: int = 256  # the model's own text the Fisher is measured on
    max_trainers: int = 4  # users' trainers kept in memory (the others are read back from disk)
    max_feedback_tokens: int = 8192

    def __post_init__(self) -> None:
        from runtime.core.adapters import target_features

        unknown = sorted(set(self.targets) - set(target_features({"hidden_size": 1, "head_dim": 1, "num_heads": 1,
                                                                   "num_kv_heads": 1, "intermediate_size": 1})))
        if unknown or not self.targets:
            raise ValueError(f"personalization targets must be among q_proj, k_proj, v_proj, o_proj, gate_proj, "
                             f"up_proj, down_proj; got {list(self.targets)}")
        if not 1 <= self.rank <= 16:
            raise ValueError(f"personalization rank must be 1 to 16, not {self.rank}")
        if not 0 < self.top_layers <= 1:
            raise ValueError(f"personalization's share of the layers must be above 0 and at most 1, not {self.top_layers}")

    def layers(self, num_layers: int) -> list[int]:
        """The layers a user's adapter adapts: the last top_layers of them (at least one)."""
        count = min(num_layers, max(1, round(num_layers * self.top_layers)))
        return list(range(num_layers - count, num_layers))


@dataclass
class Feedback:
    """One feedback, tokenized: `ids`, scored from `scored_from` on (a reply after its conversation)."""

    kind: str  # "text", "preferred" or "rating"
    ids: list[int]
    scored_from: int = 0
    rating: float = 1.0
    extra: dict = field(default_factory=dict)


def reference_params(settings: PersonalSettings):
    """How the model's own reference text for EWC++ is sampled: temperature 1, a fixed seed, its full length."""
    from runtime.core.sampling import SamplingParams

    return SamplingParams(temperature=1.0, seed=0, max_tokens=settings.reference_tokens, ignore_eos=True)


def reference_prompt(prompts) -> list[int]:
    """What the model's own text for EWC++ answers: REFERENCE_MESSAGES through the chat template, or for
    a base model without one (Gemma 3 270M's GGUF), their words as a text to continue."""
    if prompts.chat_template is None:
        return prompts.encode(REFERENCE_MESSAGES[-1]["content"] + "\n")
    return prompts.encode(None, REFERENCE_MESSAGES)


async def sample_reference(aengine, settings: PersonalSettings) -> list[int]:
    """The model's own text for EWC++ (the answer to reference_prompt, sampled by an AsyncEngine): the
    server's and the page's alike."""
    prompt = reference_prompt(aengine.prompts)
    tokens: list[int] = []
    async for out in aengine.generate(prompt, reference_params(settings)):
        tokens += out.token_ids
    return prompt + tokens


def check_feedback(fb: Feedback, max_tokens: int) -> None:
    """RequestError unless the feedback has tokens to learn from, and no more than `max_tokens`."""
    if len(fb.ids) - fb.scored_from > max_tokens:
        raise RequestError(f"the feedback has {len(fb.ids) - fb.scored_from} tokens to learn from; the "
                           f"limit is {max_tokens}", "text")
    if len(fb.ids) - fb.scored_from < 1 or len(fb.ids) < 2:
        raise RequestError("the feedback has no tokens to learn from", "text")


def package_key(pkg) -> str:
    digest = hashlib.sha256(pkg.file("manifest.json").read_bytes()).hexdigest()[:12]
    return f"{pkg.name}-{digest}"


def package_root(pkg, state_dir: str | Path | None) -> Path:
    """The package's folder of users under the state dir (default: the cache's users/)."""
    from runtime.aliases import cache_dir

    return (Path(state_dir).expanduser() if state_dir else cache_dir() / "users") / package_key(pkg)


def stored_users(root: Path) -> dict:
    """What is stored under a package's root: users, their feedbacks and tokens, users per key (read only)."""
    out = {"state_dir": str(root), "users": 0, "feedbacks": 0, "tokens": 0, "keys": {}}
    for meta in sorted(root.glob("*/user.json")) if root.exists() else []:
        try:
            m = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
        out["users"] += 1
        out["feedbacks"] += int(m.get("feedbacks", 0))
        out["tokens"] += int(m.get("tokens", 0))
        out["keys"][m.get("key", "?")] = out["keys"].get(m.get("key", "?"), 0) + 1
    return out


def stored_adapter(root: Path, key: str, user: str) -> Path | None:
    """The folder (PEFT's format) of a user's newest adapter under a package's root, or None (read only)."""
    folder = root / user_digest(key, user)
    try:
        version = json.loads((folder / "user.json").read_text()).get("version")
    except (OSError, ValueError):
        return None
    return folder / f"v{version:06d}" if version else None


def user_digest(key: str, user: str) -> str:
    return hashlib.sha256(json.dumps([key, user]).encode()).hexdigest()[:32]


class Personalization:
    """The users of one served package. `register(name, folder)` / `unregister(name)` put an adapter
    folder in the engine's registry or take it out (Engine.adapters.add/remove, AsyncEngine's
    add_adapter/remove_adapter). Blocking: a server calls it off its event loop."""

    def __init__(self, pkg, state_dir: str | Path | None, settings: PersonalSettings, register: Callable,
                 unregister: Callable) -> None:
        self.pkg, self.settings = pkg, settings
        self.root = package_root(pkg, state_dir)
        self.register, self.unregister = register, unregister
        self._decoder = None
        self._trainers: OrderedDict[str, object] = OrderedDict()
        self._served: dict[str, int] = {}  # user digest -> version registered with the engine
        self._train_lock = threading.Lock()  # one user's steps at a time: the trainer uses every core
        self._reference: list[int] | None = None
        self._retired: list[tuple[float, Path]] = []  # (when, folder): deleted RETIRE_SECONDS later
        self.feedbacks = 0
        if self.root.exists():  # a user forgotten by an earlier process: what it left to delete
            for folder in self.root.iterdir():
                if (folder / FORGOTTEN).exists() and not (folder / "user.json").exists():
                    shutil.rmtree(folder, ignore_errors=True)

    # ---- what requests are served with ----

    def adapter_for(self, key: str, user: str | None) -> str | None:
        """The engine adapter name of this user's adapter, registered from disk on first use; None for
        no user or one with nothing learned."""
        if not user:
            return None
        digest = user_digest(key, user)
        meta = self._meta(digest)
        if meta is None or not meta.get("version"):
            return None
        name = ADAPTER_PREFIX + digest
        if self._served.get(digest) != meta["version"]:
            self.register(name, self._version_dir(digest, meta["version"]))
            self._served[digest] = meta["version"]
        return name

    # ---- the instant loop ----

    @property
    def needs_reference(self) -> bool:
        return bool(self.settings.ewc) and self._load_reference() is None

    def set_reference(self, ids: list[int]) -> None:
        """The model's own text (sampled by the caller's engine) that EWC++ weighs drift on."""
        self.root.mkdir(parents=True, exist_ok=True)
        _write_json(self.root / "reference.json", {"ids": list(ids)})
        self._reference = list(ids)

    def feedback(self, key: str, user: str, fb: Feedback) -> dict:
        """Learn from one feedback and serve the result to the user's next requests."""
        if not user:
            raise RequestError("feedback needs a `user`", "user")
        check_feedback(fb, self.settings.max_feedback_tokens)
        s, digest = self.settings, user_digest(key, user)
        started = time.perf_counter()
        with self._train_lock:
            self._purge()
            waited = time.perf_counter() - started
            trainer = self._trainer(digest)
            meta = self._meta(digest)
            if meta is None:  # numbered past any version a forgotten namesake left to retire
                (self._dir(digest) / FORGOTTEN).unlink(missing_ok=True)  # a user again: keep the folder
                last = max((int(p.name[1:]) for p in self._versions(digest)), default=0)
                meta = {"user": user, "key": key, "version": last, "feedbacks": 0, "tokens": 0, "created": time.time()}
            plan = feedback_steps(fb.kind, fb.ids, fb.scored_from, fb.rating, s.chunk, s.epochs, self._positions())
            reference = self._load_reference() if s.ewc else None
            refresh = set(refresh_before(trainer.steps, len(plan), s.consolidate_every)) if reference else set()
            losses = []
            for j, step in enumerate(plan):
                if j in refresh:
                    trainer.consolidate(reference, s.chunk)
                losses.append(trainer.step(*step))
            steps, consolidated = len(plan), bool(refresh)
            meta["feedbacks"] += 1
            meta["tokens"] += len(fb.ids) - fb.scored_from
            if steps:
                meta["version"] += 1
                self._write_version(digest, trainer, meta["version"])
            meta["updated"] = time.time()
            self._dir(digest).mkdir(parents=True, exist_ok=True)
            trainer.save_state(self._dir(digest) / "trainer.safetensors")
            _write_json(self._dir(digest) / "user.json", meta)
            self.feedbacks += 1
        if steps:
            self.adapter_for(key, user)  # the next request is served the new version
        return {"object": "feedback", "user": user, "kind": fb.kind, "tokens": len(fb.ids) - fb.scored_from,
                "steps": steps, "losses": [round(x, 4) for x in losses], "version": meta["version"],
                "feedbacks": meta["feedbacks"], "consolidated": consolidated,
                "seconds": round(time.perf_counter() - started - waited, 3), "queued_seconds": round(waited, 3)}

    def forget(self, key: str, user: str) -> bool:
        """Reset a user: their adapter is no longer served and their state is deleted."""
        digest = user_digest(key, user)
        with self._train_lock:
            self._purge()
            self._trainers.pop(digest, None)
            if self._served.pop(digest, None) is not None:
                self.unregister(ADAPTER_PREFIX + digest)
            folder = self._dir(digest)
            if not (folder / "user.json").exists():
                return False
            (folder / FORGOTTEN).touch()  # what is left goes, at the latest when a process starts on it
            (folder / "user.json").unlink()  # from here on the user is unknown; their factors go now
            (folder / "trainer.safetensors").unlink(missing_ok=True)
            self._retire(self._versions(digest))  # the served versions go once nothing can read them
            return True

    # ---- what info and /v1/models say ----

    def state(self) -> dict:
        s = self.settings
        return {"enabled": True, "state_dir": str(self.root), "users": stored_users(self.root)["users"],
                "targets": list(s.targets), "layers": s.layers(int(self.pkg.config["num_layers"])),
                "rank": s.rank, "alpha": s.alpha, "lr": s.lr, "ewc": s.ewc, "consolidate_every": s.consolidate_every,
                "feedbacks_since_start": self.feedbacks, "trainers_in_memory": len(self._trainers)}

    def user_state(self, key: str, user: str) -> dict | None:
        meta = self._meta(user_digest(key, user))
        if meta is None:
            return None
        return {"object": "user", "user": user, **{k: meta[k] for k in ("version", "feedbacks", "tokens", "created",
                                                                         "updated") if k in meta}}

    # ---- internals ----

    def _dir(self, digest: str) -> Path:
        return self.root / digest

    def _version_dir(self, digest: str, version: int) -> Path:
        return self._dir(digest) / f"v{version:06d}"  # stored_adapter reads the same name

    def _meta(self, digest: str) -> dict | None:
        path = self._dir(digest) / "user.json"
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            raise RequestError(f"this user's stored state is unreadable ({err}); reset the user to start again",
                               "user") from None

    def _positions(self) -> int:
        return int(self.decoder.cos.shape[0])

    @property
    def decoder(self):
        if self._decoder is None:
            from runtime.backends.lora_gradients import DenseDecoder

            self._decoder = DenseDecoder.from_package(self.pkg)
        return self._decoder

    def _trainer(self, digest: str):
        from runtime.backends.micro_lora import MicroLora

        trainer = self._trainers.pop(digest, None)
        if trainer is None:
            s = self.settings
            trainer = MicroLora(self.decoder, s.targets, s.rank, s.alpha, s.lr, seed=int(digest[:8], 16), ewc=s.ewc,
                                fisher_decay=s.fisher_decay, layers=s.layers(len(self.decoder.layers)))
            state = self._dir(digest) / "trainer.safetensors"
            if state.exists():
                try:
                    trainer.load_state(state)
                except (OSError, ValueError) as err:
                    raise RequestError(f"this user's stored state does not fit ({err}); reset the user to start "
                                       "again", "user") from None
        self._trainers[digest] = trainer
        while len(self._trainers) > self.settings.max_trainers:
            self._trainers.popitem(last=False)
        return trainer

    def _write_version(self, digest: str, trainer, version: int) -> None:
        folder = self._version_dir(digest, version)
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        trainer.save_peft(tmp, base=self.pkg.name)
        tmp.rename(folder)
        self._retire(self._versions(digest)[:-KEEP_VERSIONS])

    def _retire(self, folders: list[Path]) -> None:
        """Delete these folders RETIRE_SECONDS from now (each once)."""
        now, pending = time.monotonic(), {q for _, q in self._retired}
        self._retired += [(now, p) for p in folders if p not in pending]

    def _versions(self, digest: str) -> list[Path]:
        folder = self._dir(digest)
        return sorted(p for p in folder.glob("v[0-9]*") if p.is_dir() and p.name[1:].isdigit()) if folder.exists() else []

    def _purge(self, wait: float = RETIRE_SECONDS) -> None:
        now, keep = time.monotonic(), []
        for when, folder in self._retired:
            if now - when >= wait:
                shutil.rmtree(folder, ignore_errors=True)
            else:
                keep.append((when, folder))
        self._retired = keep

    def _load_reference(self) -> list[int] | None:
        if self._reference is None:
            try:
                self._reference = json.loads((self.root / "reference.json").read_text())["ids"]
            except (OSError, ValueError, KeyError):
                return None
        return self._reference


def personalization_for(engine, settings: PersonalSettings, state_dir: str | Path | None, register: Callable,
                        unregister: Callable) -> Personalization:
    """An engine's Personalization, or a clear error for a package that cannot have one."""
    from runtime.errors import PackageError

    pkg = engine.pkg
    if pkg.lora_graph_path is None:
        raise PackageError(f"{pkg.path}: personalization serves each user's LoRA, and this package was exported "
                           "without LoRA inputs (export it again without --no-lora)")
    if settings.rank > engine.config.max_lora_rank:
        raise PackageError(f"--personalize-rank {settings.rank} is above --max-lora-rank {engine.config.max_lora_rank}")
    from runtime.backends.lora_gradients import Compute

    Compute.from_manifest(pkg.path, pkg.manifest)  # a decoder the backward cannot follow is refused by name
    return Personalization(pkg, state_dir, settings, register, unregister)


def tokenize_feedback(prompts, what: dict) -> Feedback:
    """A feedback's token ids (what: kind, and text or messages + answer [+ rating]): a text as the
    tokenizer encodes it; an answer after its conversation as the chat template renders the two (the
    reply's end of turn included, so that it learns to stop)."""
    tok = prompts.tokenizer
    if what["kind"] == "text":
        return Feedback("text", tok.encode(what["text"]))
    template = prompts.chat_template
    if template is None:
        raise RequestError("this model package has no chat template: feedback on a conversation needs one",
                           "messages")
    prompt = prompts.encode(messages=what["messages"])
    whole = what["messages"] + [{"role": "assistant", "content": what["answer"]}]
    full = tok.encode(template.render(whole, add_generation_prompt=False), add_bos=False)
    if full[:len(prompt)] != prompt:  # a template that renders history differently: the answer's own ids
        full = prompt + tok.encode(what["answer"], add_bos=False)
    return Feedback(what["kind"], full, scored_from=len(prompt), rating=what.get("rating", 1.0))


class LocalUser:
    """One user's loop over a local Engine (`ruvllm chat --user NAME`): the same Personalization the server
    runs, under the key name "local"."""

    KEY = "local"

    def __init__(self, engine, user: str, settings: PersonalSettings, state_dir: str | Path | None) -> None:
        self.engine, self.user = engine, user
        self.personal = personalization_for(engine, settings, state_dir, engine.adapters.add, engine.adapters.remove)

    @property
    def adapter(self) -> str | None:
        return self.personal.adapter_for(self.KEY, self.user)

    def learn(self, what: dict) -> dict:
        if self.personal.needs_reference:
            p = self.personal
            prompt = self.engine.encode_prompt(messages=REFERENCE_MESSAGES)
            tokens = [t for o in self.engine.generate(prompt, reference_params(p.settings)) for t in o.token_ids]
            p.set_reference(prompt + tokens)
        return self.personal.feedback(self.KEY, self.user, tokenize_feedback(self.engine.prompts, what))

    def forget(self) -> bool:
        return self.personal.forget(self.KEY, self.user)


def _write_json(path: Path, value: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    tmp.replace(path)
