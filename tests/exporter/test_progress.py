"""Export progress is visible: a line per stage off a terminal, passed through by `ruvllm download`."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli

STAGES = ("reading model", "building graphs", "writing package")  # streamed: each weight quantized as it is built


def test_convert_prints_a_line_per_stage_when_not_on_a_terminal(tmp_path, tiny_model_dir):
    proc = run_cli("convert", str(tiny_model_dir("llama")), "-o", str(tmp_path / "out"), "--quant", "int8",
                   "--method", "rtn", module="exporter")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in STAGES:
        assert f"export: {name}" in proc.stderr and f"export: {name} done in" in proc.stderr, proc.stderr
    assert "\r" not in proc.stderr  # no bar redrawn into a log
    quiet = run_cli("convert", str(tiny_model_dir("llama")), "-o", str(tmp_path / "q"), "--quiet", module="exporter")
    assert quiet.returncode == 0 and "export:" not in quiet.stderr


@pytest.mark.slow
def test_download_passes_the_exporters_progress_through(tmp_path):
    proc = run_cli("download", "smollm2-135m", "--quant", "fp32", env={"RUVLLM_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "export: reading GGUF ..." in proc.stderr and "export: writing package done in" in proc.stderr
