"""The int4 KV pool (--kv-dtype int4): each row rotated by the orthonormal Hadamard matrix of its largest
power-of-two block, then asymmetric 4-bit steps per group (keys 32, values 64), behind the two-tier pool's
exact tails; read by ruvllm.PagedAttention only. Checked against numpy's reference
(kv_pool.quantize_rows_int4), the fp32 pool, and through the engine's prefix cache (test_kv_int8 runs its
batching, drafts and preemption test on both pools; test_cpu_kernels checks the operator's arithmetic
against a plain reference; test_batch_invariance its paths bit for bit)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from runtime.backends import kernel_library
from runtime.backends.kv_pool import dequantize_rows_int4, quantize_rows_int4
from runtime.core.engine import Engine
from runtime.core.kv_blocks import kv_int4_groups
from runtime.core.kv_tails import TAIL_BLOCKS
from runtime.core.sampling import SamplingParams
from runtime.errors import DeviceError
from tests.runtime.test_kv_int8 import CHAT_PROMPTS, answer_logprobs, steps, written_pools

HAS_KERNEL = "PagedAttention" in kernel_library.operators(kernel_library.library()[0])
needs_kernel = pytest.mark.skipif(not HAS_KERNEL, reason="an int4 pool is read by ruvllm.PagedAttention (AVX-512 or AVX2)")
ARCH = "qwen3"  # the tiny families' one with head_dim 32 and no soft cap


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
def test_rows_round_trip_within_half_a_step_of_the_rotated_numbers(head_dim):
    """The rotation is orthonormal, so each 16 numbers come back within sqrt(16) half steps (L2) of
    their group's scale; an outlier channel no longer sets the steps of its whole group alone; a row of
    zeros stays zeros."""
    rng = np.random.default_rng(head_dim)
    x = (rng.standard_normal((3, 5, head_dim)) * rng.uniform(0.01, 30, (3, 5, 1))).astype(np.float32)
    x[0, 0] = 0.0
    x[1, :, 3] *= 40  # an outlier channel, as keys have
    for group in (32, 64) if head_dim % 64 == 0 else (32,):
        packed, pairs = quantize_rows_int4(x, group)
        assert packed.dtype == np.uint8 and packed.shape == (3, 5, head_dim // 2)
        assert pairs.dtype == np.float16 and pairs.shape == (3, 5, 2 * head_dim // group)
        back = dequantize_rows_int4(packed, pairs)
        assert not back[0, 0].any() and not pairs[0, 0].any()
        step = np.repeat(pairs[..., 0::2].astype(np.float32), group // 16, axis=-1)  # per 16 numbers
        err = np.sqrt(((back - x).reshape(3, 5, -1, 16) ** 2).sum(-1))
        assert (err <= 4 * 0.5 * step * 1.01 + 1e-30).all()
        # without the rotation, the outlier's group would be in steps of ~|outlier| / 7.5
        assert np.abs(back - x)[1].max() < np.abs(x[1, :, 3]).max() / 15


@pytest.mark.skipif(kernel_library.kv_writer("int4") is None, reason="the kernel library is not built here")
@pytest.mark.parametrize("head_dim", [32, 64, 96])
def test_the_kernel_librarys_writer_stores_what_numpy_does_bit_for_bit(monkeypatch, head_dim):
    """ruvllm_kv_write_int4 against kv_pool.quantize_rows_int4 and numpy's copies: the same nibbles, (scale,
    minimum) pairs and tail rows, for a prompt chunk and a decode step, with a row of zeros, tiny numbers
    and numbers past fp16's range (their minimum and scale held at its largest: finite, if coarse)."""
    def special(present):
        present[0][0, 0, 0] = 0.0
        present[0][1, 0, 1] = 1e-30
        present[1][2, -1, 1] *= 1e4

    native, _ = written_pools(monkeypatch, "int4", head_dim, special)
    assert [a.shape[-1] for a in native._scales] == [2 * head_dim // g for g in kv_int4_groups(head_dim)]
    assert native._host[0].any()
    assert np.isfinite(dequantize_rows_int4(native._host[1], native._scales[1])).all()


@needs_kernel
def test_int4_pool_stays_near_the_fp32_pool_and_its_tails_bring_it_nearer(tiny_package, monkeypatch):
    """Prefill chunks and decodes: the int4 pool's logits near the fp32 pool's; reading each query's own
    block and the one before exact (the tails) nearer still; int8's error smaller than int4's."""
    from runtime.backends.native import NativeBackend
    from runtime.package import load_package

    pkg = load_package(tiny_package(ARCH))
    prompt = [5, 17, 99, 3, 250, 41, 7, 8, 1000, 12, 13] * 3
    plain = steps(NativeBackend(pkg), prompt, 4)
    got = {}
    for kv_dtype, tails in (("int4", True), ("int4", False), ("int8", False)):
        monkeypatch.setenv("RUVLLM_KV_TAILS", "1" if tails else "0")
        backend = NativeBackend(pkg, kv_dtype=kv_dtype)
        got[kv_dtype, tails] = steps(backend, prompt, 4)
        assert backend.pool.tails == tails and backend.attention_kernel.startswith("ruvllm.PagedAttention")
    err = {k: np.abs(v - plain).mean() for k, v in got.items()}
    assert 0 < err["int4", True] < err["int4", False] and err["int8", False] < err["int4", False]
    # 4-bit steps on a random model's keys move its logits by up to a tenth or so of their range here (a
    # wrong nibble order or an unrotated read moves them by their whole range)
    assert np.abs(got["int4", False] - plain).max() <= 0.25 * np.abs(plain).max()


@needs_kernel
def test_prefix_cache_on_an_int4_pool(tiny_package):
    """Blocks quantized once are shared by later prompts up to their floors; outputs equal the uncached run."""
    pkg = tiny_package(ARCH)
    shared = list(range(100, 160))
    prompts = [shared + [7 + i, 9 + i] for i in range(4)]
    plain = Engine.from_package(pkg, kv_dtype="int4", enable_prefix_cache=False)
    want = [[t for o in plain.generate(p, greedy(6)) for t in o.token_ids] for p in prompts]
    cached = Engine.from_package(pkg, kv_dtype="int4")
    assert [[t for o in cached.generate(p, greedy(6)) for t in o.token_ids] for p in prompts] == want
    assert cached.stats_snapshot()["prefix_cache_hits"] > 0


def test_int4_pool_holds_about_six_times_the_fp32_pools_tokens(tiny_package):
    pkg = tiny_package(ARCH)
    fp32 = Engine.from_package(pkg, kv_memory=1 << 20)
    cfg = fp32.pkg.config
    d = cfg["head_dim"]
    gk, gv = kv_int4_groups(d)
    per_token = cfg["num_layers"] * cfg["num_kv_heads"] * (d + 4 * d // gk + 4 * d // gv)  # nibbles, fp16 pairs
    from runtime.core.kv_blocks import kv_bytes_per_token

    assert kv_bytes_per_token(cfg, "int4") == per_token
    if not HAS_KERNEL:
        return
    engine = Engine.from_package(pkg, kv_dtype="int4", kv_memory=1 << 20)
    ratio = 8 * d / per_token * cfg["num_layers"] * cfg["num_kv_heads"]  # 6.4x at head_dim 32, 6.74x at 64
    assert ratio > 6
    assert engine.scheduler.allocator.num_blocks == pytest.approx(ratio * fp32.scheduler.allocator.num_blocks, rel=0.02)


@needs_kernel
def test_ruvllm_info_gives_the_pools_bytes_a_token(tiny_package):
    import json

    from runtime.core.kv_blocks import kv_bytes_per_token
    from runtime.package import load_package
    from tests.conftest import run_cli

    pkg = tiny_package(ARCH)
    cfg = load_package(pkg).config
    for kv_dtype in ("fp32", "int8", "int4"):
        proc = run_cli("info", str(pkg), "--json", "--kv-dtype", kv_dtype)
        assert proc.returncode == 0, proc.stderr[-2000:]
        host = json.loads(proc.stdout)["host"]
        assert host["kv_bytes_per_token"] == kv_bytes_per_token(cfg, kv_dtype)
        assert host["kv_vs_fp32"] == round(kv_bytes_per_token(cfg) / kv_bytes_per_token(cfg, kv_dtype), 2)
        # the tails as the pool holds them: TAIL_BLOCKS blocks of fp16 rows, keys and values (none for fp32)
        engine = Engine.from_package(pkg, kv_dtype=kv_dtype, kv_memory=1 << 20)
        pool, blocks = engine.backend.pool, TAIL_BLOCKS if kv_dtype != "fp32" else 0
        assert (pool._tails[0].dtype == np.float16) if blocks else pool._tails == ()
        assert host["kv_tail_bytes_a_sequence"] == blocks * 2 * pool._tail_block_bytes
        tails = host["kv_tail_bytes_a_sequence"]
        assert host["kv_vs_fp32_at_512"] == round(512 * kv_bytes_per_token(cfg) / (512 * kv_bytes_per_token(cfg, kv_dtype) + tails), 2)
    assert host["kv_vs_fp32"] > 6 and 5 < host["kv_vs_fp32_at_512"] < host["kv_vs_fp32"]


def test_int4_is_refused_clearly_where_it_cannot_run(tiny_package, monkeypatch):
    with pytest.raises(DeviceError, match="head_dim is 16"):
        Engine.from_package(tiny_package("llama"), kv_dtype="int4")
    monkeypatch.setenv("RUVLLM_PAGED_ATTENTION", "0")  # as where RuvLLM's kernels cannot be built
    with pytest.raises(DeviceError, match="int4 pool is read by RuvLLM's PagedAttention kernel only"):
        Engine.from_package(tiny_package(ARCH), kv_dtype="int4")


GPL3 = Path("/usr/share/common-licenses/GPL-3")  # issue 52's text (Debian's base-files)


@pytest.mark.slow
@needs_kernel
@pytest.mark.skipif(not GPL3.exists(), reason="issue 52's quality gate is measured on Debian's GPL-3 text")
def test_smollm2_on_an_int4_pool_within_the_quality_gate(smol_fp32):
    """Issue 52's gate, `python -m exporter eval PKG --kv-dtype int4 --tokens 4096 --text GPL-3` on the embedded
    model in fp32: mean KL(fp32 pool || int4 pool) <= 0.01 and perplexity within 1 % (measured 0.0088,
    +0.40 %; on CPython's LICENSE, 2,048 tokens, it is 0.013 and +2.1 %: docs/PERFORMANCE.md)."""
    from exporter.evaluate import evaluate

    result = evaluate([str(smol_fp32)], text=GPL3.read_text(), tokens=4096, speed=False, progress=False,
                      kv_dtype="int4")
    row = result["rows"][0]
    assert result["kv_dtype"] == "int4" and result["tokens"] == 4096
    assert 0 < row["kl"] <= 0.01 and abs(row["delta_ppl_pct"]) <= 1.0, row


@pytest.mark.slow
@needs_kernel
def test_smollm2_along_the_fp32_pools_chat_answers_on_an_int4_pool(smol_fp32):
    """20 chat prompts' greedy answers on the fp32 pool (64 tokens), teacher-forced on the int4 pool with the
    floors the engine gives: mean KL(fp32 pool || int4 pool) per token <= 0.01 and the top choice the same
    at >= 95 % of the tokens (measured 0.0064 and 97.2 %). Issue 52's greedy gate (16 of 20 answers equal)
    is not met: a 3 % disagreement a token parts most 64-token answers somewhere (2 of 20 equal)."""
    engine = Engine.from_package(smol_fp32, verify=False, speculative_tokens=0)
    prompts = [engine.encode_prompt(messages=[{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    answers = [[t for o in engine.generate(p, greedy(64)) for t in o.token_ids] for p in prompts]
    logprobs = {kv: answer_logprobs(smol_fp32, kv, prompts, answers) for kv in ("fp32", "int4")}
    kl = np.mean([(np.exp(r) * (r - g)).sum(1).mean() for r, g in zip(logprobs["fp32"], logprobs["int4"])])
    top = np.mean([(r.argmax(1) == g.argmax(1)).mean() for r, g in zip(logprobs["fp32"], logprobs["int4"])])
    assert 0 < kl <= 0.01 and top >= 0.95, (kl, top)
