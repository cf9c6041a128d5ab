"""Per-user adaptation (issue 51): does a user's MicroLoRA, learned by the instant loop, lower the
perplexity of the rest of that user's text? (not a test)

    python benchmarks/sona.py [--package PKG] [--users 8] [--tokens 1024] [--user-set held-out|tuning]
    python benchmarks/sona.py --page [--users 4]      the loop in Chromium, on the page's WASM step

What a user gets from `ruvllm serve --personalize` without flags: each "user" (the long description, README,
of an installed package, named in the output) sends its first --tokens tokens as one text feedback to the
server's own Personalization (runtime/serve/personalization.py) at PersonalSettings' defaults (every flag
here that is left out is the server's default: epochs, step size, rank, layers, targets, EWC++ and its
reference, the model's own answer to the server's prompt); the next --tokens are scored teacher-forced.
Per user: no adaptation; the first half in context before the second; a random adapter with the trained
one's factor norms; the adapted user; the seconds the feedback took (the server's own count). Also the
perplexity of a general text (CPython's LICENSE.txt) before and after each user's adaptation (forgetting),
and how far the adapter moved the model: the mean KL from the base model's next-token distributions on the
model's own answer and on the general text. --user-set: `held-out` (default) are users 9-16, whose texts
the defaults were not chosen on; `tuning` users 1-8. PKG: any package whose manifest says how its decoder
computes (default: the embedded model's int4 package). Prints JSON.

With --page the loop runs in headless Chromium instead: the bundle's SmolLM2 (`python -m wasm build`) on
its WASM step, each user's first half sent as engine.feedback({ user, text }) pieces of about 256 tokens
(the page's defaults are the server's), then the user's adapter is taken out of the page
(engine.userAdapter()) and scored here exactly as the native users are; PKG defaults to the native
default package, whose Q4_1/Q8_0 blocks the page's step reads. Seconds per 256 tokens are the page's.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.serve.personalization import PersonalSettings  # noqa: E402

USERS = ["fonttools", "yarl", "pydantic", "tqdm", "orjson", "responses", "openai", "regex", "charset-normalizer",
         "wcwidth", "sentencepiece", "python-dotenv", "psutil", "fastapi", "jedi", "rich"]


def user_text(name: str) -> str:
    meta = md.distribution(name).metadata
    return meta.get("Description") or meta.get_payload()


def own_text(package, settings: PersonalSettings) -> list[int]:
    """The model's own answer to the server's reference prompt, sampled as the server samples it: what
    EWC++ weighs drift on, and the KL is measured on."""
    from runtime.core.engine import Engine
    from runtime.serve.personalization import reference_params, reference_prompt

    engine = Engine.from_package(package.path)
    prompt = reference_prompt(engine.prompts)
    return prompt + [t for o in engine.generate(prompt, reference_params(settings)) for t in o.token_ids]


class ServedUsers:
    """The server's instant loop (Personalization, as `serve --personalize` runs it) in a state folder of
    its own; each user's text learned as one feedback."""

    def __init__(self, pkg, settings: PersonalSettings, reference: list[int] | None) -> None:
        import tempfile

        from runtime.serve.personalization import Personalization

        self.folder = tempfile.mkdtemp(prefix="sona-users-")
        self.users = Personalization(pkg, self.folder, settings, lambda name, folder: None, lambda name: None)
        if settings.ewc:
            self.users.set_reference(reference)

    def learn(self, name: str, ids: list[int]) -> tuple[Path, float, int]:
        from runtime.serve.personalization import Feedback, stored_adapter

        got = self.users.feedback("sona", name, Feedback("text", ids))
        return stored_adapter(self.users.root, "sona", name), got["seconds"], got["tokens"]

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


class PageUsers:
    """The page's loop in Chromium: one engine on the WASM step; each user taught by engine.feedback()."""

    def __init__(self, threads: int) -> None:
        import subprocess

        from playwright.sync_api import sync_playwright

        from wasm.serve import serve_in_thread

        root = Path(__file__).resolve().parents[1]
        bundle = root / "dist" / "web"
        if not (bundle / "models" / "smollm2-135m" / "manifest.json").exists():
            subprocess.run([sys.executable, "-m", "wasm", "build"], cwd=root, check=True, stdout=sys.stderr)
        self.server, base = serve_in_thread(bundle, {"/test/": root / "tests" / "web" / "pages"})
        self.pw = sync_playwright().start()
        self.browser = self.pw.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=[
            "--no-sandbox", "--disable-dev-shm-usage", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"])
        self.page = self.browser.new_context().new_page()
        self.page.goto(base + "test/api.html")
        self.page.wait_for_function("window.apiReady || window.apiError")
        self.page.evaluate("async (threads) => { window.engine = await window.createEngine({ model: '/models/smollm2-135m/', "
                           "backend: 'wasm-step', speculativeTokens: 0, threads }); }", threads)

    def learn(self, name: str, pieces: list[str]) -> tuple[Path, float, int]:
        """Each piece as a feedback (the page's own settings, the server's defaults): the adapter's PEFT
        folder, the page's learning seconds, the tokens it learned from."""
        import tempfile

        seconds, tokens = 0.0, 0
        for text in pieces:
            got = self.page.evaluate("async (body) => await window.engine.feedback(body)", {"user": name, "text": text})
            seconds += got["learn_seconds"]
            tokens += got["tokens"]
        files = self.page.evaluate("async (user) => Object.fromEntries(Object.entries(await window.engine.userAdapter(user))"
                                   ".map(([k, v]) => [k, Array.from(v)]))", name)
        folder = Path(tempfile.mkdtemp(prefix=f"sona-page-{name}-"))
        for file, data in files.items():
            (folder / file).write_bytes(bytes(data))
        return folder, seconds, tokens

    def close(self) -> None:
        self.browser.close()
        self.pw.stop()
        self.server.shutdown()


def settings_from(args) -> PersonalSettings:
    """PersonalSettings' defaults, but for the flags given."""
    given = {"targets": tuple(args.targets.split(",")) if args.targets else None, "rank": args.rank,
             "top_layers": args.layers, "lr": args.lr, "epochs": args.epochs, "ewc": args.ewc,
             "reference_tokens": args.reference_tokens}
    return PersonalSettings(**{k: v for k, v in given.items() if v is not None})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--package", default=None, help="default: the embedded model's int4 package")
    ap.add_argument("--page", action="store_true", help="the loop in Chromium on the page's WASM step")
    ap.add_argument("--threads", type=int, default=2, help="--page: the step's threads")
    ap.add_argument("--users", type=int, default=None, help="default: 8 natively, 4 in the page")
    ap.add_argument("--user-set", choices=("held-out", "tuning"), default="held-out")
    ap.add_argument("--tokens", type=int, default=1024)
    for flag, kind in (("epochs", int), ("rank", int), ("lr", float), ("targets", str), ("layers", float),
                       ("ewc", float), ("reference-tokens", int)):
        ap.add_argument(f"--{flag}", type=kind, default=None, help="default: the server's (PersonalSettings)")
    ap.add_argument("--save-adapters", default=None, metavar="DIR",
                    help="copy each user's adapter there as a PEFT folder (for `ruvllm bench --adapters`)")
    args = ap.parse_args()
    from runtime.backends.lora_gradients import DenseDecoder, Lora, log_softmax_rows, loss_and_grads, mean_kl
    from runtime.backends.micro_lora import read_peft
    from runtime.package import load_package
    from runtime.text.prompt import package_tokenizer

    if args.package is None:
        from runtime.aliases import cached_package_dir

        args.package = cached_package_dir("smollm2-135m", "int4")  # `ruvllm download smollm2-135m` makes it
    settings = settings_from(args)
    count = args.users or (4 if args.page else 8)
    names = USERS[8:8 + count] if args.user_set == "held-out" else USERS[:count]
    pkg = load_package(args.package)
    dec = DenseDecoder.from_package(pkg)
    tok = package_tokenizer(pkg)
    none = Lora({}, 1.0)
    general = tok.encode((Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text())[:args.tokens]
    ppl = lambda ids, lora, scored_from=0: math.exp(loss_and_grads(dec, ids, lora, False, scored_from)[0])  # noqa: E731
    general_base = ppl(general, none)
    own = own_text(pkg, settings)
    base_own, base_general = log_softmax_rows(dec, own, none), log_softmax_rows(dec, general[:512], none)
    learner = PageUsers(args.threads) if args.page else ServedUsers(pkg, settings, own)
    rows, rng = [], np.random.default_rng(0)
    for name in names:
        ids = tok.encode(user_text(name))
        first, second = ids[:args.tokens], ids[args.tokens:2 * args.tokens]
        if args.page:
            folder, seconds, tokens = learner.learn(name, [tok.decode(first[s:s + 250]) for s in range(0, len(first), 250)])
        else:
            folder, seconds, tokens = learner.learn(name, first)
        adapted = read_peft(folder, pkg.config)
        random = Lora({k: tuple((rng.standard_normal(f.shape) * np.linalg.norm(f) / math.sqrt(f.size)).astype(np.float32)
                                for f in pair) for k, pair in adapted.factors.items()}, adapted.scale)
        context = first[-2048:] + second
        row = {"user": name, "tokens": len(ids), "none": ppl(second, none),
               "in_context": ppl(context, none, scored_from=len(context) - len(second)),
               "random_adapter": ppl(second, random), "adapted": ppl(second, adapted),
               "general_after": ppl(general, adapted),
               "kl_own_text": round(mean_kl(base_own, log_softmax_rows(dec, own, adapted)), 6),
               "kl_general": round(mean_kl(base_general, log_softmax_rows(dec, general[:512], adapted)), 6),
               "feedback_seconds": round(seconds, 2), "feedback_tokens": tokens}
        row["adapted_vs_none"] = round(row["adapted"] / row["none"] - 1, 4)
        row["forgetting"] = round(row["general_after"] / general_base - 1, 4)
        if args.save_adapters:
            import shutil

            row["adapter"] = shutil.copytree(folder, Path(args.save_adapters) / name, dirs_exist_ok=True).as_posix()
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    learner.close()
    mean = lambda key: round(float(np.mean([r[key] for r in rows])), 4)  # noqa: E731
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "package": str(pkg.path), "user_set": args.user_set,
                      "where": f"page (Chromium, WASM step, {args.threads} threads)" if args.page else "native, the server's loop",
                      "settings": {k: getattr(settings, k) for k in ("targets", "rank", "top_layers", "lr", "epochs",
                                                                      "ewc", "reference_tokens", "chunk")},
                      "tokens": args.tokens, "general_text_ppl": general_base,
                      "mean_adapted_vs_none": mean("adapted_vs_none"), "mean_forgetting": mean("forgetting"),
                      "max_forgetting": max(r["forgetting"] for r in rows),
                      "max_feedback_seconds": max(r["feedback_seconds"] for r in rows),
                      "adapted_below_random_for_every_user": all(r["adapted"] < r["random_adapter"] for r in rows),
                      "users": rows}, indent=1))


if __name__ == "__main__":
    main()
