"""Opening a GGUF without the exporter (issue 75): the standard-library header reader against gguf-py, the
step's plan (runtime/formats/step_plan.py) against the arrays the exporter writes, and the step's own
repacking of a file's raw blocks (wasm/step/repack.h) byte for byte against the exporter's, for every type
the step reads, in pieces of rows as the page feeds it."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.errors import PackageError
from runtime.formats.block_types import BY_NAME, STEP_TYPES
from runtime.formats.gguf_file import NeedBytes, joined_header, read_header, read_header_file
from tests.exporter.test_gguf_import import random_blocks, write_tiny_gguf
from tests.exporter.test_streamed_export import MIX, write_mixed_gguf


def _gguf_py_value(field):
    from gguf import GGUFValueType

    if field.types[0] == GGUFValueType.ARRAY:
        item = field.types[-1]
        if item == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i][0].item() for i in field.data]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]][0].item()


@pytest.fixture(scope="module")
def gemma_like(workdir, smol_gguf):
    """A Gemma 3 GGUF of SmolLM2's weights (head norms, sandwich norms, a window), Q5_0 projections, Q8_0
    embedding."""
    path = workdir / "repack-gemma3.gguf"
    if not path.exists():
        write_mixed_gguf(path, smol_gguf, {name: "Q5_0" for name in MIX}, embedding="Q8_0", head=None, arch="gemma3")
    return path


def test_the_header_reads_as_gguf_py_reads_it(smol_gguf, gemma_like):
    import gguf

    for path in (smol_gguf, gemma_like):
        header = read_header_file(path, first=4096)  # asks for more, again and again
        reader = gguf.GGUFReader(str(path))
        assert set(header.metadata) == {k for k in reader.fields if not k.startswith("GGUF.")}
        for key, value in header.metadata.items():
            want = _gguf_py_value(reader.fields[key])
            if isinstance(value, float):
                assert value == pytest.approx(want, rel=1e-7), key
            else:
                assert value == want, key
        assert list(header.tensors) == [t.name for t in reader.tensors]
        for t in reader.tensors:
            got = header.tensors[t.name]
            assert got.type_name == t.tensor_type.name and got.offset == t.data_offset, t.name
            assert got.shape == tuple(int(d) for d in reversed(t.shape)) and got.nbytes == t.n_bytes, t.name


def test_a_short_or_foreign_header_is_asked_for_or_refused(smol_gguf, tmp_path):
    head = smol_gguf.read_bytes()[:1000]
    with pytest.raises(NeedBytes) as more:
        read_header(head)
    assert more.value.total > len(head)
    data, size, reads = smol_gguf.read_bytes(), 1 << 20, 0  # the page's first read is 1 MB
    while True:
        reads += 1
        try:
            read_header(data[:size])
            break
        except NeedBytes as again:
            size = again.total
    assert reads == 2  # the vocabulary's rest is estimated from its tokens so far, not found by doubling
    with pytest.raises(PackageError, match="not a GGUF"):
        read_header(b"PK\x03\x04" + bytes(64))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(head)
    with pytest.raises(PackageError, match="truncated"):
        read_header_file(cut)


def test_a_split_ggufs_parts_read_as_the_one_file(smol_gguf, tmp_path):
    """gguf-split's parts, laid end to end, are one file to the plan: the same metadata and tensors as the whole
    file, each tensor's bytes where the joined header says; parts missing or out of order are refused by name."""
    whole, split = tmp_path / "whole.gguf", tmp_path / "split.gguf"
    write_tiny_gguf(whole, smol_gguf, "Q4_K")
    write_tiny_gguf(split, smol_gguf, "Q4_K", split_max_tensors=7)
    paths = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(paths) == 3, paths
    bases = np.cumsum([0] + [p.stat().st_size for p in paths])[:-1]
    header = joined_header([(read_header_file(p), int(b)) for p, b in zip(paths, bases, strict=True)])
    one = read_header_file(whole)
    assert header.metadata == one.metadata
    assert [(t.name, t.shape, t.type_name) for t in header.tensors.values()] \
        == [(t.name, t.shape, t.type_name) for t in one.tensors.values()]
    joined, data = b"".join(p.read_bytes() for p in paths), whole.read_bytes()
    for t in header.tensors.values():
        u = one.tensors[t.name]
        assert joined[t.offset:t.offset + t.nbytes] == data[u.offset:u.offset + u.nbytes], t.name
    parts = [(read_header_file(p), int(b)) for p, b in zip(paths, bases, strict=True)]
    with pytest.raises(PackageError, match="3 parts: 2 given"):
        joined_header(parts[:2])
    with pytest.raises(PackageError, match="part 2 of the split GGUF is not its part 2"):
        joined_header([parts[0], parts[2], parts[1]])
    assert joined_header([(one, 0)]) is one


def test_the_plan_is_the_exporters_step_bin(gemma_like, tmp_path):
    """step.json from the plan alone (no array read) is the exporter's, and each array's bytes lie where it says."""
    from exporter.step_weights import write_step_weights
    from runtime.formats.step_plan import step_plan

    plan = step_plan(read_header_file(gemma_like), 128)
    index = write_step_weights(gemma_like, tmp_path, 128)
    assert plan.index() == index
    assert plan.size == (tmp_path / "step.bin").stat().st_size
    assert plan.config["arch"] == "gemma3" and plan.config["windows"][5] == 0 and plan.config["windows"][0] > 0
    json_plan = plan.to_json()
    assert json_plan["sources"]["embd"]["type"] == "Q8_0" and json_plan["sources"]["0.q"]["type"] == "Q5_0"


def test_a_file_the_step_cannot_run_is_refused_by_name_from_its_header(smol_gguf, tmp_path):
    from runtime.formats.step_plan import step_plan

    path = tmp_path / "q2k.gguf"
    write_mixed_gguf(path, smol_gguf, {name: "Q2_K" for name in MIX}, embedding="Q8_0", head=None)
    with pytest.raises(PackageError, match="Q2_K"):
        step_plan(read_header_file(path), 64, "q2k.gguf")


@pytest.fixture(scope="module")
def repacker(step_files):
    """step.wasm in wasmtime: step_repack over arrays placed in its memory."""
    import wasmtime

    from runtime.formats.step_abi import pack

    store = wasmtime.Store(wasmtime.Engine())
    exports = wasmtime.Instance(store, wasmtime.Module.from_file(store.engine, str(step_files / "step.wasm")),
                                []).exports(store)
    memory, arena, repack = exports["memory"], exports["arena"], exports["step_repack"]

    def run(type_name: str, raw: np.ndarray, rows: int, cols: int, piece: int) -> dict[str, np.ndarray]:
        from runtime.formats.block_types import OWN
        from runtime.formats.step_abi import PARTS
        from runtime.formats.step_plan import step_parts

        parts = step_parts(type_name, rows, cols)
        at = {}
        for part, dtype, shape in parts:
            n = int(np.prod(shape)) * np.dtype(dtype).itemsize
            at[part] = arena(store, n)
            memory.write(store, b"\xa5" * n, at[part])  # not zero: every byte must be written
        qmat = arena(store, 64)
        memory.write(store, pack("QMat", {"kind": OWN[type_name].kind, **{p: at.get(p, 0) for p in PARTS}}), qmat)
        row_bytes = raw.shape[1]
        src = arena(store, piece * row_bytes)
        for r0 in range(0, rows, piece):
            memory.write(store, raw[r0:r0 + piece].tobytes(), src)
            assert repack(store, qmat, rows, cols, src, r0, min(piece, rows - r0)) == 0
        assert repack(store, qmat, rows, cols, src, 2, 4) == 1  # not a whole group of four rows
        out = {}
        for part, dtype, shape in parts:
            n = int(np.prod(shape)) * np.dtype(dtype).itemsize
            out[part] = np.frombuffer(memory.read(store, at[part], at[part] + n), dtype).reshape(shape)
        return out

    return run


# the bytes of a block that hold fp16 scales (ggml's block structs)
SCALE_BYTES = {"Q4_0": (0, 1), "Q5_0": (0, 1), "Q8_0": (0, 1), "Q4_1": (0, 1, 2, 3), "Q5_1": (0, 1, 2, 3),
               "Q4_K": (0, 1, 2, 3), "Q5_K": (0, 1, 2, 3), "Q6_K": (208, 209)}


@pytest.mark.parametrize("type_name", list(STEP_TYPES))
def test_the_steps_repacking_is_the_exporters(type_name, repacker):
    """Every bit of a file's blocks (random bytes, not only what a quantizer writes) lands where the exporter
    puts it, fed in pieces of 8 rows."""
    from exporter.step_weights import step_matrix

    rows, cols = 24, 512
    raw = random_blocks(type_name, rows, cols, seed=3).copy()
    noise = np.random.default_rng(5).integers(0, 256, raw.shape, dtype=np.uint8)
    scales = SCALE_BYTES[type_name]  # kept sane (a NaN's payload need not survive numpy's widening)
    keep = np.zeros(BY_NAME[type_name].nbytes, bool)
    keep[list(scales)] = True
    mask = np.tile(keep, raw.shape[1] // keep.size)
    raw[:, ~mask] = noise[:, ~mask]
    want = step_matrix(type_name, raw, rows, cols)
    got = repacker(type_name, np.ascontiguousarray(raw), rows, cols, piece=8)
    assert list(got) == list(want)
    for part in want:
        assert got[part].dtype == want[part].dtype and got[part].shape == want[part].shape, part
        np.testing.assert_array_equal(got[part].view(np.uint8), want[part].view(np.uint8), err_msg=part)
