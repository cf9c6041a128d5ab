"""Browser benchmark: RuvLLM (ruvllm-web), transformers.js and wllama on SmolLM2-135M in headless Chromium.

Same machine, same page harness (benchmarks/browser/bench.html), same chat prompt, 128 greedy tokens,
each engine in a fresh browser profile visited twice (first visit, then a reload that loads from the
browser's caches), rounds interleaved; prints JSON with medians of load time, TTFT and decode tok/s
for both visits. Not a test: speed is never asserted.

    python benchmarks/browser.py [--repeats 3] [--threads 2] [--tokens 128]
    python benchmarks/browser.py --gguf FILE --engines ruvllm:step.nolookup,wllama [--context 500] [--raw]

With --gguf, RuvLLM gets FILE exported for the page (its WASM step reads the file's own blocks) and
wllama gets FILE itself; benchmarks/sizes.py makes random-weight GGUFs of real shapes.

Needs the bundle (`python -m wasm build`), Debian's Chromium and, once, the peers' npm packages
(benchmarks/browser/package.json) and models: transformers.js gets SmolLM2 as an ONNX decoder with
past_key_values (onnxruntime-genai's builder, fp32; q8 by onnxruntime's dynamic quantizer,
per channel), wllama gets the Q4_1 GGUF that the embedded model comes from.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from peers import WORK, gguf_path, hf_folder  # noqa: E402

HERE = ROOT / "benchmarks" / "browser"
MODELS = WORK / "browser-models"


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def npm_peers() -> None:
    if not (HERE / "node_modules" / "@wllama" / "wllama").exists():
        log("npm install (benchmarks/browser)")  # onnxruntime-node's install script fetches from nuget: skip scripts
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--ignore-scripts"], cwd=HERE, check=True,
                       stdout=sys.stderr)  # stdout is the JSON result


def transformersjs_model(src: Path | None = None, name: str = "smollm2-tjs") -> Path:
    """A Hugging Face folder (default: SmolLM2's) in transformers.js' layout under MODELS/name: config + tokenizer
    files, onnx/model.onnx (+ _data), onnx/model_quantized.onnx."""
    out = MODELS / name
    if (out / "onnx" / "model_quantized.onnx").exists():
        return out
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    src = src or hf_folder()
    built = WORK / ("genai-fp32" if name == "smollm2-tjs" else f"genai-fp32-{name}")
    if not (built / "model.onnx").exists():
        log("building an fp32 decoder with onnxruntime-genai's model builder")
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o", str(built),
                        "-p", "fp32", "-e", "cpu", "-c", str(WORK / "genai-cache")], check=True, stdout=sys.stderr)
    (out / "onnx").mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / f).exists():  # benchmarks/sizes.py's folders have no generation_config.json
            shutil.copy(src / f, out / f)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    if (src / "chat_template.jinja").exists():  # transformers 5 saves it apart; transformers.js reads it here
        tok_cfg["chat_template"] = (src / "chat_template.jinja").read_text()
        (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
    cfg = json.loads((out / "config.json").read_text())
    cfg["transformers.js_config"] = {"use_external_data_format": {"model.onnx": True}}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    model = onnx.load(built / "model.onnx")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    for value in [*model.graph.input, *model.graph.output]:  # transformers.js sizes empty past tensors from
        for dim in value.type.tensor_type.shape.dim:        # these shapes: a symbolic head size becomes 0
            if dim.dim_param == "kv_cache_dim":
                dim.Clear()
                dim.dim_value = head_dim
    onnx.save_model(model, out / "onnx" / "model.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx_data")
    log("q8: dynamic int8 quantization, per channel")
    quantize_dynamic(out / "onnx" / "model.onnx", out / "onnx" / "model_quantized.onnx", weight_type=QuantType.QInt8,
                     per_channel=True, op_types_to_quantize=["MatMul"], extra_options={"MatMulConstBOnly": True})
    return out


def wllama_model() -> Path:
    dest = MODELS / "smollm2.gguf"
    if not dest.exists():
        MODELS.mkdir(parents=True, exist_ok=True)
        shutil.copy(gguf_path(), dest)
    return dest


class RendererPeak:
    """The peak memory of a browser profile's renderer processes (the page and its workers: the model's
    weights, the KV pool, Pyodide), sampled every 0.2 s while a visit runs, in MB.

    `peak`: each renderer's private pages (USS) plus the shared ones once (the largest renderer's: mostly
    Chromium's own code, mapped by every renderer). `rss_sum_peak`: the renderers' RSS summed, as measured
    up to 2026-11-27, which counts those shared pages once a renderer (an idle spare renderer adds ~70 MB).
    """

    def __init__(self, profile: str) -> None:
        import threading

        self.profile, self.peak, self.rss_sum_peak, self._stop = profile, 0.0, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        import psutil

        while not self._stop.wait(0.2):
            private = shared = rss = 0
            for proc in psutil.process_iter(["cmdline"]):
                cmd = proc.info["cmdline"] or []
                if "--type=renderer" in cmd and any(self.profile in arg for arg in cmd):
                    try:
                        mem = proc.memory_full_info()
                    except psutil.Error:
                        continue
                    private, shared, rss = private + mem.uss, max(shared, mem.rss - mem.uss), rss + mem.rss
            self.peak = max(self.peak, (private + shared) / 2**20)
            self.rss_sum_peak = max(self.rss_sum_peak, rss / 2**20)

    def stop(self) -> tuple[float, float]:
        """(peak, rss_sum_peak)."""
        self._stop.set()
        self._thread.join()
        return round(self.peak, 1), round(self.rss_sum_peak, 1)


def gguf_models(gguf: Path, export: bool = True) -> tuple[str | None, str]:
    """(RuvLLM's package URL, wllama's file URL) under /bench-models/ for a GGUF: the package exported for
    the page once (wasm.build.export_model's cache; export=False: none, the page opens the file itself), both
    linked into MODELS."""
    import contextlib
    import os

    from runtime.aliases import source_name
    from wasm.build import export_model

    with contextlib.ExitStack() as stack:  # the exporter's "wrote ..." goes to stderr: stdout is the JSON result
        saved = os.dup(1)
        stack.callback(os.close, saved)
        os.dup2(2, 1)
        stack.callback(os.dup2, saved, 1)
        pkg, name = (export_model(str(gguf), "int4") if export else None), source_name(str(gguf))
    MODELS.mkdir(parents=True, exist_ok=True)
    for link, target in ((MODELS / name, pkg), (MODELS / gguf.name, gguf.resolve())):
        if link.is_symlink() or link.exists():
            link.unlink()
        if target is not None:
            link.symlink_to(target)
    return (f"/bench-models/{name}/" if export else None), f"/bench-models/{gguf.name}"


def run_one(pw, launch: list[str], base: str, engine: str, threads: int, tokens: int, dtype: str | None,
            timeout_s: int, reload_prompt: str = "same", kv: str = "fp32", context: int = 0,
            files: tuple[str, str] | None = None, tjs: str = "smollm2-tjs", raw: bool = False) -> dict:
    """A first visit, then a reload: a returning visitor's load, from the browser's own caches.

    Each run gets a new persistent profile (a fresh user-data folder), so the first visit is cold and
    the reload is as a real profile serves it: OPFS and Cache API on disk, the HTTP cache, and V8's
    cache of the engines' compiled (and tiered-up) WASM code.
    """
    with tempfile.TemporaryDirectory(prefix="ruvllm-bench-profile-") as profile:
        ctx = pw.chromium.launch_persistent_context(profile, executable_path="/usr/bin/chromium", args=launch,
                                                    headless=True)
        blocked: list[str] = []

        def route(r):
            if r.request.url.startswith("http://127.0.0.1"):
                r.continue_()
            else:
                blocked.append(r.request.url)
                r.abort()
        ctx.route("**/*", route)
        page = ctx.pages[0] if ctx.pages else ctx.new_page()
        try:
            url = (f"{base}bench/bench.html?engine={engine}&threads={threads}&tokens={tokens}"
                   + (f"&dtype={dtype}" if dtype else "") + f"&reload={reload_prompt}&kv={kv}&context={context}"
                   + (f"&model={files[0]}" if files and files[0] else "") + (f"&gguf={files[1]}" if files else "") + f"&tjs={tjs}" + ("&raw=1" if raw else ""))
            memory = RendererPeak(profile)
            page.goto(url)
            page.wait_for_function("window.result || window.failure", timeout=timeout_s * 1000, polling=500)
            peak, rss_sum = memory.stop()
            failure = page.evaluate("window.failure || null")
            if failure:
                return {"engine": engine, "dtype": dtype, "error": failure[-1500:]}  # a traceback says what went wrong last
            result = page.evaluate("window.result")
            result["renderer_peak_mb"], result["renderer_rss_sum_peak_mb"] = peak, rss_sum
            memory = RendererPeak(profile)
            page.reload()
            page.wait_for_function("window.result || window.failure", timeout=timeout_s * 1000, polling=500)
            result["cached_renderer_peak_mb"], result["cached_renderer_rss_sum_peak_mb"] = memory.stop()
            again = page.evaluate("window.result || {}")
            result["cached_load_s"] = again.get("load_s")
            if again.get("load_s") is not None and again.get("ttft_ms") is not None:
                result["cached_first_token_s"] = again["load_s"] + again["ttft_ms"] / 1000
            for field in ("decode_tok_s", "warm_decode_tok_s", "ttft_ms"):
                result[f"cached_{field}"] = again.get(field)
            if engine == "ruvllm":
                result["cached_files"] = again.get("cache")
                result["cached_restored_prompt_blocks"] = again.get("restored_prompt_blocks")
                result["cached_timings"] = again.get("timings")
            if blocked:
                result["off_origin_requests"] = blocked
            return result
        finally:
            ctx.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--engines", default="ruvllm,ruvllm:nolookup,transformers.js:fp32,transformers.js:q8,wllama",
                    help="ruvllm:nolookup is RuvLLM with prompt-lookup speculative decoding off; ruvllm:step on its WASM "
                         "step (backend 'wasm-step'), ruvllm:step.nolookup both; ruvllm:gguf.nolookup opens --gguf's file "
                         "itself (no exported package), as wllama does")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--reload-prompt", choices=("same", "other"), default="same",
                    help="the reload asks the same question as the first visit, or another one (RuvLLM keeps the "
                         "last prompt's K/V blocks across reloads; with 'other' only the shared system prompt's apply)")
    ap.add_argument("--kv", default="fp32", help="RuvLLM's KV pools, each a row: fp32, int8, int4 (fp32,int8,int4)")
    ap.add_argument("--context", type=int, default=0, help="about this many tokens of text before the question")
    ap.add_argument("--gguf", type=Path, help="a GGUF for RuvLLM (exported for the page) and wllama alike, instead "
                    "of SmolLM2")
    ap.add_argument("--raw", action="store_true", help="a text completion of the same words instead of a chat "
                    "(a base model whose GGUF has no chat template: Gemma 3 270M)")
    ap.add_argument("--hf", type=Path, help="with --gguf: the Hugging Face folder the GGUF was converted from, for "
                    "transformers.js (its fp32 weights, the GGUF's before quantization; default: benchmarks/sizes.py's "
                    "SHAPE-hf beside a SHAPE-TYPE.gguf)")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    from wasm.serve import serve_in_thread

    bundle = ROOT / "dist" / "web"
    if not (bundle / "models" / "smollm2-135m" / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "wasm", "build"], cwd=ROOT, check=True, stdout=sys.stderr)
    npm_peers()
    engines = [e.split(":") + [None] if ":" not in e else e.split(":") for e in args.engines.split(",")]
    kvs = args.kv.split(",")
    engines = [(name, dtype, kv) for name, dtype in engines for kv in (kvs if name == "ruvllm" else ["fp32"])]
    tjs = "smollm2-tjs"
    if any(e[0] == "transformers.js" for e in engines):
        if args.gguf:
            hf = args.hf or args.gguf.parent / f"{args.gguf.stem.split('-')[0]}-hf"
            if not (hf / "config.json").exists():
                sys.exit(f"transformers.js with --gguf needs the GGUF's Hugging Face folder: --hf DIR ({hf} has none)")
            tjs = f"{hf.name}-tjs"
            transformersjs_model(hf, tjs)
        else:
            transformersjs_model()
    exported = any(name == "ruvllm" and "gguf" not in (dtype or "").split(".") for name, dtype, _ in engines)
    files = gguf_models(args.gguf, exported) if args.gguf else None
    if any(e[0] == "wllama" for e in engines) and not files:
        wllama_model()
    server, base = serve_in_thread(bundle, {"/bench/": HERE, "/bench-models/": MODELS})
    launch = ["--no-sandbox", "--disable-quic", "--no-first-run", "--disable-background-networking",
              "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
              "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]
    runs: dict[str, list[dict]] = {}
    with sync_playwright() as p:
        for r in range(args.repeats):
            for name, dtype, kv in engines:
                key = (name if not dtype else f"{name}:{dtype}") + (f"[kv {kv}]" if kv != "fp32" else "")
                res = run_one(p, launch, base, name, args.threads, args.tokens, dtype, args.timeout, args.reload_prompt,
                              kv, args.context, files, tjs, args.raw)
                log(f"round {r + 1} {key}: {json.dumps(res)[:300]}")
                runs.setdefault(key, []).append(res)
    server.shutdown()
    summary = {}
    for key, results in runs.items():
        ok = [x for x in results if "error" not in x]

        def med(field: str, ok=ok) -> float | None:
            values = [x[field] for x in ok if x.get(field) is not None]
            return round(statistics.median(values), 2) if values else None
        summary[key] = {"decode_tok_s": med("decode_tok_s"), "warm_decode_tok_s": med("warm_decode_tok_s"),
                        "ttft_ms": med("ttft_ms"), "warm_ttft_ms": med("warm_ttft_ms"), "load_s": med("load_s"),
                        "cached_load_s": med("cached_load_s"), "cached_first_token_s": med("cached_first_token_s"),
                        "cached_decode_tok_s": med("cached_decode_tok_s"),
                        "cached_warm_decode_tok_s": med("cached_warm_decode_tok_s"),
                        "renderer_peak_mb": med("renderer_peak_mb"), "cached_renderer_peak_mb": med("cached_renderer_peak_mb"),
                        "renderer_rss_sum_peak_mb": med("renderer_rss_sum_peak_mb"),
                        "cached_renderer_rss_sum_peak_mb": med("cached_renderer_rss_sum_peak_mb"),
                        "runs": len(ok), "errors": [x["error"] for x in results if "error" in x][:1]}
    ratios = {}
    # first and second generation on a first visit, then the same after a reload (a returning visitor)
    for field in ("decode_tok_s", "warm_decode_tok_s", "cached_decode_tok_s", "cached_warm_decode_tok_s"):
        ours = summary.get("ruvllm", {}).get(field)
        ratios[field] = {k: round(ours / v[field], 2) for k, v in summary.items()
                         if k != "ruvllm" and ours and v.get(field)}
    # the same against RuvLLM without speculative decoding: the engine's speed on text that never repeats
    plain = summary.get("ruvllm:nolookup", {})
    nolookup_ratios = {field: {k: round(plain[field] / v[field], 2) for k, v in summary.items()
                               if not k.startswith("ruvllm") and plain.get(field) and v.get(field)}
                       for field in ("decode_tok_s", "cached_decode_tok_s")} if plain else {}
    # the page's WASM step (backend 'wasm-step') without drafts against the peers
    step = summary.get("ruvllm:step.nolookup", {})
    step_ratios = {field: {k: round(step[field] / v[field], 2) for k, v in summary.items()
                           if not k.startswith("ruvllm") and step.get(field) and v.get(field)}
                   for field in ("decode_tok_s", "cached_decode_tok_s", "ttft_ms")} if step else {}
    # the GGUF opened by the page itself (no exported package), on the step, against the peers
    own = summary.get("ruvllm:gguf.nolookup", {})
    gguf_ratios = {field: {k: round(own[field] / v[field], 2) for k, v in summary.items()
                           if not k.startswith("ruvllm") and own.get(field) and v.get(field)}
                   for field in ("decode_tok_s", "cached_decode_tok_s", "ttft_ms", "load_s", "cached_load_s",
                                 "renderer_peak_mb")} if own else {}
    print(json.dumps({"gguf": str(args.gguf) if args.gguf else None, "threads": args.threads, "tokens": args.tokens, "repeats": args.repeats, "reload_prompt": args.reload_prompt, "summary": summary,
                      "ruvllm_decode_ratio": ratios, "ruvllm_nolookup_decode_ratio": nolookup_ratios,
                      "ruvllm_step_nolookup_ratio": step_ratios, "ruvllm_gguf_nolookup_ratio": gguf_ratios,
                      "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
