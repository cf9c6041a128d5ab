"""The clients people point at a local server, run against `ruvllm serve` (docs/CLIENTS.md): each installed
into a venv of its own, never a RuvLLM dependency."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import made_once

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent / "clients"
LM_EVAL = "lm-eval[api]==0.4.13"


def client_venv(shared: Path, name: str, *packages: str) -> Path:
    """A venv of this run's (with the test environment's own packages visible: torch, transformers)."""
    def make(path: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(path)], check=True)
        subprocess.run([str(path / "bin" / "pip"), "install", "-q", *packages], check=True, timeout=900)

    return made_once(shared, shared / f"venv-{name}", make)


def lm_eval(venv: Path, out: Path, task_dir: Path, model: str, args: str) -> list[dict]:
    """lm_eval on the local task; its logged samples."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([str(venv / "bin" / "lm_eval"), "--model", model, "--model_args", args, "--tasks", "ruvllm_mc",
                           "--include_path", str(task_dir), "--output_path", str(out), "--log_samples",
                           "--device", "cpu"], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in open(glob.glob(f"{out}/*/samples_ruvllm_mc_*.jsonl")[0])]


def test_lm_eval_local_completions_scores_as_its_own_hf_model(shared, tiny_model_dir, tiny_package, tmp_path):
    """lm-evaluation-harness's `local-completions` against `ruvllm serve` (loglikelihoods through
    /v1/completions with echo, logprobs and max_tokens; tokens through /tokenize, which it finds by itself): the
    same accuracy and per-choice log-likelihoods as lm-eval's `hf` model on the same fp32 weights."""
    from runtime.serve.server import create_app, load_models
    from tests.runtime.test_server import LiveServer

    venv = client_venv(shared, "lm-eval", LM_EVAL)
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "ruvllm_mc.yaml").write_text(
        (HERE / "local_task.yaml").read_text().format(task="ruvllm_mc", data=HERE / "ruvllm_mc.jsonl"))
    models = load_models([str(tiny_package("llama"))], "cpu", 32, {})
    live = LiveServer(create_app(models))
    try:
        served = lm_eval(venv, tmp_path / "served", tmp_path / "task", "local-completions",
                         f"model={next(iter(models))},base_url={live.url}/v1/completions,num_concurrent=2,max_retries=1")
    finally:
        live.stop()
    hf = lm_eval(venv, tmp_path / "hf", tmp_path / "task", "hf", f"pretrained={tiny_model_dir('llama')},dtype=float32")
    by_doc = {s["doc_id"]: s for s in hf}
    assert len(served) == len(hf) == 8
    for s in served:
        ours = [float(r[0][0]) for r in s["resps"]]
        theirs = [float(r[0][0]) for r in by_doc[s["doc_id"]]["resps"]]
        assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-3, (s["doc_id"], ours, theirs)
        assert s["acc"] == by_doc[s["doc_id"]]["acc"]


def test_the_ollama_client_chats_streams_lists_and_formats(shared, tiny_package):
    """The official `ollama` Python client against `ruvllm serve`'s Ollama API: the model listed and shown, a
    chat whole and streamed (the same greedy text as OpenAI's endpoint), a raw generate, `format` with a schema,
    `options` through the sampling fields' declaration, counts and durations; errors as Ollama gives them."""
    import httpx

    from runtime.serve.server import create_app, load_models
    from tests.runtime.test_server import LiveServer

    venv = client_venv(shared, "ollama", "ollama==0.6.3")
    models = load_models([str(tiny_package("llama"))], "cpu", 32, {})
    name = next(iter(models))
    live = LiveServer(create_app(models))
    try:
        proc = subprocess.run([str(venv / "bin" / "python"), str(HERE / "ollama_client.py"), live.url, name],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = json.loads(proc.stdout)
        openai = httpx.post(live.url + "/v1/chat/completions", json={
            "model": name, "messages": [{"role": "user", "content": "Tell me about the sea."}], "temperature": 0,
            "max_tokens": 12, "seed": 7}, timeout=120).json()
    finally:
        live.stop()
    assert got["listed"] == got["running"] == [f"{name}:latest"] and got["family"] == "llama"
    assert "completion" in got["capabilities"]
    assert got["chat"] == got["streamed"] == openai["choices"][0]["message"]["content"] and got["chat"]
    prompt_tokens, eval_count, reason = got["chat_counts"]
    assert eval_count == openai["usage"]["completion_tokens"] and prompt_tokens == openai["usage"]["prompt_tokens"]
    assert reason in ("stop", "length") and got["chat_durations"][0] >= got["chat_durations"][1] > 0
    assert got["streamed_last"][0] is True and got["streamed_last"][1] == eval_count and got["streamed_last"][2] > 2
    assert got["generate"][0] and got["generate"][1] > 0
    assert len(json.loads(got["formatted"])["name"]) <= 8  # the schema enforced
    assert got["missing"][0] == 404 and "not found" in got["missing"][1]
    assert got["mirostat"][0] == 400 and "mirostat" in got["mirostat"][1]
