"""Single-stream decode / TTFT of RuvLLM and its peers on SmolLM2-135M, same prompt, same machine, one run.

Peers: onnxruntime-genai (its int4 model builder's output) and llama.cpp (llama-cpp-python, the
Q4_1 GGUF). RuvLLM runs in two packages: its default int4 package (AWQ in blocks of 64, an int4 LM head whose
best tokens are rescored from the fp16 embeddings) and an export in the layout genai's builder writes
(RTN in blocks of 32, plain int4 head: lower quality), so like is also compared with like; the
default package runs as served (prompt-lookup speculative decoding, and the prefix cache, emptied
before each run, so streams submitted together compute their common prompt once) and without either
(like the peers), and
`ruvllm-mlp128` is the default package with the MLP in blocks of 128 (`--mlp-block-size 128`),
`ruvllm-w8a8` an export with `--quant w8a8` (int8 weights and activations: for many streams),
`ruvllm-gptq128` one with `--method awq+gptq --block-size 128` (about the default's quality, wider blocks).
Run: python benchmarks/peers.py [--ruvllm PKG] [--tokens 128] [--repeats 7]
Needs: pip install onnxruntime-genai llama-cpp-python (not project dependencies). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one long paragraph."}]
WORK = Path(os.environ.get("RUVLLM_BENCH_DIR", Path.home() / ".cache" / "ruvllm" / "bench"))


def gguf_path() -> Path:
    from runtime.aliases import embedded_gguf_path

    return embedded_gguf_path()


def hf_folder() -> Path:
    """SmolLM2 dequantized from the GGUF into a plain HF folder (what the genai builder reads)."""
    return dequantized_hf(gguf_path(), WORK / "smollm2-hf")


def dequantized_hf(g: Path, out: Path) -> Path:
    """A GGUF's weights as transformers dequantizes them, in a plain Hugging Face folder (made once)."""
    if not (out / "config.json").exists():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        loaded = AutoModelForCausalLM.from_pretrained(g.parent, gguf_file=g.name)
        cfg = loaded.config
        if hasattr(cfg, "quantization_config"):  # a GGUF-loaded model refuses to save; copy its weights out
            del cfg.quantization_config
        plain = AutoModelForCausalLM.from_config(cfg)
        plain.load_state_dict(loaded.state_dict())
        plain.save_pretrained(out)
        AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name).save_pretrained(out)
    return out


def chat_prompt_ids() -> list[int]:
    from transformers import AutoTokenizer

    enc = AutoTokenizer.from_pretrained(hf_folder()).apply_chat_template(PROMPT, add_generation_prompt=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def genai_model(threads: int) -> Path:
    out = WORK / "genai-int4"
    if not (out / "genai_config.json").exists():
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_folder()),
                        "-o", str(out), "-p", "int4", "-e", "cpu", "-c", str(WORK / "genai-cache")], check=True,
                       stdout=sys.stderr)  # this worker's stdout carries its JSON replies
    return out


def load_genai(tokens: int, threads: int):
    import numpy as np
    import onnxruntime_genai as og

    path = genai_model(threads)
    cfg = og.Config(str(path))
    model = og.Model(cfg)
    prompt_ids = chat_prompt_ids()
    def once() -> dict:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt_ids) + tokens, do_sample=False, min_length=len(prompt_ids) + tokens)
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(np.array(prompt_ids, dtype=np.int32))
        gen.generate_next_token()
        first = time.perf_counter()
        n = 1
        while not gen.is_done() and n < tokens:
            gen.generate_next_token()
            n += 1
        end = time.perf_counter()
        return {"ttft": first - t0, "tps": (n - 1) / (end - first)}
    def batch(streams: int) -> dict:
        """`streams` copies of the prompt decoded together: aggregate tokens per second."""
        params = og.GeneratorParams(model)
        params.set_search_options(batch_size=streams, max_length=len(prompt_ids) + tokens, do_sample=False,
                                  min_length=len(prompt_ids) + tokens)
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(np.array([prompt_ids] * streams, dtype=np.int32))
        gen.generate_next_token()  # every stream's first token: the end of prefill
        first = time.perf_counter()
        n = 1
        while not gen.is_done() and n < tokens:
            gen.generate_next_token()
            n += 1
        end = time.perf_counter()
        return {"streams": streams, "aggregate_tps": streams * n / (end - t0),
                "aggregate_decode_tps": streams * (n - 1) / (end - first)}
    once.batch = batch
    return "onnxruntime-genai int4", once


def load_llamacpp(tokens: int, threads: int):
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf_path()), n_threads=threads, n_ctx=2048, verbose=False)
    prompt_ids = chat_prompt_ids()
    def once() -> dict:
        llm.reset()
        t0 = time.perf_counter()
        first = None
        n = 0
        for _tok in llm.generate(prompt_ids, temp=0.0, top_k=1, reset=True):
            n += 1
            if first is None:
                first = time.perf_counter()
            if n >= tokens:
                break
        end = time.perf_counter()
        return {"ttft": first - t0, "tps": (n - 1) / (end - first)}
    once.batch = lambda streams: llamacpp_batch(llm, prompt_ids, streams, tokens, threads)
    return "llama.cpp Q4_1", once


def batch_decoder(ctx, batch):
    """decode(entries): one llama_decode of `batch` filled with (token, position, sequence, want logits)."""
    import llama_cpp as L

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        batch.n_tokens = len(entries)
        for i, (tok, pos, seq, want) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, int(want)
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
    return decode


def llamacpp_batch(llm, prompt_ids: list[int], streams: int, tokens: int, threads: int,
                   trace: list | None = None) -> dict:
    """`streams` copies of the prompt as parallel sequences of one llama.cpp context (its server's way
    to batch): one llama_decode per step with a token of every sequence, greedy argmax per sequence. Each
    sequence has a KV stream of its own (not unified: there every sequence's attention would span all
    sequences' cells, masked, which slows llama.cpp as streams grow and flatters RuvLLM).
    trace, if given, receives every step's tokens (to check them against single-stream greedy)."""
    import ctypes

    import llama_cpp as L
    import numpy as np

    params = L.llama_context_default_params()
    params.n_ctx = streams * (len(prompt_ids) + tokens + 16)  # split evenly between the streams
    params.n_batch = params.n_ubatch = max(512, streams * len(prompt_ids))
    params.n_seq_max = streams
    params.kv_unified = False
    params.n_threads = params.n_threads_batch = threads
    ctx = L.llama_init_from_model(llm._model.model, params)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(llm._model.model))
    batch = L.llama_batch_init(params.n_batch, 0, 1)
    decode = batch_decoder(ctx, batch)

    def next_tokens(rows: list[int]) -> list[int]:
        out = []
        for r in rows:
            ptr = L.llama_get_logits_ith(ctx, r)
            out.append(int(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (vocab,)).argmax()))
        return out

    try:
        t0 = time.perf_counter()
        last = len(prompt_ids) - 1
        decode([(tok, pos, seq, pos == last) for seq in range(streams) for pos, tok in enumerate(prompt_ids)])
        toks = next_tokens([seq * len(prompt_ids) + last for seq in range(streams)])
        first = time.perf_counter()
        if trace is not None:
            trace.append(toks)
        for step in range(1, tokens):
            decode([(toks[seq], len(prompt_ids) + step - 1, seq, True) for seq in range(streams)])
            toks = next_tokens(list(range(streams)))
            if trace is not None:
                trace.append(toks)
        end = time.perf_counter()
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
    return {"streams": streams, "aggregate_tps": streams * tokens / (end - t0),
            "aggregate_decode_tps": streams * (tokens - 1) / (end - first)}


# RuvLLM's other exports of SmolLM2 (name -> exporter flags): genai's layout (RTN, blocks of 32, plain
# int4 LM head: what genai's builder writes); the MLP in blocks of 128 (faster, a little further from fp32);
# int8 weights with per-row int8 activations (see docs/PERFORMANCE.md)
VARIANTS = {
    "ruvllm-int4-genai-layout": ["--quant", "int4", "--method", "rtn", "--block-size", "32", "--head-quant", "int4",
                                 "--head-rescore", "0"],
    "ruvllm-int4-mlp128": ["--quant", "int4", "--mlp-block-size", "128"],
    "ruvllm-w8a8": ["--quant", "w8a8"],
    "ruvllm-int4-awq-gptq128": ["--quant", "int4", "--method", "awq+gptq", "--block-size", "128"],
}
ROWS = {"ruvllm-genai-layout": "ruvllm-int4-genai-layout", "ruvllm-mlp128": "ruvllm-int4-mlp128",
        "ruvllm-w8a8": "ruvllm-w8a8", "ruvllm-gptq128": "ruvllm-int4-awq-gptq128"}  # row -> its VARIANTS export


def variant_package(name: str) -> Path:
    """One of VARIANTS, exported once."""
    out = WORK / name
    if not (out / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "exporter", "convert", "smollm2-135m", "-o", str(out), *VARIANTS[name],
                        "--no-lora", "--quiet"], check=True, stdout=subprocess.DEVNULL)
    return out


def load_ruvllm(pkg: str | None, tokens: int, threads: int, lookup: bool = True):
    """lookup=True is the engine as served: prompt-lookup drafts and the prefix cache, emptied before
    every run (a repeat would otherwise find its prompt cached), so 16 copies of the prompt submitted
    together compute it once. lookup=False is like for like with the peers: neither."""
    from runtime.core.engine import Engine
    from runtime.core.sampling import SamplingParams
    from runtime.resolve import resolve_package

    engine = Engine.from_package(resolve_package(pkg), threads=threads, max_num_seqs=64, enable_prefix_cache=lookup,
                                 **({} if lookup else {"speculative_tokens": 0}))

    def batch(streams: int) -> dict:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        engine.reset_prefix_cache()
        t0 = time.perf_counter()
        ids = [engine.add_request(messages=PROMPT, params=SamplingParams(**vars(params))) for _ in range(streams)]
        started: set[str] = set()
        n = after = 0
        first = None
        while engine.has_unfinished():
            outs = engine.step()
            n += len(outs)
            if first is None:
                started.update(o.request_id for o in outs)
                if len(started) == len(ids):  # every stream has its first token: the end of prefill
                    first = time.perf_counter()
            else:
                after += len(outs)
        end = time.perf_counter()
        return {"streams": streams, "aggregate_tps": n / (end - t0),
                "aggregate_decode_tps": after / (end - first) if first and end > first else None}

    def once() -> dict:
        engine.reset_prefix_cache()
        t0 = time.perf_counter()
        first = None
        n = 0
        for out in engine.generate(params=SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
                                   messages=PROMPT):
            n = out.completion_tokens
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        return {"ttft": first - t0, "tps": (n - 1) / (end - first)}
    once.batch = batch
    quant = engine.pkg.manifest["quantization"]
    if quant.get("lm_head_rescore"):
        head = f"{quant['lm_head']} head, best {quant['lm_head_rescore']['top']} rescored"
    else:
        head = f"{quant.get('lm_head')} head"
    method = f" {quant['method']}/{quant['block_size']}" if "method" in quant else ""
    if quant.get("activations"):  # w8a8
        method = f" w8a8 (head{method})"
    if quant.get("mlp_block_size"):
        method += f" (MLP {quant['mlp_block_size']})"
    spec = (f", prompt lookup {engine.config.speculative_tokens}, prefix cache" if engine.config.speculative_tokens
            else ", no lookup, no prefix cache")
    return f"ruvllm {quant['weights']}{method} ({head}{spec})", once


def worker(name: str, args) -> None:
    """Load one engine, then time one run per line read from stdin (a JSON line back per run)."""
    loaders = {"ruvllm": lambda: load_ruvllm(args.ruvllm, args.tokens, args.threads),
               "ruvllm-nolookup": lambda: load_ruvllm(args.ruvllm, args.tokens, args.threads, lookup=False),
               "genai": lambda: load_genai(args.tokens, args.threads),
               "llamacpp": lambda: load_llamacpp(args.tokens, args.threads)}
    for row, variant in ROWS.items():  # the variants run without drafts, like the peers
        loaders[row] = lambda v=variant: load_ruvllm(str(variant_package(v)), args.tokens, args.threads, lookup=False)
    try:
        label, once = loaders[name]()
        once()  # warm-up
    except ImportError as err:
        print(json.dumps({"error": f"not installed: {err.name}"}), flush=True)
        return
    print(json.dumps({"label": label}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd and cmd[0] == "batch":
            batch = getattr(once, "batch", None)
            print(json.dumps(batch(int(cmd[1])) if batch else {"error": "no batch mode"}), flush=True)
        else:
            print(json.dumps(once()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ruvllm", default=None, help="package (default: the cached embedded int4 model)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--only", default="ruvllm,ruvllm-nolookup,ruvllm-genai-layout,genai,llamacpp")
    ap.add_argument("--batch", type=int, default=16, help="also measure this many streams decoded together (0: skip)")
    ap.add_argument("--batch-repeats", type=int, default=3)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    WORK.mkdir(parents=True, exist_ok=True)
    if args.worker:
        return worker(args.worker, args)
    # One process per engine, so no engine's idle thread pool spins on a core while another is timed.
    base = [sys.executable, __file__, "--tokens", str(args.tokens), "--threads", str(args.threads)]
    if args.ruvllm:
        base += ["--ruvllm", args.ruvllm]
    procs, results = {}, []
    for name in args.only.split(","):
        proc = subprocess.Popen(base + ["--worker", name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        first = json.loads(proc.stdout.readline())
        if "error" in first:
            results.append({"engine": name, **first})
            proc.wait()
            continue
        if first["label"] in procs:
            raise SystemExit(f"two engines are both labelled {first['label']!r}")
        procs[first["label"]] = proc
    runs: dict[str, list[dict]] = {label: [] for label in procs}
    order = list(procs.items())

    def rotated(r: int) -> list:
        """Round r's order: each engine takes each place in turn (the first place measured low here)."""
        return order[r % len(order):] + order[:r % len(order)]
    for r in range(args.repeats):  # interleaved rounds: slow phases of the host hit every engine alike
        for label, proc in rotated(r):
            time.sleep(0.3)
            proc.stdin.write("run\n")
            proc.stdin.flush()
            runs[label].append(json.loads(proc.stdout.readline()))
    batches: dict[str, list[float]] = {label: [] for label in procs}
    batch_decode: dict[str, list[float]] = {label: [] for label in procs}
    for r in range(args.batch_repeats if args.batch else 0):
        for label, proc in rotated(r):
            time.sleep(0.3)
            proc.stdin.write(f"batch {args.batch}\n")
            proc.stdin.flush()
            r = json.loads(proc.stdout.readline())
            if "aggregate_tps" in r:
                batches[label].append(r["aggregate_tps"])
            if r.get("aggregate_decode_tps"):
                batch_decode[label].append(r["aggregate_decode_tps"])
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()
    for label, rs in runs.items():
        results.append({"engine": label,
                        "decode_tps_median": round(statistics.median(r["tps"] for r in rs), 1),
                        "decode_tps_best": round(max(r["tps"] for r in rs), 1),
                        "ttft_ms_median": round(1000 * statistics.median(r["ttft"] for r in rs), 1),
                        **({f"batch{args.batch}_aggregate_tps_median": round(statistics.median(batches[label]), 1)}
                           if batches.get(label) else {}),
                        **({f"batch{args.batch}_aggregate_decode_tps_median":
                            round(statistics.median(batch_decode[label]), 1)} if batch_decode.get(label) else {})})
    print(json.dumps({"threads": args.threads, "decode_tokens": args.tokens, "repeats": args.repeats,
                      "results": results}, indent=2))


if __name__ == "__main__":
    main()
