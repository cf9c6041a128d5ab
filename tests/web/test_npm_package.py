"""`npm pack` of web/: the tarball holds what web/README.md says, and a page runs the engine from it."""

from __future__ import annotations

import json
import subprocess
import tarfile
from urllib.parse import urlparse

import pytest

from tests.conftest import ROOT
from tests.web.conftest import CHAT, LOAD_ENGINE, publish

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tarball(web_bundle, workdir):
    """web/ packed after the bundle build (which puts the Python wheels into web/python/), unpacked at /npm/."""
    dest = workdir / "npm"
    dest.mkdir(exist_ok=True)
    proc = subprocess.run(["npm", "pack", "--json", "--pack-destination", str(dest)], cwd=ROOT / "web",
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)[0]
    with tarfile.open(dest / report["filename"]) as tar:
        tar.extractall(dest, filter="data")
    return report


def test_tarball_holds_what_the_readme_says(tarball):
    files = {f["path"] for f in tarball["files"]}
    for name in ("README.md", "package.json", "src/index.js", "src/index.d.ts", "src/worker.js", "src/ort_worker.js", "src/remote_runner.js", "src/step_runner.js",
                 "src/kv_pool.js", "src/model_store.js", "src/prompt_kv.js", "src/warmup.onnx", "src/warmup.json", "src/wasm_step.js",
                 "src/step.wasm", "src/step-simd128.wasm", "src/step-threads.wasm", "src/step_helper.js",
                 "python/pyodide-lock.json"):
        assert name in files, sorted(files)
    readme = (ROOT / "web" / "README.md").read_text()
    for name in files:
        if name.startswith("src/"):
            assert name in readme, f"README does not mention {name}"
    lock = json.loads(next(p for p in [ROOT / "web" / "python" / "pyodide-lock.json"]).read_text())
    for pkg in ("ruvllm", "jinja2", "markupsafe", "micropip"):
        assert f"python/{lock['packages'][pkg]['file_name']}" in files
    meta = json.loads((ROOT / "web" / "package.json").read_text())
    assert meta["name"] == "ruvllm-web" and meta["types"] == "./src/index.d.ts"
    assert set(meta["dependencies"]) == {"pyodide", "onnxruntime-web"}


def test_a_page_runs_the_engine_from_the_tarball(tarball, offline_page, tiny_package, web_models):
    url = publish(web_models, tiny_package("llama", "fp32"), "tiny-llama-fp32")
    p = offline_page()
    p.goto("/test/api.html?from=npm")
    p.page.wait_for_function("window.apiReady || window.apiError")
    assert p.evaluate("window.apiError || null") is None
    info = p.evaluate(LOAD_ENGINE, [url, {"pyodideURL": "/node_modules/pyodide/",
                                          "ortURL": "/node_modules/onnxruntime-web/dist/"}])
    assert info["device"] == "wasm"
    reply = p.evaluate(CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0})
    assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] == 6
    # the worker, the runtime (the Python snapshot holding it) and Pyodide came from the tarball and
    # node_modules, not the bundle
    assert any("/npm/package/src/worker.js" in u for u in p.requests)
    assert info["python"] == "snapshot" and any("/npm/package/python/python-snapshot.bin.gz" in u for u in p.requests)
    assert any("/node_modules/pyodide/pyodide.asm.wasm" in u for u in p.requests)
    assert not any(urlparse(u).path.startswith("/ruvllm/") for u in p.requests)
