"""`ruvllm bench` as a user runs it: every figure the JSON promises is there and consistent (never timed)."""

from __future__ import annotations

import json

from tests.conftest import run_cli


def test_bench_concurrency_prefix_cache_and_plot(tiny_package, tmp_path):
    """A tiny model whose context (256) is shorter than the default long prompt (512): the long-prompt and
    prefix-cache measurements shrink to fit it instead of failing."""
    png = tmp_path / "bench.png"
    proc = run_cli("bench", str(tiny_package("llama")), "--concurrency", "1,3", "--shared-prefix", "64",
                   "--decode-tokens", "6", "--repeats", "1", "--num-blocks", "64", "--json", "--plot", str(png))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["decode_tokens"] == 6 and result["kv_blocks"] == 64
    assert result["prefill_tps_255"] > 0 and result["ttft_255_ms"] > 0  # the context less one token
    levels = result["concurrency"]
    assert [lv["streams"] for lv in levels] == [1, 3]
    for lv in levels:
        assert lv["ttft_p50_ms"] <= lv["ttft_p99_ms"] and lv["itl_p50_ms"] <= lv["itl_p99_ms"], lv
        assert lv["aggregate_tps"] > 0 and 0 < lv["kv_blocks_peak"] <= 64, lv
    # 3 streams of a 64-token shared prefix + question + 6 tokens hold more blocks than one does
    assert levels[1]["kv_blocks_peak"] > levels[0]["kv_blocks_peak"]
    cache = result["prefix_cache"]
    assert cache["prompt_tokens"] == 255 and cache["shared_tokens"] == 64
    assert cache["cached_tokens_last"] == 64  # the shared prefix's four full blocks came from the cache
    stats = result["engine_stats"]
    assert stats["prefix_cache_hits"] > 0 and stats["running"] == 0 and stats["kv_blocks_used"] == 0
    assert result["plot"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    kv = result["kv"]  # the pool's memory grows with the blocks in use (16 first, then doubling), up to all 64
    assert kv["blocks"] == 64 and kv["bytes_per_token"] > 0
    assert 0 < kv["committed_mb"] <= 64 * kv["block_size"] * kv["bytes_per_token"] / 2**20


def test_bench_structured_output_beside_free_text(tiny_package):
    """--structured: each level constrained and free, their ratio and the mask's time per step."""
    proc = run_cli("bench", str(tiny_package("llama")), "--concurrency", "1,2", "--decode-tokens", "8",
                   "--repeats", "1", "--structured", "--speculative-tokens", "0", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    levels = json.loads(proc.stdout.strip().splitlines()[-1])["structured"]["levels"]
    assert [lv["streams"] for lv in levels] == [1, 2]
    for lv in levels:
        assert lv["constrained_decode_tps"] > 0 and lv["ratio"] > 0 and lv["mask_ms_per_step"] > 0, lv
        assert lv["constrained"]["streams"] == lv["streams"]


def test_bench_on_an_int8_pool_over_long_contexts(tiny_package):
    """--kv-dtype int8 --context N: each stream its own N-token prompt; the pool's dtype and bytes per token
    reported (int8 rows and a 2-byte scale per group, one per row at this head_dim of 16)."""
    proc = run_cli("bench", str(tiny_package("llama")), "--concurrency", "1,2", "--decode-tokens", "4", "--repeats",
                   "1", "--context", "96", "--kv-dtype", "int8", "--speculative-tokens", "0", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    kv = result["kv"]
    assert kv["dtype"] == "int8" and kv["bytes_per_token"] == 2 * 2 * 2 * (16 + 2)  # layers, K/V, kv heads, D + scale
    assert result["concurrency"][1]["kv_blocks_peak"] >= 2 * 96 // kv["block_size"]


def test_bench_on_a_base_model_without_a_chat_template(tiny_package, tmp_path):
    """A base model's package (Gemma 3 270M's GGUF has no template) is benchmarked on its question as text,
    not refused for want of a template."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_package("llama"), base)
    manifest = json.loads((base / "manifest.json").read_text())
    assert manifest.pop("chat_template")
    (base / "manifest.json").write_text(json.dumps(manifest))
    proc = run_cli("bench", str(base), "--decode-tokens", "4", "--repeats", "1", "--speculative-tokens", "0",
                   "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ttft_ms"] > 0 and result["prefill_tps_short"] > 0 and result["decode_tokens"] == 4
