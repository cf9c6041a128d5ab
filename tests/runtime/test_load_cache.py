"""What a load keeps for the next one: the exporter's own sha256s as a verified record, and the graph
rewritten onto the kernels; each is used only while what it was made from is unchanged."""

from __future__ import annotations

import os
import shutil

import pytest

from runtime.backends import graph_rewrite, kernel_library
from runtime.errors import PackageError

LIB, WHY = kernel_library.library()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RUVLLM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_an_export_is_recorded_as_verified(cache, tmp_path, tiny_model_dir, monkeypatch):
    """The exporter hashed the files it wrote: the first load reads none of them again; a file changed
    afterwards is read and refused."""
    from exporter.convert import ConvertOptions, convert
    from runtime import package
    from tests.runtime.test_bad_input import flip_byte

    pkg = convert(str(tiny_model_dir("llama")), tmp_path / "pkg", ConvertOptions(quant="fp32", progress=False))
    read = []
    digest = package.file_digest
    monkeypatch.setattr(package, "file_digest", lambda path: read.append(path.name) or digest(path))
    package.load_package(pkg, verify_hashes=True)
    assert read == []
    flip_byte(pkg / "model.onnx.data")
    with pytest.raises(PackageError, match="model.onnx.data does not match"):
        package.load_package(pkg, verify_hashes=True)
    assert read == ["model.onnx.data"]


@pytest.mark.skipif(LIB is None, reason=f"RuvLLM's kernels are not used here: {WHY}")
def test_the_rewritten_graph_is_reused_until_its_package_changes(cache, tmp_path, tiny_package, monkeypatch):
    from runtime.backends.native import NativeBackend
    from runtime.package import load_package

    pkg = tmp_path / "pkg"
    shutil.copytree(tiny_package("llama", "int4"), pkg)
    first = NativeBackend(load_package(pkg))
    assert first.matmul_kernel.startswith("ruvllm.MatMulQ4"), first.matmul_kernel
    assert len(list((cache / "graphs").glob("*.onnx"))) == 1

    fuse, calls = graph_rewrite.fuse, []

    def counted(*args, **kwargs):
        calls.append(args)
        return fuse(*args, **kwargs)

    monkeypatch.setattr(graph_rewrite, "fuse", counted)
    again = NativeBackend(load_package(pkg))  # from the cache: fuse is not called
    assert (again.matmul_kernel, again.attention_kernel) == (first.matmul_kernel, first.attention_kernel)
    assert not calls

    data = pkg / "model.onnx.data"
    st = data.stat()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # the weights fuse reads may have changed
    changed = NativeBackend(load_package(pkg))
    assert len(calls) == 1 and changed.matmul_kernel == first.matmul_kernel  # rewritten again, the same


def test_the_cache_keeps_the_most_recently_used(cache, tmp_path, monkeypatch):
    from tests.runtime.test_cpu_kernels import matmul_model

    monkeypatch.setattr(graph_rewrite.cache, "CACHED_REWRITES", 2)
    graphs = []
    for seed in range(3):
        path = tmp_path / f"g{seed}.onnx"
        path.write_bytes(matmul_model(64, 32, 32, seed=seed))
        graphs.append(path)
    graph_rewrite.rewrite_graph(graphs[0])
    graph_rewrite.rewrite_graph(graphs[1])
    os.utime(next((cache / "graphs").glob("*.json")), ns=(0, 0))  # whichever it is, the oldest now
    kept = {f.name for f in (cache / "graphs").glob("*.json")}
    graph_rewrite.rewrite_graph(graphs[2])
    left = {f.name for f in (cache / "graphs").glob("*.json")}
    assert len(left) == 2 and len(left & kept) == 1
    assert len(list((cache / "graphs").glob("*.onnx"))) == 2
