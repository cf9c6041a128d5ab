"""The page's int8 KV pool (kvDtype "int8"): the JS quantizer against runtime/backends/kv_pool.py's bit for
bit, and the page's greedy tokens against the native engine's on an int8 pool."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from runtime.backends.kv_pool import quantize_rows
from runtime.core.kv_blocks import kv_group
from tests.conftest import ROOT, run_cli
from tests.web.conftest import CHAT, LOAD_ENGINE, publish

HELLO = [{"role": "user", "content": "Hello! Tell me about the sea."}]
GREEDY = {"temperature": 0, "return_token_ids": True, "max_tokens": 16}

QUANTIZE = """
import { readFileSync } from 'node:fs';
import { quantizeRow } from '%s';
const [rows, d, g] = JSON.parse(process.argv[1]);
const x = new Float32Array(readFileSync(process.argv[2]).buffer.slice(0));
const q = new Int8Array(rows * d), s = new Uint16Array(rows * d / g);
for (let r = 0; r < rows; r++) quantizeRow(x, r * d, d, g, q, r * d, s, r * d / g);
process.stdout.write(JSON.stringify({ q: Array.from(q), s: Array.from(s) }));
"""


@pytest.mark.parametrize("head_dim", [64, 48])
def test_the_pages_quantizer_equals_the_native_pools(head_dim, tmp_path):
    """Heavy tails, zero rows, tiny (fp16-subnormal) scales and exact ties (x / s = k + 0.5, which round to
    even): the same int8 rows and fp16 scale bits as numpy's."""
    rng = np.random.default_rng(3)
    rows = [rng.standard_t(3, (200, head_dim)).astype(np.float32) * 4, np.zeros((2, head_dim), np.float32),
            rng.normal(size=(8, head_dim)).astype(np.float32) * 1e-5]
    ties = np.full((4, head_dim), 0.0, np.float32)
    ties[:, 0] = 127 / 16  # a group's maximum: scale exactly 1/16
    ties[:, 1:16] = (np.arange(-7, 8)[None, :] + 0.5) / 16
    rows.append(ties)
    x = np.concatenate(rows)
    (tmp_path / "x.bin").write_bytes(x.tobytes())
    script = QUANTIZE % (ROOT / "web" / "src" / "kv_pool.js").as_uri()
    proc = subprocess.run(["node", "--input-type=module", "-e", script, json.dumps([len(x), head_dim, kv_group(head_dim)]),
                           str(tmp_path / "x.bin")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout)
    q, s = quantize_rows(x)
    assert np.array_equal(np.array(got["q"], np.int8).reshape(q.shape), q)
    assert np.array_equal(np.array(got["s"], np.uint16).reshape(s.shape), s.view(np.uint16))
    # the ties were there, rounded to even
    assert q[-1, 1:16].tolist() == [-6, -6, -4, -4, -2, -2, 0, 0, 2, 2, 4, 4, 6, 6, 8]


def native_ids(package, kv_dtype: str) -> list[int]:
    proc = run_cli("generate", str(package), HELLO[0]["content"], "--chat", "--json", "--temperature", "0",
                   "--max-tokens", str(GREEDY["max_tokens"]), "--speculative-tokens", "0", "--kv-dtype", kv_dtype)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)["token_ids"]


@pytest.mark.slow
def test_the_page_on_an_int8_kv_pool_gives_the_native_tokens(offline_page, tiny_package, peft_adapters, web_models):
    """The page's greedy tokens equal the native engine's on its int8 pool, also from the prefix cache; the
    pool holds int8 rows and fp16 scales; adapters and an unknown kvDtype are refused clearly."""
    pkg = tiny_package("llama", "fp32")
    assert json.loads((pkg / "manifest.json").read_text())["graphs"]["decoder_kv8"]["kv_dtype"] == "int8"
    url = publish(web_models, pkg, "tiny-llama-fp32")
    want = native_ids(pkg, "int8")
    p = offline_page()
    p.api()
    info = p.evaluate(LOAD_ENGINE, [url, {"device": "wasm", "speculativeTokens": 0, "kvDtype": "int8"}])
    assert info["kvDtype"] == "int8" and info["graph"] == "model_kv8.onnx", info
    got = [p.evaluate(CHAT, {"messages": HELLO, **GREEDY})["choices"][0]["token_ids"] for _ in range(2)]
    assert got == [want, want]  # the second from the prefix cache's int8 blocks
    stats = p.evaluate("async () => engine.stats()")
    cfg = json.loads((pkg / "manifest.json").read_text())["config"]
    row = cfg["head_dim"] + 2 * max(cfg["head_dim"] // 32, 1)  # int8 numbers and fp16 scales
    assert stats["backend"]["kv_pool_bytes"] % (2 * cfg["num_layers"] * cfg["num_kv_heads"] * row) == 0
    adapter = publish(web_models, peft_adapters("llama")["attn4"], "adapter-attn4")
    err = p.evaluate("""async (url) => { try { await engine.loadAdapter('a', url); return null; }
      catch (e) { return e.message; } }""", adapter)
    assert err and "kvDtype 'int8'" in err, err
    assert p.evaluate(CHAT, {"messages": HELLO, **GREEDY})["choices"][0]["token_ids"] == want  # still serving
    p2 = offline_page()
    p2.api()
    bad = p2.evaluate("""async ([url]) => { try { await window.createEngine({ model: url, kvDtype: 'int4' });
      return null; } catch (e) { return e.message; } }""", [url])
    assert bad and "kvDtype" in bad, bad
