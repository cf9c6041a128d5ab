"""Each bad input gets a one-line error, a non-zero exit and no traceback."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import run_cli


def assert_one_line_error(proc, *fragments: str) -> None:
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert "Traceback" not in err, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("error: "), err[-2000:]
    assert len([ln for ln in lines if ln.startswith("error:")]) == 1
    for f in fragments:
        assert f in lines[-1], lines[-1]


def test_missing_package_path():
    assert_one_line_error(run_cli("generate", "/nonexistent/pkg", "hi"), "no such model package")


def test_missing_export_source(tmp_path):
    proc = run_cli("convert", "/nonexistent/model", "-o", str(tmp_path / "out"), module="exporter")
    assert_one_line_error(proc, "no such file or directory")


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)).save_pretrained(folder)
    proc = run_cli("convert", str(folder), "-o", str(tmp_path / "out"), module="exporter")
    assert_one_line_error(proc, "unsupported architecture 'gpt2'", "llama", "mistral", "qwen2", "qwen3")
    assert not (tmp_path / "out").exists()


def test_download_recipe_errors(tmp_path):
    env = {"RUVLLM_CACHE_DIR": str(tmp_path)}
    assert_one_line_error(run_cli("download", "smollm2-135m", "--block-size", "24", env=env),
                          "--block-size must be a power of two")
    assert not any((tmp_path / "packages").glob("*/manifest.json"))
    proc = run_cli("download", "smollm2-135m", "--method", "spqr", env=env)
    assert proc.returncode == 2 and "invalid choice: 'spqr'" in proc.stderr


def test_hub_id_while_offline(tmp_path):
    proc = run_cli("convert", "some-org/some-model", "-o", str(tmp_path / "out"), module="exporter",
                   env={"HF_HUB_OFFLINE": "1"})
    assert_one_line_error(proc, "cannot download 'some-org/some-model'")


def test_folder_from_another_tool(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    assert_one_line_error(run_cli("generate", str(tmp_path), "hi"), "not a RuvLLM model package")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_line_error(run_cli("info", str(empty)), "no manifest.json")


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest", "version", "graph"])
def test_corrupt_package(tmp_path, tiny_package, damage):
    pkg = tmp_path / "pkg"
    shutil.copytree(tiny_package("llama"), pkg)
    flags = []
    if damage == "truncate":
        data = pkg / "model.onnx.data"
        data.write_bytes(data.read_bytes()[:1000])
        expect = "corrupt package"
    elif damage == "flip":  # same size: only the sha256 tells
        flip_byte(pkg / "model.onnx.data")
        expect = "model.onnx.data does not match the sha256"
    elif damage == "manifest":
        (pkg / "manifest.json").write_text("{not json")
        expect = "corrupt manifest.json"
    elif damage == "version":
        m = json.loads((pkg / "manifest.json").read_text())
        m["format_version"] = 99
        (pkg / "manifest.json").write_text(json.dumps(m))
        expect = "format version 99 is not supported"
    else:  # same size, garbage content, hashes not checked: onnxruntime's refusal is reported
        g = pkg / "model.onnx"
        g.write_bytes(b"\x07" * g.stat().st_size)
        expect, flags = "cannot load model.onnx", ["--no-verify"]
    assert_one_line_error(run_cli("generate", str(pkg), "hi", "--max-tokens", "2", *flags), expect)


def flip_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(data)


def test_serve_refuses_a_corrupt_package_before_listening(tmp_path, tiny_package):
    pkg = tmp_path / "pkg"
    shutil.copytree(tiny_package("llama"), pkg)
    flip_byte(pkg / "model.onnx.data")
    proc = run_cli("serve", str(pkg), "--port", "1", timeout=120)  # port 1 would fail to bind: it never gets there
    assert_one_line_error(proc, "model.onnx.data does not match the sha256")
    assert "serving" not in proc.stderr


def test_verified_files_are_not_read_again_until_they_change(tmp_path, tiny_package, monkeypatch):
    import os

    from runtime.errors import PackageError
    from runtime.package import load_package

    monkeypatch.setenv("RUVLLM_CACHE_DIR", str(tmp_path / "cache"))
    pkg = tmp_path / "pkg"
    shutil.copytree(tiny_package("llama"), pkg)
    load_package(pkg, verify_hashes=True)  # checked once, recorded
    data = pkg / "model.onnx.data"
    st = data.stat()
    flip_byte(data)
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime: the record stands
    load_package(pkg, verify_hashes=True)
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # touched: read again, and refused
    with pytest.raises(PackageError, match="model.onnx.data does not match"):
        load_package(pkg, verify_hashes=True)


def test_device_without_provider(tiny_package):
    proc = run_cli("generate", str(tiny_package("llama")), "hi", "--device", "cuda")
    assert_one_line_error(proc, "device 'cuda' needs CUDAExecutionProvider")


def test_prompt_longer_than_context(tiny_package):
    long_prompt = "word " * 400  # the tiny models have a 256-token context
    proc = run_cli("generate", str(tiny_package("llama")), long_prompt, "--max-tokens", "2")
    assert_one_line_error(proc, "context is 256 tokens")


def test_bad_sampling_value(tiny_package):
    proc = run_cli("generate", str(tiny_package("llama")), "hi", "--top-p", "1.5")
    assert_one_line_error(proc, "invalid top_p")
