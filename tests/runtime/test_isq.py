"""--isq: a model source quantized as it loads, into memory for the process, equal to the exported package
of the same recipe; nothing left behind; clear errors."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli

PROMPT = ["Hello there", "--json", "--temperature", "0", "--max-tokens", "8", "--speculative-tokens", "0"]


def graph_bytes(package) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(package.iterdir()) if f.suffix in (".onnx", ".data")}


# RTN, whose bytes depend on the weights alone: AWQ's (the int4 default) differed between the two exports once,
# in a full-suite run (2026-11-29), never when this test ran by itself; not yet explained
@pytest.mark.parametrize("spec, flags", [("int4:rtn", ["--method", "rtn"]), ("int8:rtn", ["--method", "rtn"])])
def test_isq_equals_the_exported_package_and_leaves_nothing(spec, flags, tiny_model_dir, tmp_path, monkeypatch):
    from runtime.resolve import resolve_package
    from runtime.serve import isq

    src = tiny_model_dir("llama")
    quant = spec.split(":")[0]
    exported = tmp_path / "exported"
    proc = run_cli("convert", str(src), "-o", str(exported), "--quant", quant, "--quiet", *flags, module="exporter")
    assert proc.returncode == 0, proc.stderr[-2000:]
    ram = tmp_path / "ram"
    monkeypatch.setenv("RUVLLM_ISQ_DIR", str(ram))
    package = resolve_package(str(src), quiet=True, isq=spec)
    assert package.is_relative_to(ram)
    assert graph_bytes(package) == graph_bytes(exported)  # the same weights, byte for byte
    manifest = json.loads((package / "manifest.json").read_text())
    assert manifest["quantization"] == json.loads((exported / "manifest.json").read_text())["quantization"]
    isq._remove_all()
    assert list(ram.iterdir()) == []

    got = run_cli("generate", str(src), *PROMPT, "--isq", spec, env={"RUVLLM_ISQ_DIR": str(ram)})
    assert got.returncode == 0, got.stderr[-2000:]
    want = run_cli("generate", str(exported), *PROMPT)
    assert json.loads(got.stdout)["token_ids"] == json.loads(want.stdout)["token_ids"]
    assert list(ram.iterdir()) == []  # removed when the process ended


def test_isq_errors_are_clear(tiny_package, tiny_model_dir, tmp_path):
    env = {"RUVLLM_ISQ_DIR": str(tmp_path / "ram")}
    cases = {
        (str(tiny_package("llama")), "int4"): "already a model package",
        (str(tiny_model_dir("llama")), "int5"): "--isq 'int5': expected one of int4, int8, w8a8",
        (str(tiny_model_dir("llama")), "int4:magic"): "--method: invalid choice: 'magic'",
        (str(tmp_path / "nowhere"), "int4"): "no such file or directory",
    }
    for (source, spec), message in cases.items():
        proc = run_cli("generate", source, *PROMPT, "--isq", spec, env=env)
        assert proc.returncode != 0 and message in proc.stderr, (spec, proc.stderr[-1000:])
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "ram").exists() or list((tmp_path / "ram").iterdir()) == []
