"""HQQ (half-quadratic quantization, Badri & Shaji 2023): better zero points without calibration data.

Round-to-nearest takes each block's zero point from its minimum and maximum. HQQ keeps that scale and
solves for the zero point that minimises an l_p (p < 1) norm of the weights' error, by half-quadratic
splitting: alternately shrink the error (a sparse, outlier-tolerant estimate of what the grid cannot
represent) and move the zero point to the mean that fits the rest. The zero point it finds is a float,
so the grid stores it as a per-block minimum, -zero * scale (MatMulNBits with the minimum term of
exporter/quantizers/block_matmul.py, as a GGUF's Q4_1 blocks run), with integer zero points of 0.
"""

from __future__ import annotations

import numpy as np

from exporter.quantizers.grid import Grid


def _shrink(x: np.ndarray, beta: float, p: float) -> np.ndarray:
    """The proximal step of the l_p norm: small errors go to 0, large ones are kept (less |x|^(p-1)/beta)."""
    ax = np.abs(x)
    return np.sign(x) * np.maximum(ax - (ax + 1e-8) ** (p - 1) / beta, 0.0)


def hqq_grid(w: np.ndarray, bits: int, block: int, iters: int = 20, p: float = 0.7, beta: float = 10.0,
             kappa: float = 1.01) -> Grid:
    """The grid of w [out, in] (in a whole number of blocks): min-max scales, HQQ's zero points."""
    n, k = w.shape
    if k % block:
        raise ValueError(f"HQQ needs whole blocks: {k} inputs, blocks of {block}")
    g = w.reshape(n, k // block, block).astype(np.float32)
    qmax = float(2 ** bits - 1)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    scale = np.maximum(hi - lo, 1e-8) / qmax
    inv = 1.0 / scale
    zero = -lo * inv
    best, best_zero = np.inf, zero
    for _ in range(iters):
        q = np.clip(np.rint(g * inv + zero), 0.0, qmax)
        err = g - (q - zero) * scale
        total = float(np.abs(err).mean())
        if total >= best:  # the reference implementation stops once the error no longer falls
            break
        best, best_zero = total, zero
        zero = np.mean(q - (g - _shrink(err, beta, p)) * inv, axis=-1, keepdims=True)
        beta *= kappa
    zero = best_zero
    q = np.clip(np.rint(g * inv + zero), 0.0, qmax).astype(np.uint8).reshape(n, k)
    mins = (-zero * scale)[..., 0].astype(np.float32)
    return Grid(q, scale[..., 0].astype(np.float32), np.zeros((n, k // block), np.uint8), block, bits, mins)
