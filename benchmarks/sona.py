"""Per-user adaptation (issue 51): does a user's MicroLoRA, learned by the instant loop, lower the
perplexity of the rest of that user's text? (not a test)

    python benchmarks/sona.py --package PKG [--users 8] [--tokens 1024] [--epochs 3]
    python benchmarks/sona.py --page [--users 4]      the loop in Chromium, on the page's WASM step

Each "user" is the long description (README) of an installed package, named in the output: the first
--tokens tokens are the feedback the loop learns from, in chunks of 256 (runtime/backends/micro_lora.py:
Adam on rank-2 factors of the last third of the layers' projections (the server's default), gradients from lora_gradients.py, no torch), the next
--tokens are scored teacher-forced. Per user: no adaptation; the first half in context before the second;
a random adapter with the trained one's factor norms; the adapted user. Also the perplexity of a general
text (CPython's LICENSE.txt) before and after each user's adaptation (forgetting), and how far the adapter
moved the model: the mean KL from the base model's next-token distributions on the model's own sampled
answer (own_text) and on the general text; --ewc is EWC++'s strength (2), measured on that own text. PKG: any package of a llama, mistral or qwen2 model
(the loop learns against the weights it serves, quantized or not). Prints JSON.

With --page the loop runs in headless Chromium instead: the bundle's SmolLM2 (`python -m wasm build`) on
its WASM step, each user's first half sent as engine.feedback({ user, text }) pieces of about 256 tokens
(EWC++ and its reference as the page does them), then the user's adapter is taken out of the page
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


def own_text(package, tokens: int) -> list[int]:
    """What EWC++ measures "what the model did well" on: the model's own answer, sampled (temperature 1,
    seed 0) by the engine, so that no text from outside the model is needed."""
    from runtime.core.engine import Engine

    engine = Engine.from_package(package.path)
    params = engine.sampling_params(temperature=1.0, seed=0, max_tokens=tokens, ignore_eos=True)
    messages = [{"role": "user", "content": "Tell me about something you know well, in detail."}]
    prompt = engine.encode_prompt(messages=messages)
    return prompt + [t for o in engine.generate(prompt, params) for t in o.token_ids]


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

    def learn(self, name: str, pieces: list[str], epochs: int) -> tuple[Path, float, int]:
        """Each piece as a feedback, `epochs` times: the adapter's PEFT folder, the page's learning
        seconds, the tokens it learned from."""
        import tempfile

        seconds, tokens = 0.0, 0
        for _ in range(epochs):
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--package", default=None, help="default: the embedded model's int4 package")
    ap.add_argument("--page", action="store_true", help="the loop in Chromium on the page's WASM step")
    ap.add_argument("--threads", type=int, default=2, help="--page: the step's threads")
    ap.add_argument("--users", type=int, default=None, help="default: 8 natively, 4 in the page")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rank", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    ap.add_argument("--layers", type=float, default=PersonalSettings.top_layers,
                    help="the share of the layers adapted, the last ones (the server's default; 1: all)")
    ap.add_argument("--ewc", type=float, default=PersonalSettings.ewc, help="EWC++'s strength (0: off)")
    ap.add_argument("--reference-tokens", type=int, default=512, help="EWC++: the model's own text it is measured on")
    ap.add_argument("--save-adapters", default=None, metavar="DIR",
                    help="write each user's adapter there as a PEFT folder (for `ruvllm bench --adapters`)")
    args = ap.parse_args()
    from runtime.backends.lora_gradients import DenseDecoder, Lora, log_softmax_rows, loss_and_grads, mean_kl
    from runtime.backends.micro_lora import MicroLora, read_peft
    from runtime.package import load_package
    from runtime.text.prompt import package_tokenizer

    if args.package is None:
        from runtime.aliases import cached_package_dir

        args.package = cached_package_dir("smollm2-135m", "int4")  # `ruvllm download smollm2-135m` makes it
    users = args.users or (4 if args.page else 8)
    pkg = load_package(args.package)
    dec = DenseDecoder.from_package(pkg)
    tok = package_tokenizer(pkg)
    none = Lora({}, 1.0)
    general = tok.encode((Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text())[:args.tokens]
    ppl = lambda ids, lora, scored_from=0: math.exp(loss_and_grads(dec, ids, lora, False, scored_from)[0])  # noqa: E731
    general_base = ppl(general, none)
    own = own_text(pkg, args.reference_tokens)
    reference = own if args.ewc and not args.page else None
    base_own, base_general = log_softmax_rows(dec, own, none), log_softmax_rows(dec, general[:512], none)
    page = PageUsers(args.threads) if args.page else None  # the page's settings are the server's defaults
    rows, rng = [], np.random.default_rng(0)
    for name in USERS[:users]:
        ids = tok.encode(user_text(name))
        first, second = ids[:args.tokens], ids[args.tokens:2 * args.tokens]
        if page:
            pieces = [tok.decode(first[s:s + 250]) for s in range(0, len(first), 250)]
            folder, seconds, tokens = page.learn(name, pieces, args.epochs)
            adapted, learned = read_peft(folder), {"seconds": seconds, "tokens": tokens}
        else:
            layers = PersonalSettings(top_layers=args.layers).layers(len(dec.layers))
            user = MicroLora(dec, tuple(args.targets.split(",")), rank=args.rank, lr=args.lr, ewc=args.ewc, layers=layers)
            learned = user.learn(first, chunk=256, epochs=args.epochs, reference=reference)
            adapted = user.lora
        random = Lora({k: tuple((rng.standard_normal(f.shape) * np.linalg.norm(f) / math.sqrt(f.size)).astype(np.float32)
                                for f in pair) for k, pair in adapted.factors.items()}, adapted.scale)
        context = first[-2048:] + second
        row = {"user": name, "tokens": len(ids), "none": ppl(second, none),
               "in_context": ppl(context, none, scored_from=len(context) - len(second)),
               "random_adapter": ppl(second, random), "adapted": ppl(second, adapted),
               "general_after": ppl(general, adapted),
               "kl_own_text": round(mean_kl(base_own, log_softmax_rows(dec, own, adapted)), 6),
               "kl_general": round(mean_kl(base_general, log_softmax_rows(dec, general[:512], adapted)), 6),
               "seconds_per_256_tokens": round(learned["seconds"] / (learned["tokens"] / 256), 2)}
        row["adapted_vs_none"] = round(row["adapted"] / row["none"] - 1, 4)
        row["forgetting"] = round(row["general_after"] / general_base - 1, 4)
        if args.save_adapters and not page:
            row["adapter"] = str(user.save_peft(Path(args.save_adapters) / name, base=pkg.name))
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    if page:
        page.close()
    mean = lambda key: round(float(np.mean([r[key] for r in rows])), 4)  # noqa: E731
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "package": str(pkg.path), "targets": args.targets, "layers": args.layers,
                      "where": f"page (Chromium, WASM step, {args.threads} threads)" if page else "native",
                      "ewc": args.ewc,
                      "rank": args.rank, "lr": args.lr, "epochs": args.epochs, "tokens": args.tokens,
                      "general_text_ppl": general_base, "mean_adapted_vs_none": mean("adapted_vs_none"),
                      "mean_forgetting": mean("forgetting"),
                      "adapted_below_random_for_every_user": all(r["adapted"] < r["random_adapter"] for r in rows),
                      "users": rows}, indent=1))


if __name__ == "__main__":
    main()
