"""A backend says what it runs through one typed BackendInfo (runtime/core/backend.py): the engine, the server and
`ruvllm bench` read it, never probe a backend's attributes or parse its display strings."""

from __future__ import annotations

import re
from pathlib import Path

from runtime.core.backend import BackendInfo

ROOT = Path(__file__).resolve().parents[2]


def test_no_reader_probes_a_backends_attributes():
    for path in ("runtime/core/engine.py", "runtime/serve/server.py", "runtime/serve/bench.py"):
        text = (ROOT / path).read_text()
        assert not re.findall(r"getattr\([^)]*backend", text), path


def test_the_native_backend_states_its_kernels_as_facts(tiny_package):
    from runtime.backends.native import NativeBackend
    from runtime.package import load_package

    quantized = NativeBackend(load_package(tiny_package("llama", "int4")))
    info = quantized.info()
    assert isinstance(info, BackendInfo) and info.device == "CPUExecutionProvider"
    assert info.matmul_kernel.startswith("ruvllm.MatMulQ4") and info.attention_kernel.startswith("ruvllm.PagedAttention")
    assert not info.pads_rows and info.batch_invariant and info.kv_committed_bytes is None  # no pool yet
    quantized.allocate(8, 16)
    assert quantized.info().kv_committed_bytes > 0
    fp32 = NativeBackend(load_package(tiny_package("llama"))).info()
    assert fp32.batch_invariance == "projections on onnxruntime's kernels" and not fp32.batch_invariant
    # its projections are onnxruntime's, its attention RuvLLM's
    assert not fp32.matmul_kernel.startswith("ruvllm.MatMulQ4")
