"""lm-evaluation-harness against `ruvllm serve` on the real GGUFs, beside lm-eval's own `hf` model on the same
file's fp32 dequantization (transformers' GGUF loader) (not a test; tests/runtime/test_clients.py runs the tiny one).

    python benchmarks/lm_eval_serve.py [--models smollm2,gemma3] [--docs 200] [--lm-eval-python PY]

The task is made here from a local text, so nothing comes from a hub: each document is a sentence of the long
descriptions of installed packages (sona.py's users), cut before one of its words; the choices are that word
and three other words of the same text (seeded). lm-eval (in a venv of its own: --lm-eval-python, default
~/.cache/ruvllm/bench/lm-eval-venv, made with `lm-eval[api]==0.4.13` when missing) scores it with
`local-completions` against `ruvllm serve PKG` (the GGUF exported at its own bits, as `ruvllm` serves it) and with
`hf` on the GGUF itself (`gguf_file`: transformers dequantizes it to fp32). lm-eval's remote tokenizer (the
server's /tokenize) never adds a BOS token, so for a model whose tokenizer adds one (Gemma 3) local-completions
tokenizes with the GGUF's tokenizer as transformers reads it, BOS added, as its hf model does. Prints JSON: each engine's accuracy
(acc, acc_norm), how often both pick the same choice, and how the per-choice log-likelihoods differ (mean and
largest absolute difference; a choice is a word of one to a few tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from real_models import export, gguf_files  # noqa: E402
from sona import USERS, user_text  # noqa: E402

LM_EVAL = "lm-eval[api]==0.4.13"


def cloze_docs(n: int, seed: int = 0) -> list[dict]:
    """Sentences of the users' texts cut before a word (past the sentence's fifth), four choices each."""
    rng = random.Random(seed)
    docs = []
    for user in USERS:
        text = re.sub(r"\s+", " ", re.sub(r"[`*#|<>\[\]()_=]", " ", user_text(user)))
        words = sorted({w for w in re.findall(r"[A-Za-z]{4,}", text)})
        for sentence in re.split(r"(?<=[.!?]) ", text):
            tokens = sentence.split(" ")
            if len(tokens) < 10 or len(words) < 20:
                continue
            at = rng.randrange(5, len(tokens) - 1)
            answer = tokens[at]
            if not re.fullmatch(r"[A-Za-z]{4,}", answer):
                continue
            others = rng.sample([w for w in words if w != answer], 3)
            choices = [answer] + others
            rng.shuffle(choices)
            docs.append({"question": " ".join(tokens[:at]), "choices": [" " + c for c in choices],
                         "answer": choices.index(answer)})
    rng.shuffle(docs)
    return docs[:n]


def hf_tokenizer(gguf: Path, out: Path) -> Path:
    """The GGUF's tokenizer as transformers reads it (what lm-eval's hf model uses), saved as a folder."""
    if not (out / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
    return out


def lm_eval_python(given: str | None) -> str:
    if given:
        return given
    venv = Path.home() / ".cache" / "ruvllm" / "bench" / "lm-eval-venv"
    if not (venv / "bin" / "lm_eval").exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", LM_EVAL], check=True)
    return str(venv / "bin" / "python")


def run_lm_eval(python: str, out: Path, task_dir: Path, model: str, args: str) -> tuple[dict, list[dict], float]:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.monotonic()
    subprocess.run([str(Path(python).parent / "lm_eval"), "--model", model, "--model_args", args, "--tasks",
                    "ruvllm_cloze", "--include_path", str(task_dir), "--output_path", str(out), "--log_samples",
                    "--device", "cpu"], check=True, env=env)
    seconds = time.monotonic() - started
    results = json.loads(next(out.glob("*/results_*.json")).read_text())["results"]["ruvllm_cloze"]
    samples = [json.loads(line) for line in next(out.glob("*/samples_ruvllm_cloze_*.jsonl")).open()]
    return results, samples, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--work", default=str(Path.home() / ".cache" / "ruvllm" / "bench" / "lm-eval"))
    ap.add_argument("--lm-eval-python", default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    python = lm_eval_python(args.lm_eval_python)
    docs = cloze_docs(args.docs)
    (work / "task").mkdir(exist_ok=True)
    (work / "task" / "cloze.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    task = (ROOT / "tests" / "runtime" / "clients" / "local_task.yaml").read_text()  # the test's task, another file
    (work / "task" / "ruvllm_cloze.yaml").write_text(task.format(task="ruvllm_cloze", data=work / "task" / "cloze.jsonl"))
    report = {"date": time.strftime("%Y-%m-%d"), "docs": len(docs), "lm_eval": LM_EVAL, "models": {}}
    for name, gguf in gguf_files(work, args.models.split(",")).items():
        pkg = export(gguf, work / f"{name}-int4", "int4")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = subprocess.Popen([sys.executable, "-m", "runtime", "serve", str(pkg), "--port", str(port),
                                   "--threads", str(args.threads), "--log-level", "warning"], cwd=ROOT)
        try:
            for _ in range(600):
                try:
                    served = json.loads(subprocess.run(["curl", "-s", f"http://127.0.0.1:{port}/v1/models"],
                                                       capture_output=True, text=True).stdout)["data"][0]["id"]
                    break
                except (ValueError, KeyError, IndexError):
                    time.sleep(0.5)
            info = json.loads(subprocess.run(["curl", "-s", f"http://127.0.0.1:{port}/tokenizer_info"],
                                             capture_output=True, text=True).stdout)
            tokens = ""
            if info.get("add_bos_token"):  # lm-eval's remote tokenizer never adds BOS: its HF tokenizer then, as hf's
                tokens = f",tokenizer_backend=huggingface,tokenizer={hf_tokenizer(gguf, work / f'{name}-tokenizer')}," \
                         "add_bos_token=True"
            ours = run_lm_eval(python, work / f"out-{name}-ruvllm", work / "task", "local-completions",
                               f"model={served},base_url=http://127.0.0.1:{port}/v1/completions,num_concurrent=4,"
                               f"max_retries=1{tokens}")
        finally:
            server.terminate()
            server.wait(timeout=60)
        torch_threads = f"OMP_NUM_THREADS={args.threads}"
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        theirs = run_lm_eval(python, work / f"out-{name}-hf", work / "task", "hf",
                             f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32")
        by_doc = {s["doc_id"]: s for s in theirs[1]}
        diffs, same = [], 0
        for s in ours[1]:
            a = [float(r[0][0]) for r in s["resps"]]
            b = [float(r[0][0]) for r in by_doc[s["doc_id"]]["resps"]]
            diffs.extend(abs(x - y) for x, y in zip(a, b))
            same += max(range(len(a)), key=a.__getitem__) == max(range(len(b)), key=b.__getitem__)
        report["models"][name] = {
            "ruvllm": {"acc": ours[0]["acc,none"], "acc_norm": ours[0]["acc_norm,none"], "seconds": round(ours[2], 1)},
            "hf_fp32_of_the_gguf": {"acc": theirs[0]["acc,none"], "acc_norm": theirs[0]["acc_norm,none"],
                                    "seconds": round(theirs[2], 1), "threads": torch_threads},
            "loglikelihood_abs_diff": {"mean": sum(diffs) / len(diffs), "max": max(diffs)},
            "same_choice": same / len(ours[1])}
        print(json.dumps(report["models"][name]), file=sys.stderr)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
