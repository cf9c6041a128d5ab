"""The offline bundle's own promises, checked on disk: a lock with real hashes, nothing off-origin, a small model."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import zipfile

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.slow


def test_lock_names_every_wheel_with_its_real_sha256(web_bundle):
    lock = json.loads((web_bundle / "python" / "pyodide-lock.json").read_text())
    assert lock["info"]["python"].startswith("3.")
    assert set(lock["packages"]) == {"ruvllm", "jinja2", "markupsafe", "micropip"}
    for entry in lock["packages"].values():
        wheel = web_bundle / "python" / entry["file_name"]
        assert hashlib.sha256(wheel.read_bytes()).hexdigest() == entry["sha256"]
        assert entry["file_name"].endswith("-py3-none-any.whl")


def test_markupsafe_is_pure_python_and_the_runtime_wheel_has_no_native_code(web_bundle):
    lock = json.loads((web_bundle / "python" / "pyodide-lock.json").read_text())
    for name in ("markupsafe", "ruvllm"):
        with zipfile.ZipFile(web_bundle / "python" / lock["packages"][name]["file_name"]) as z:
            names = z.namelist()
        assert not [n for n in names if n.endswith((".so", ".c", ".pyd"))]
    assert "runtime/backends/web.py" in names and "runtime/core/engine.py" in names


def test_the_imported_wheels_carry_bytecode_for_pyodides_python(web_bundle):
    """Every module of the wheels the page imports has a hash-checked .pyc for Pyodide's Python version,
    listed in the wheel's RECORD, so Pyodide does not compile them on every load."""
    lock = json.loads((web_bundle / "python" / "pyodide-lock.json").read_text())
    major, minor = lock["info"]["python"].split(".")[:2]
    tag = f"cpython-{major}{minor}"
    for name in ("ruvllm", "jinja2", "markupsafe"):
        with zipfile.ZipFile(web_bundle / "python" / lock["packages"][name]["file_name"]) as z:
            names = set(z.namelist())
            record = z.read(next(n for n in names if n.endswith(".dist-info/RECORD"))).decode()
            for src in (n for n in names if n.endswith(".py")):
                folder, _, file = src.rpartition("/")
                pyc = f"{folder}/__pycache__/{file[:-3]}.{tag}.pyc"
                assert pyc in names and f"{pyc}," in record, (name, pyc)
                data = z.read(pyc)
                flags = int.from_bytes(data[4:8], "little")
                assert flags == 0b11, (pyc, flags)  # hash-based and checked against the source


def test_the_python_snapshot_is_indexed_with_its_real_sha256_and_holds_every_page_module(web_bundle):
    index = json.loads((web_bundle / "python" / "snapshot.json").read_text())
    data = (web_bundle / "python" / index["file"]).read_bytes()
    assert len(data) == index["size"] and hashlib.sha256(data).hexdigest() == index["sha256"]
    assert index["not_imported"] == []  # every module runtime/serve/web_preload.py wants imported in Pyodide
    heap = gzip.decompress(data)
    assert len(heap) == index["heap_bytes"] > 10 << 20


def test_our_pages_and_scripts_point_nowhere_off_origin(web_bundle):
    ours = [web_bundle / "index.html", web_bundle / "demo.js", *(web_bundle / "ruvllm").glob("*.js")]
    for f in ours:
        urls = re.findall(r"https?://[^\s'\"`)]+", f.read_text())
        assert not urls, f"{f.name} refers to {urls}"


def test_browser_package_is_small_and_says_what_it_chose(web_bundle):
    models = json.loads((web_bundle / "models.json").read_text())["models"]
    smol = next(m for m in models if m["id"] == "smollm2-135m")
    # the download: the GGUF's Q4_1 blocks on the wire (4 bits + an fp16 scale and minimum per 32 weights: 5
    # bits a weight, 109 MB with the WebGPU graphs; AWQ's blocks of 64 with 4-bit zero points were 4.6 bits, 98 MB)
    assert smol["bytes"] <= 110e6
    # backend 'wasm-step' fetches the same blocks repacked for it instead (and RoPE's table), never both
    assert smol["wasm_step_bytes"] <= 110e6
    q = smol["quantization"]
    assert q["weights"] == "int4" and q["compute"] == "fp32" and q["session_config"]


def test_the_warmup_model_follows_the_graph_contract(web_bundle):
    """The model worker feeds the bundle's warm-up decoder like a package's graph (web/src/ort_worker.js)."""
    import onnx
    import onnxruntime as ort

    from runtime.package import expected_inputs

    path = web_bundle / "ruvllm" / "warmup.onnx"
    assert not any(n.op_type == "MatMulNBits" for n in onnx.load(str(path)).graph.node)  # the browser format
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.disable_quant_qdq", "1")
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    from runtime import contract as C

    names = [i.name for i in session.get_inputs()]
    assert names == expected_inputs(sum(n.startswith("past.") and n.endswith(".key") for n in names)) + [C.LOGITS_MASK]
    # the steps the worker runs come from warmup.json: each runs here as the worker feeds it
    import json

    import numpy as np

    plan = json.loads(path.with_suffix(".json").read_text())
    types = {i["name"]: {1: np.float32, 7: np.int64}[i["dtype"]] for i in plan["io"]["inputs"]}
    assert len(plan["steps"]) >= 8
    for step in plan["steps"][:8]:
        feeds = {name: np.array(values, types[name]).reshape(dims) for name, (values, dims) in step["feeds"].items()}
        for name in plan["io"]["roles"]["past_keys"] + plan["io"]["roles"]["past_values"]:
            feeds[name] = np.zeros(step["pool_dims"], np.float32)
        mask = next(i for i in plan["io"]["inputs"] if i["name"] == plan["io"]["roles"]["logits_mask"])
        feeds[mask["name"]] = np.zeros((1, mask["shape"][1]), np.float32)  # as the worker feeds it: none constrained
        ids, lps = session.run([plan["io"]["roles"]["topk_ids"], plan["io"]["roles"]["topk_logprobs"]], feeds)
        assert ids.shape == (1, 1) and np.isfinite(lps).all()


def test_build_takes_a_model_from_any_source(web_bundle, test_cache, tmp_path, tiny_model_dir, smol_gguf, monkeypatch):
    """`python -m wasm build --model` takes an alias, a folder or a .gguf, absolute or relative (one package
    for both spellings), each under models/<its name>/ with its entry; a hub id offline is a clear error."""
    from runtime.aliases import source_name
    from tests.exporter.test_streamed_export import write_mixed_gguf
    from wasm.build import add_model

    monkeypatch.setenv("RUVLLM_CACHE_DIR", str(test_cache))  # where web_bundle exported the alias
    out = tmp_path / "bundle"
    gguf = tmp_path / "files" / "Tiny Mixed.Q4_K_M.gguf"
    gguf.parent.mkdir()
    write_mixed_gguf(gguf, smol_gguf, {n: "Q4_K" for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                            "ffn_up", "ffn_down")}, head=None)
    folder = tiny_model_dir("llama")
    monkeypatch.chdir(gguf.parent)
    entries = {source: add_model(out, source, "int4")
               for source in ("smollm2-135m", str(gguf), gguf.name, str(folder))}
    assert entries["smollm2-135m"]["id"] == "smollm2-135m"
    assert entries[str(gguf)] == entries[gguf.name] and entries[gguf.name]["id"] == source_name(str(gguf)) == "Tiny-Mixed.Q4_K_M"
    assert entries[str(gguf)]["wasm_step_bytes"] < entries[str(gguf)]["bytes"]  # a K-quant file gets the step
    assert entries[str(folder)]["id"] == folder.name and "wasm_step_bytes" not in entries[str(folder)]
    for entry in entries.values():
        assert (out / entry["url"] / "manifest.json").exists()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    proc = run_cli("build", "--out", str(tmp_path / "hub"), "--model", "someone/not-cached-anywhere", module="wasm",
                   env={"RUVLLM_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}, timeout=1200)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "error:" in proc.stderr and "someone/not-cached-anywhere" in proc.stderr
