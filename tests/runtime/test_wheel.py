"""The wheel works outside the repository: built with `pip wheel`, installed into a fresh venv (its
dependencies from this environment: the venv sees the system's site-packages, not the repository), then
`ruvllm generate "hi"` answers from an empty cache: the embedded model exported by the installed
exporter, RuvLLM's CPU kernels compiled from the installed sources."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def test_an_installed_wheel_answers_outside_the_repository(tmp_path):
    # built from a copy: setuptools builds in the tree, and files a checkout's build/ kept from an earlier
    # build (a module since removed) would go into the wheel
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "build", "dist", "node_modules", "*.egg-info",
                                                                 "__pycache__", ".*cache", ".hypothesis", ".benchmarks"))
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                            "-w", str(wheels)], capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = wheels.glob("ruvllm-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
                             capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert install.returncode == 0, install.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(RUVLLM_CACHE_DIR=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    where = subprocess.run([str(python), "-c", "import runtime, exporter; print(runtime.__file__, exporter.__file__)"],
                           capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=60)
    assert where.returncode == 0 and str(ROOT) not in where.stdout and str(venv) in where.stdout, where.stdout
    version = subprocess.run([str(venv / "bin" / "ruvllm"), "--version"], capture_output=True, text=True, env=env,
                             cwd=str(tmp_path), timeout=60)
    assert version.stdout.strip() == "ruvllm 0.1.0", version.stderr
    proc = subprocess.run([str(venv / "bin" / "ruvllm"), "generate", "hi", "--max-tokens", "16"],
                          capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=1200)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-3000:]
    assert (tmp_path / "cache" / "packages" / "smollm2-135m-int4-cpu" / "manifest.json").exists()
