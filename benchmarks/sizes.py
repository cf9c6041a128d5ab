"""The size sweep: RuvLLM and llama.cpp on the same GGUF files of real shapes, one run (not a test).

    python benchmarks/sizes.py [--shapes qwen0.5b,llama1b] [--types Q4_K_M,Q8_0] [--quality]

For each shape a random-weight transformers model with SmolLM2's vocabulary is written (config,
tokenizer, safetensors shard by shard: never the whole model in memory), converted to an F16 GGUF by
llama.cpp's own `convert_hf_to_gguf.py` and quantized to each type by its own quantizer
(`llama_cpp.llama_model_quantize`): what a user downloads. The converter comes from the
llama-cpp-python sdist (fetched once from the package index into the work folder); the quantizer and
the peer engine from the installed llama-cpp-python (`pip install llama-cpp-python`; not a project
dependency; on a host where its native build dies of SIGILL, as it did on a Sapphire Rapids-class VM, build it
for the ISA by name: `CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON" pip install llama-cpp-python`).
Two fixes to the converter, applied in its process: it would take the `llama_hf` vocab path for a BPE tokenizer.json (an SPM-style vocabulary that crashes llama.cpp's tokenizer), and it
does not know SmolLM2's pre-tokenizer hash: the gpt2 path and the `smollm` pre-tokenizer are forced.

Then RuvLLM exports each file (`python -m exporter convert`: wall time, peak RSS, package size), and
each engine, in a process of its own on --threads threads, measures: load to first token, one stream's
decode tok/s (greedy, no drafts), TTFT of a 512-token prompt, aggregate decode tok/s of 16 streams,
and the process's peak RSS (and the GB/s of the file's weights one stream reads: every matrix but the
embedding table, which is read whole only as a tied head); llama.cpp first, then RuvLLM, per file. --quality adds the relative
error of each engine's teacher-forced logits over 512 tokens against RuvLLM's fp32 export of the same
file (the file's exact dequantization; random weights make KL meaningless: their softmax is nearly flat).
Prints JSON and keeps every file in --work (default ~/.cache/ruvllm/bench/sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LLAMA_CPP_VERSION = "0.3.36"

# real widths (Qwen2.5-0.5B, Llama-3.2-1B/3B, Mistral-7B), SmolLM2's vocabulary
SHAPES = {
    "qwen0.5b": dict(arch="qwen2", hidden=896, inter=4864, layers=24, heads=14, kv=2, tied=True, theta=1e6),
    "llama1b": dict(arch="llama", hidden=2048, inter=8192, layers=16, heads=32, kv=8, tied=True, theta=5e5),
    "llama3b": dict(arch="llama", hidden=3072, inter=8192, layers=28, heads=24, kv=8, tied=True, theta=5e5),
    "mistral7b": dict(arch="mistral", hidden=4096, inter=14336, layers=32, heads=32, kv=8, tied=False, theta=1e6),
}
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_S": 11, "Q3_K_M": 12,
          "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18}


def peak_rss_mb() -> int:
    """This process's peak resident memory so far (VmHWM), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    return 0


def run(cmd: list[str], **kw) -> tuple[float, int]:
    """Run a command; (wall seconds, its peak RSS in MB)."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, **kw)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(map(str, cmd))}")
    return time.perf_counter() - started, usage.ru_maxrss // 1024


def smol_tokenizer(work: Path) -> Path:
    out = work / "smol-tokenizer"
    if not (out / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        from runtime.aliases import embedded_gguf_path

        g = embedded_gguf_path()
        AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name).save_pretrained(out)
    return out


def hf_folder(work: Path, name: str) -> Path:
    """A random-weight model of the shape, written one layer at a time (fp16 safetensors shards)."""
    import numpy as np
    from safetensors.numpy import save_file

    s = SHAPES[name]
    out = work / f"{name}-hf"
    if (out / "model.safetensors.index.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = smol_tokenizer(work)
    for f in tok.iterdir():
        shutil.copy(f, out / f.name)
    vocab, h, d = 49152, s["hidden"], s["hidden"] // s["heads"]
    arch = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}[s["arch"]]
    config = {"architectures": [arch], "model_type": s["arch"], "hidden_size": h, "intermediate_size": s["inter"],
              "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"], "num_key_value_heads": s["kv"],
              "head_dim": d, "vocab_size": vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
              "rope_theta": s["theta"], "tie_word_embeddings": s["tied"], "hidden_act": "silu", "bos_token_id": 1,
              "eos_token_id": 2, "torch_dtype": "float16", "initializer_range": 0.02}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    rng = np.random.default_rng(0)
    rand = lambda *shape: (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)  # noqa: E731
    norm = lambda: (1 + 0.1 * rng.standard_normal(h, dtype=np.float32)).astype(np.float16)  # noqa: E731
    index = {}

    def shard(file: str, tensors: dict) -> None:  # written as made: one layer in memory at a time
        save_file(tensors, str(out / file))
        index.update(dict.fromkeys(tensors, file))

    shard("model-embed.safetensors", {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": norm(),
                                      **({} if s["tied"] else {"lm_head.weight": rand(vocab, h)})})
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        t = {p + "self_attn.q_proj.weight": rand(s["heads"] * d, h), p + "self_attn.k_proj.weight": rand(s["kv"] * d, h),
             p + "self_attn.v_proj.weight": rand(s["kv"] * d, h), p + "self_attn.o_proj.weight": rand(h, s["heads"] * d),
             p + "mlp.gate_proj.weight": rand(s["inter"], h), p + "mlp.up_proj.weight": rand(s["inter"], h),
             p + "mlp.down_proj.weight": rand(h, s["inter"]), p + "input_layernorm.weight": norm(),
             p + "post_attention_layernorm.weight": norm()}
        if s["arch"] == "qwen2":
            for x, n in (("q", s["heads"]), ("k", s["kv"]), ("v", s["kv"])):
                t[p + f"self_attn.{x}_proj.bias"] = rand(n * d)
        shard(f"model-{i:03d}.safetensors", t)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return out


def llama_cpp_dir(work: Path) -> Path:
    """The llama.cpp sources in the llama-cpp-python sdist (its converter and its gguf-py)."""
    out = work / f"llama_cpp_python-{LLAMA_CPP_VERSION}" / "vendor" / "llama.cpp"
    if not (out / "convert_hf_to_gguf.py").exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(work),
                        f"llama-cpp-python=={LLAMA_CPP_VERSION}"], check=True, stdout=subprocess.DEVNULL)
        with tarfile.open(work / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz") as tar:
            tar.extractall(work, filter="data")
    return out


CONVERT = """
import runpy, sys
src, model, out = sys.argv[1:4]
sys.path.insert(0, src)
sys.path.insert(1, src + "/gguf-py")
import conversion.base as base, conversion.llama as llama
llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()  # not the llama_hf path (see the docstring)
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
sys.argv = ["convert_hf_to_gguf.py", model, "--outfile", out, "--outtype", "f16"]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def gguf_file(work: Path, name: str, qtype: str) -> Path:
    f16 = work / f"{name}-F16.gguf"
    if not f16.exists():
        hf = work / f"{name}-hf"
        if not (hf / "model.safetensors.index.json").exists():  # in its own process: a child's peak RSS counts
            run([sys.executable, __file__, "--make-hf", name, "--work", str(work)])  # what it inherits at fork
        run([sys.executable, "-c", CONVERT, str(llama_cpp_dir(work)), str(hf), str(f16)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = work / f"{name}-{qtype}.gguf"
    if not out.exists():  # in a process of its own: llama.cpp logs every tensor on the standard streams
        run([sys.executable, "-c", QUANTIZE, str(f16), str(out), str(FTYPES[qtype])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


QUANTIZE = """
import os, sys
import llama_cpp as L
params = L.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
params.nthread = os.cpu_count() or 2
sys.exit(L.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params))
"""


def export(work: Path, gguf: Path, quant: str = "int4") -> dict:
    out = work / f"pkg-{gguf.stem}-{quant}"
    seconds, rss = run([sys.executable, "-m", "exporter", "convert", str(gguf), "-o", str(out), "--quant", quant,
                        "--no-lora", "--quiet"], env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL)
    size = sum(f.stat().st_size for f in out.iterdir())
    return {"package": str(out), "export_s": round(seconds, 1), "export_peak_rss_mb": rss,
            "package_mb": round(size / 2**20), "gguf_mb": round(gguf.stat().st_size / 2**20),
            "package_to_gguf": round(size / gguf.stat().st_size, 3)}


def bytes_per_token(gguf: Path) -> int:
    """The file's bytes one decode step reads: every matrix but the embedding table (a step gathers a few of
    its rows), and that table too where it is the tied LM head."""
    import gguf as gguf_py

    tensors = {t.name: int(t.n_bytes) for t in gguf_py.GGUFReader(str(gguf)).tensors if len(t.shape) > 1}
    read = sum(n for name, n in tensors.items() if name != "token_embd.weight")
    return read + (tensors.get("token_embd.weight", 0) if "output.weight" not in tensors else 0)


def prompt_ids(n: int) -> list[int]:
    import random

    rng = random.Random(n)
    return [rng.randrange(100, 40000) for _ in range(n)]


def worker(engine: str, path: str, tokens: int, streams: int, threads: int, quality_ids: list[int] | None) -> dict:
    """One engine on one file: every measurement, in this process."""
    started = time.perf_counter()
    short, long = prompt_ids(32), prompt_ids(512)
    out: dict = {}
    if engine == "llama.cpp":
        from llama_cpp import Llama

        from benchmarks.peers import llamacpp_batch

        llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=2048, n_batch=512,
                    verbose=False)

        def one(ids: list[int], n: int) -> tuple[float, float]:
            llm.reset()
            t0 = time.perf_counter()
            first, count = None, 0
            for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):
                count += 1
                first = first or time.perf_counter()
                if count >= n:
                    break
            return first - t0, (count - 1) / (time.perf_counter() - first)

        out["load_to_first_token_s"] = round(one(short, 1)[0] + (time.perf_counter() - started), 2)
        batch = lambda: llamacpp_batch(llm, short, streams, tokens, threads)["aggregate_decode_tps"]  # noqa: E731

        def logits(ids: list[int]):  # after the peak RSS is read: every position's logits cost memory
            import numpy as np

            full = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512,
                         verbose=False, logits_all=True)
            full.eval(ids)
            return np.asarray(full.scores[:len(ids)], np.float32)
    else:
        from runtime.core.engine import Engine
        from runtime.core.sampling import SamplingParams

        engine_ = Engine.from_package(path, threads=threads, max_num_seqs=max(streams, 1), enable_prefix_cache=False,
                                      speculative_tokens=0)

        def one(ids: list[int], n: int) -> tuple[float, float]:
            t0 = time.perf_counter()
            first = None
            count = 0
            for o in engine_.generate(ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)):
                count = o.completion_tokens
                first = first or time.perf_counter()
            return first - t0, (count - 1) / max(time.perf_counter() - first, 1e-9)

        out["load_to_first_token_s"] = round(one(short, 1)[0] + (time.perf_counter() - started), 2)

        def batch() -> float:
            params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
            for _ in range(streams):
                engine_.add_request(short, SamplingParams(**vars(params)))
            n = after = 0
            first = None
            while engine_.has_unfinished():
                outs = engine_.step()
                n += len(outs)
                if first is None and n >= streams:
                    first = time.perf_counter()
                elif first is not None:
                    after += len(outs)
            return after / (time.perf_counter() - first)

        def logits(ids: list[int]):  # after the peak RSS is read: a second session on the package
            from exporter.evaluate import teacher_forced_logits

            return teacher_forced_logits(path, ids)
    import statistics

    out["decode_tok_s"] = round(statistics.median(one(short, tokens)[1] for _ in range(3)), 1)
    out["ttft_512_ms"] = round(1000 * min(one(long, 1)[0] for _ in range(2)))
    if streams > 1:
        out[f"aggregate_decode_tok_s_{streams}"] = round(batch(), 1)
    out["peak_rss_mb"] = peak_rss_mb()
    if quality_ids is not None:
        out["logits"] = logits(quality_ids)
    return out


def measure(engine: str, path: str, args, quality_ids: list[int] | None = None) -> dict:
    """worker() in a process of its own (this script with --worker); --quality's logits come back
    through a .npy file."""
    import numpy as np

    tmp = Path(args.work) / "logits.npy"
    cmd = [sys.executable, __file__, "--worker", engine, "--path", path, "--tokens", str(args.tokens),
           "--streams", str(args.streams), "--threads", str(args.threads), "--work", str(args.work)]
    if quality_ids is not None:
        cmd.append("--quality")
    # from compiled bytecode, as an installed package runs (a PYTHONDONTWRITEBYTECODE host would compile
    # RuvLLM's sources at every start, while llama-cpp-python's came compiled with its wheel)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**env, "HF_HUB_OFFLINE": "1"})
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else str(proc.returncode)}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if quality_ids is not None and tmp.exists():
        result["logits"] = np.load(tmp)
        tmp.unlink()
    return result


def relative_error(test, ref) -> float:
    import numpy as np

    return round(float(np.sqrt(np.mean((test - ref) ** 2)) / np.sqrt(np.mean(ref ** 2))), 5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen0.5b,llama1b", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--types", default="Q4_K_M", help=f"of {', '.join(FTYPES)}")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="llama.cpp,ruvllm")
    ap.add_argument("--quality", action="store_true", help="teacher-forced logits against the fp32 export")
    ap.add_argument("--work", default=str(Path.home() / ".cache" / "ruvllm" / "bench" / "sizes"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--make-hf", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make_hf:
        hf_folder(Path(args.work), args.make_hf)
        return
    if args.worker:  # measure() runs each engine so
        import numpy as np

        result = worker(args.worker, args.path, args.tokens, args.streams, args.threads,
                        prompt_ids(512) if args.quality else None)
        logits = result.pop("logits", None)
        if logits is not None:
            np.save(Path(args.work) / "logits.npy", logits)
        print(json.dumps(result))
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    import compileall

    compileall.compile_dir(str(ROOT / "runtime"), quiet=1)  # the workers run RuvLLM from bytecode (measure())
    results = []
    for name in args.shapes.split(","):
        ids = prompt_ids(512) if args.quality else None
        for qtype in args.types.split(","):
            gguf = gguf_file(work, name, qtype)
            row = {"shape": name, "type": qtype, **export(work, gguf)}
            per_token = bytes_per_token(gguf)
            ref = None
            if args.quality:  # the file's exact dequantization: RuvLLM's fp32 export of the same file
                fp32 = export(work, gguf, "fp32")
                ref = measure("ruvllm", fp32["package"], argparse.Namespace(**{**vars(args), "streams": 1}), ids)
                ref = ref.get("logits")
                shutil.rmtree(fp32["package"], ignore_errors=True)
            for engine in args.engines.split(","):
                path = str(gguf) if engine == "llama.cpp" else row["package"]
                got = measure(engine, path, args, ids)
                logits = got.pop("logits", None)
                if ref is not None and logits is not None:
                    got["logit_rel_error_vs_fp32"] = relative_error(logits, ref)
                if "decode_tok_s" in got:  # the file's weights streamed per second by one stream
                    got["weights_gb_s"] = round(got["decode_tok_s"] * per_token / 1e9, 1)
                row[engine] = got
            print(json.dumps(row), file=sys.stderr, flush=True)
            results.append(row)
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "tokens": args.tokens,
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
