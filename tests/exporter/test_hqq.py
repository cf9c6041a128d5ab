"""HQQ: zero points solved without calibration data beat round-to-nearest's on the same grid, and a package
quantized with them runs natively (kernels and plain graph alike) closer to fp32 than RTN."""

from __future__ import annotations

import numpy as np

from exporter.quantizers.hqq import hqq_grid
from runtime.package import load_package
from tests.exporter.test_quantization import quality, teacher_forced_logprobs


def rtn_error(w: np.ndarray, bits: int, block: int) -> np.ndarray:
    g = w.reshape(w.shape[0], -1, block)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    s = np.maximum(hi - lo, 1e-8) / (2 ** bits - 1)
    z = np.rint(-lo / s)
    q = np.clip(np.rint(g / s + z), 0, 2 ** bits - 1)
    return (g - (q - z) * s).reshape(w.shape)


def test_hqq_grid_beats_round_to_nearest_on_heavy_tailed_weights():
    rng = np.random.default_rng(0)
    w = (rng.standard_t(3, size=(96, 256)) * 0.02).astype(np.float32)  # outliers, as trained weights have
    grid = hqq_grid(w, 4, 64)
    assert grid.q.shape == w.shape and grid.q.max() <= 15 and not grid.zero.any() and grid.mins.shape == (96, 4)
    err = w - grid.dequantize()
    rtn = rtn_error(w, 4, 64)
    assert np.abs(err).mean() < 0.96 * np.abs(rtn).mean()  # 7% here
    assert (err ** 2).mean() < (rtn ** 2).mean()


def test_hqq_package_is_closer_to_fp32_than_rtn(tiny_model_dir, workdir):
    from exporter.convert import ConvertOptions, convert

    src = str(tiny_model_dir("llama"))
    fp32 = convert(src, workdir / "pkg-hqq-ref-fp32", ConvertOptions(progress=False, lora=False))
    tok_ids = list(range(3, 200, 3))
    ref = teacher_forced_logprobs(fp32, tok_ids)
    kl = {}
    for method in ("rtn", "hqq"):
        pkg = load_package(convert(src, workdir / f"pkg-hqq-{method}", ConvertOptions(
            quant="int4", method=method, block_size=64, progress=False, lora=False)))
        assert pkg.manifest["quantization"]["method"] == method
        kl[method] = quality(ref, teacher_forced_logprobs(pkg.path, tok_ids), tok_ids)["kl"]
    assert kl["hqq"] < kl["rtn"], kl
