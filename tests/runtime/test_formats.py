"""The formats' one description (runtime/formats/) against every copy of it: the generated C, C++ and JS files,
the compiled WASM step's and native kernels' own view of their structs and tables, gguf-py's block sizes."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.formats import block_types, generate, step_abi
from tests.conftest import ROOT


def test_generated_files_are_current():
    assert generate.stale() == [], "run python -m runtime.formats.generate"
    proc = subprocess.run([sys.executable, "-m", "runtime.formats.generate", "--check"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr


def test_a_hand_edit_of_a_generated_file_is_stale(tmp_path):
    for path in generate.outputs():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, tmp_path / path)
    assert generate.stale(tmp_path) == []
    abi = tmp_path / generate.STEP_H
    abi.write_text(abi.read_text().replace("int32_t num_blocks;", "int32_t num_blocks;\n  int32_t extra;"))
    assert generate.stale(tmp_path) == [generate.STEP_H]
    assert generate.write(tmp_path) == [generate.STEP_H] and generate.stale(tmp_path) == []


def test_block_types_are_gguf_pys():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for t in block_types.BLOCK_TYPES:
        assert GGMLQuantizationType[t.name].value == t.ggml, t.name
        assert GGML_QUANT_SIZES[GGMLQuantizationType[t.name]] == (t.elems, t.nbytes), t.name


def test_every_own_type_has_a_decoder_and_the_step_reads_whole_blocks():
    from exporter.sources.gguf_blocks import DECODERS

    assert set(DECODERS) == set(block_types.OWN)
    assert all(block_types.OWN[name].bits >= 4 for name in block_types.STEP_TYPES)  # the step has no 2- or 3-bit fields
    assert [block_types.OWN[n].kind for n in step_abi.KINDS] == sorted(block_types.OWN[n].kind for n in step_abi.KINDS)


def test_the_compiled_kernels_table_is_the_spec():
    import ctypes

    from runtime.backends.kernel_library import library

    lib, why = library()
    if lib is None:
        pytest.skip(f"RuvLLM's CPU kernels are not built here: {why}")
    fn = ctypes.CDLL(str(lib)).ruvllm_block_types
    fn.restype = ctypes.c_char_p
    rows = [line.split() for line in fn().decode().splitlines()]
    want = [[t.name, str(t.kind), str(t.bits), str(t.block), str(t.zero), str(t.superblock),
             str(block_types.SCALES.index(t.scales)), str(int(t.gather))] for t in block_types.OWN.values()]
    assert rows == want


def _probe_source(spec: generate.Spec, step_c: Path) -> tuple[str, list[tuple[str, str | None, int]]]:
    """C that includes the step itself and exports sizeof and offsetof of every struct and field of `spec`,
    with the numbers the spec says they are."""
    lines = [f'#include "{step_c}"']
    want = []
    for name in spec.structs:
        size, fields = spec.layout(name)
        lines.append(f"EXPORT int probe_{len(want)}(void) {{ return sizeof({name}); }}")
        want.append((name, None, size))
        for at, f in fields:
            lines.append(f"EXPORT int probe_{len(want)}(void) {{ return offsetof({name}, {f.name}); }}")
            want.append((name, f.name, at))
    return "\n".join(lines) + "\n", want


def _probe(spec: generate.Spec, step_dir: Path, tmp_path: Path) -> list[tuple[str, str | None, int, int]]:
    """(struct, field or None for sizeof, the spec's number, the compiled step's) for every struct and field."""
    source, want = _probe_source(spec, step_dir / "step.c")
    store, exports = _compiled_probe(source, tmp_path)
    return [(s, f, n, exports[f"probe_{i}"](store)) for i, (s, f, n) in enumerate(want)]


def _compiled_probe(source: str, tmp_path: Path):
    """C built with the step's flags into a wasmtime instance: (store, exports)."""
    import wasmtime

    from wasm.step_module import FLAGS

    (tmp_path / "probe.c").write_text(source)
    out = tmp_path / "probe.wasm"
    proc = subprocess.run([sys.executable, "-m", "ziglang", "cc", *FLAGS, "-o", str(out), str(tmp_path / "probe.c")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = wasmtime.Store()
    return store, wasmtime.Instance(store, wasmtime.Module.from_file(store.engine, str(out)), []).exports(store)


def test_the_compiled_step_lays_out_its_structs_as_the_spec_says(tmp_path):
    got = _probe(generate.Spec(), ROOT / "wasm" / "step", tmp_path)
    assert [g for g in got if g[2] != g[3]] == []
    assert {s for s, f, _, _ in got if f is None} == set(step_abi.STRUCTS)


def _node(script: str, cwd: Path) -> str:
    proc = subprocess.run(["node", "--input-type=module", "-e", script], cwd=cwd, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_the_pages_structs_are_packed_as_python_packs_them():
    """formats.js's offsets are the spec's, and structs.js writes a struct byte for byte as step_abi.pack does."""
    src = (ROOT / "web" / "src").as_posix()
    offsets = json.loads(_node(f"import {{ STRUCTS }} from '{src}/formats.js'; console.log(JSON.stringify(STRUCTS));",
                               ROOT))
    for name in step_abi.STRUCTS:
        size, fields = step_abi.layout(name)
        assert offsets[name]["size"] == size
        assert {f: v["offset"] for f, v in offsets[name]["fields"].items()} == {f: at for f, (at, _) in fields.items()}
    qmat = {"kind": 6, "w": 100, "hb": 0, "d": 200, "m": 300, "sc": 0, "mb": 0}
    model = {"dim": 64, "hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16, "vocab": 999,
             "max_pos": 256, "eps": 1e-5, "rope_neox": 1, "act": 1, "embed_scale": 8.0, "attn_scale": 0.25, "embd": qmat,
             "head": {**qmat, "kind": 8}, "out_norm": 7,
             "rope": 3_000_000_000, "rope_factors": 0, "layer": 12}
    script = (f"import {{ sizeOf, writeStruct }} from '{src}/structs.js';"
              f"const b = new ArrayBuffer(sizeOf('Model')); writeStruct(b, 0, 'Model', {json.dumps(model)});"
              "console.log(Buffer.from(b).toString('hex'));")
    assert bytes.fromhex(_node(script, ROOT).strip()) == step_abi.pack("Model", model)
    with pytest.raises(KeyError, match="Model.layer not given"):
        step_abi.pack("Model", {k: v for k, v in model.items() if k != "layer"})
    missing = (f"import {{ writeStruct }} from '{src}/structs.js';"
               f"try {{ writeStruct(new ArrayBuffer(200), 0, 'Model', {json.dumps({**model, 'nope': 1})}); }}"
               "catch (e) { console.log(e.message); }")
    assert "no field nope" in _node(missing, ROOT)


def test_a_new_block_type_and_struct_field_reach_every_generated_file_and_nothing_else(tmp_path):
    """A fake block type the step reads and a fake field in the middle of Batch, added to a copy of the spec:
    every generated file changes, and the step compiled from the regenerated abi.h (step.c untouched) lays
    its structs out as the changed spec says."""
    fake_type = block_types.BlockType("Q7_X", 99, 32, 30, kind=len(block_types.OWN) + 1, bits=7, block=32, zero=64,
                                      scales="half", step=True)
    spec = generate.Spec()
    doc, fields = spec.structs["Batch"]
    at = [f.name for f in fields].index("slots")
    spec.structs["Batch"] = (doc, fields[:at] + [step_abi.Field("fake", "int32_t")] + fields[at:])
    spec = dataclasses.replace(spec, types=spec.types + (fake_type,), step_kinds=spec.step_kinds + ("Q7_X",))
    before, after = generate.outputs(), generate.outputs(spec)
    formats = (generate.KERNELS_H, generate.STEP_H, generate.FORMATS_JS)
    assert all(before[p] != after[p] for p in formats), "a generated file did not change"
    assert all(before[p] == after[p] for p in before if p not in formats), "a file not of the formats changed"
    assert "Q7_X" in after[generate.KERNELS_H] and "Q7_X = " in after[generate.STEP_H] and '"Q7_X"' in after[generate.FORMATS_JS]
    assert "fake" in after[generate.STEP_H] and "fake:" in after[generate.FORMATS_JS]
    step = tmp_path / "step"
    shutil.copytree(ROOT / "wasm" / "step", step)
    (step / "abi.h").write_text(after[generate.STEP_H])
    got = _probe(spec, step, tmp_path)
    assert [g for g in got if g[2] != g[3]] == []
    assert ("Batch", "slots", 28, 28) in got  # moved by the new field
    js = tmp_path / "js"
    js.mkdir()
    shutil.copy(ROOT / "web" / "src" / "structs.js", js / "structs.js")
    (js / "formats.js").write_text(after[generate.FORMATS_JS])
    out = _node(f"import {{ offsetOf }} from '{js.as_posix()}/structs.js'; console.log(offsetOf('Batch', 'slots'));", js)
    assert out.strip() == "28"


def test_the_steps_rope_angles_equal_numpys_float64_tables(tmp_path):
    """step.c turns each position's cos and sin from float64 inverse frequencies (step.bin holds no table): they
    round to the same fp32 numbers as numpy's float64 cos and sin of the same angles, over Gemma 3's 32,768
    positions of both its bases and a llama 3 model's factored frequencies."""

    from exporter.step_weights import rope_frequencies

    chunk, hd = 4096, 256
    store, ex = _compiled_probe(f'#include "{ROOT / "wasm" / "step" / "step.c"}"\n' + f"""
static double probe_inv[{hd // 2}];
static float probe_factors[{hd // 2}], probe_out[{chunk} * {hd}];
EXPORT double* probe_inv_at(void) {{ return probe_inv; }}
EXPORT float* probe_factors_at(void) {{ return probe_factors; }}
EXPORT float* probe_out_at(void) {{ return probe_out; }}
EXPORT void probe_rows(int first, int hd, int factored) {{
  for (int p = 0; p < {chunk}; p++) rope_row(probe_inv, factored ? probe_factors : 0, hd, first + p, probe_out + p * hd);
}}
""", tmp_path)
    mem = ex["memory"]
    rng = np.random.default_rng(0)
    for base, dim, factors in ((1e6, 256, None), (1e4, 256, None), (5e5, 64, rng.uniform(1, 8, 32).astype(np.float32))):
        inv = rope_frequencies(base, dim)
        mem.write(store, inv.tobytes(), ex["probe_inv_at"](store))
        if factors is not None:
            mem.write(store, factors.tobytes(), ex["probe_factors_at"](store))
        full = inv / factors.astype(np.float64) if factors is not None else inv
        for first in range(0, 32768, chunk):
            ex["probe_rows"](store, first, dim, int(factors is not None))
            got = np.frombuffer(mem.read(store, ex["probe_out_at"](store), ex["probe_out_at"](store) + chunk * dim * 4),
                                np.float32).reshape(chunk, dim // 2, 2)
            angle = np.arange(first, first + chunk, dtype=np.float64)[:, None] * full[None, :]
            want = np.stack([np.cos(angle), np.sin(angle)], -1).astype(np.float32)
            assert np.array_equal(got, want), (base, first, int((got != want).sum()), float(np.abs(got - want).max()))
