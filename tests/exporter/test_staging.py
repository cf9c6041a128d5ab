"""Staging folders: what a killed export leaves beside its destination is removed by the next one there."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from exporter import staging

KILLED_WRITER = """
import os, sys
from pathlib import Path
from exporter.staging import staging_dir
tmp = staging_dir(Path(sys.argv[1]))
(tmp / "model.onnx.data").write_bytes(b"x" * 4096)  # half a package
print(tmp, flush=True)
os._exit(9)  # no cleanup runs, as under SIGKILL or the OOM killer
"""


def killed_export(parent: Path) -> Path:
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(parent)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=60)
    assert proc.returncode == 9, proc.stderr
    left = Path(proc.stdout.strip())
    assert left.is_dir() and left.parent == parent
    return left


def test_a_killed_writers_folder_goes_and_live_ones_stay(tmp_path):
    mine = staging.staging_dir(tmp_path)  # this process's: alive
    left = killed_export(tmp_path)
    me = os.getpid()
    reused = tmp_path / f".ruvllm-export-{me}.1-abc"  # this process's id with another start time: a reused id
    reused.mkdir()
    other_kind = tmp_path / f".ruvllm-adapter-{me}.1-abc"
    other_kind.mkdir()
    recent, old = tmp_path / ".ruvllm-export-recent", tmp_path / ".ruvllm-export-old"  # an earlier naming
    recent.mkdir()
    old.mkdir()
    two_days = time.time() - 2 * 24 * 3600
    os.utime(old, (two_days, two_days))
    removed = staging.remove_abandoned(tmp_path)
    assert sorted(removed) == sorted([left, reused, old])
    assert not left.exists() and not reused.exists() and not old.exists()
    assert mine.is_dir() and recent.is_dir() and other_kind.is_dir()


def test_the_next_export_in_the_same_place_removes_what_a_killed_one_left(tmp_path, tiny_model_dir):
    from exporter.convert import ConvertOptions, convert

    left = killed_export(tmp_path)
    out = convert(str(tiny_model_dir("llama")), tmp_path / "pkg", ConvertOptions(quant="fp32", progress=False, lora=False))
    assert out.is_dir() and not left.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["pkg"]
