"""`python -m exporter eval`: the quality table of packages against a reference, and its errors."""

from __future__ import annotations

import json

from tests.conftest import run_cli
from tests.exporter.test_quantization import TEXT


def test_eval_table_of_quantized_packages_against_fp32(tiny_package, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 3, encoding="utf-8")
    ref, int8, int4 = (tiny_package("llama", q) for q in ("fp32", "int8", "int4"))
    proc = run_cli("eval", str(int8), str(int4), str(ref), "--reference", str(ref), "--text", str(text),
                   "--tokens", "64", "--json", module="exporter")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["tokens"] == 64 and result["reference_perplexity"] > 1
    rows = {r["quantization"].split()[0]: r for r in result["rows"]}
    assert set(rows) == {"int8", "int4", "fp32"}
    assert rows["fp32"]["kl"] < 1e-9 and rows["fp32"]["top1"] == 1.0 and rows["fp32"]["delta_ppl_pct"] == 0
    assert 0 < rows["int8"]["kl"] < rows["int4"]["kl"] < 0.1  # int4 loses more than int8
    assert rows["int4"]["size_mb"] < rows["int8"]["size_mb"] < rows["fp32"]["size_mb"]
    assert all(r["decode_tok_s"] > 0 for r in rows.values())
    table = run_cli("eval", str(int4), "--reference", str(ref), "--text", str(text), "--tokens", "32", "--no-speed",
                    module="exporter")
    assert table.returncode == 0, table.stderr[-2000:]
    head, *lines = table.stdout.strip().splitlines()[1:]
    assert head.split()[:4] == ["package", "quantization", "size", "MB"] and len(lines) == 1 and "int4" in lines[0]


def test_eval_errors_name_the_problem(tiny_package, tmp_path):
    proc = run_cli("eval", str(tmp_path / "nowhere"), module="exporter")
    assert proc.returncode == 1 and "nowhere" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli("eval", str(tiny_package("llama")), "--text", str(tmp_path / "missing.txt"), module="exporter")
    assert proc.returncode == 1 and "missing.txt" in proc.stderr and "Traceback" not in proc.stderr
