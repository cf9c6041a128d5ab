"""The WASM step's quantized KV pools (kvDtype 'int8' and 'int4', wasm/step/kv.h) in wasmtime: rows written bit
for bit as the native pool writes them, read as numpy reads them, the two-tier rule's numbers independent of
how the steps are cut, and the native engine's numbers on its pools of the same kinds (issue 52)."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.backends.kv_pool import (
    _fwht,
    dequantize_rows,
    dequantize_rows_int4,
    quantize_rows,
    quantize_rows_int4,
)
from runtime.core.kv_blocks import kv_int4_groups
from runtime.core.kv_tails import TailSlots
from runtime.core.step_batch import Chunk, build_step
from tests.web.test_wasm_step import WasmtimeBackend, log_softmax

BS = 16


@pytest.fixture(scope="module")
def step(step_files):
    from wasm.step_module import WasmStep

    return WasmStep(step_files / "step.wasm", step_files, 4, BS, max_tokens=8, kv_dtype="int4")


def awkward_rows(d: int) -> np.ndarray:
    """Heavy tails, zero rows, fp16-subnormal scales, and numbers past fp16's range."""
    rng = np.random.default_rng(d)
    return np.concatenate([rng.standard_t(3, (64, d)) * 4, np.zeros((2, d)), rng.normal(size=(4, d)) * 1e-5,
                           rng.normal(size=(2, d)) * 1e5]).astype(np.float32)


@pytest.mark.parametrize("d", [32, 48, 64, 96, 128])
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_the_steps_rows_are_the_native_pools_bit_for_bit(step, kv_dtype, d):
    if kv_dtype == "int4" and d % 32:
        pytest.skip("an int4 pool needs head_dim a multiple of 32")
    x = awkward_rows(d)
    for kind in (0, 1):
        q, s = step.quantize_kv(x, kv_dtype, kind)
        want_q, want_s = quantize_rows(x) if kv_dtype == "int8" else quantize_rows_int4(x, kv_int4_groups(d)[kind])
        assert np.array_equal(q, want_q)
        assert np.array_equal(s.view(np.uint16), want_s.view(np.uint16))


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_the_step_reads_a_stored_row_as_numpy_does(step, kv_dtype, d):
    """A key's score against the query rounded to 16 bits as ruvllm.PagedAttention rounds it (int4: the query
    rotated first, the row left rotated) and a value's weighted row (int4: in the rotated space, as the step
    sums them before rotating back once)."""
    rng = np.random.default_rng(7)
    x, qn = rng.standard_t(3, (2, d)).astype(np.float32) * 3, rng.normal(size=d).astype(np.float32)
    kq, ks = step.quantize_kv(x[:1], kv_dtype, 0)
    vq, vs = step.quantize_kv(x[1:], kv_dtype, 1)
    score, _ = step.kv_read(kv_dtype, qn, kq[0], ks[0], 0.0)
    _, weighted = step.kv_read(kv_dtype, qn, vq[0], vs[0], 0.7)
    if kv_dtype == "int8":
        key, value = dequantize_rows(kq, ks)[0], dequantize_rows(vq, vs)[0]
    else:
        key, value = dequantize_rows_int4(kq, ks, rotated=True)[0], dequantize_rows_int4(vq, vs, rotated=True)[0]
        qn = _fwht(qn)
    step16 = np.float32(np.abs(qn).max() / np.float32(32767))
    rounded = np.clip(np.rint(qn / step16), -32767, 32767) * np.float64(step16)
    assert score == pytest.approx(float(rounded @ key), rel=1e-6, abs=1e-5)
    np.testing.assert_allclose(weighted, 0.7 * value, rtol=1e-5, atol=1e-5 * np.abs(value).max())


def teacher_forced(backend, ids: list[int], chunk: int, floor: int = 0, blocks: int = 40) -> np.ndarray:
    """ids through `backend` `chunk` tokens a step (one sequence, blocks in a scrambled order), every
    position's log-probabilities."""
    backend.allocate(blocks, BS)
    table = [(7 * i + 3) % blocks for i in range(blocks)]
    out = []
    for s in range(0, len(ids), chunk):
        toks = ids[s:s + chunk]
        slots = [table[p // BS] * BS + p % BS for p in range(s, s + len(toks))]
        batch = build_step([Chunk(toks, s, table[:(s + len(toks) - 1) // BS + 1], slots, True, logits_rows=len(toks),
                                  exact_from=floor)], BS, want_full_logits=True)
        out.append(np.asarray(backend.run(batch).logits))
    return log_softmax(np.concatenate(out))


def some_ids(n: int) -> list[int]:
    return np.random.default_rng(0).integers(100, 20000, n).tolist()


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_a_positions_numbers_do_not_depend_on_how_steps_are_cut(step_files, kv_dtype):
    """The same 150 tokens in steps of 1, 7, 16 and 40 (and a floor of 32): bit for bit the same logits, so
    the rows read exact (own block and the one before it, from the floor on) and as stored are chosen by
    position alone, whether they come from the tails, the pool or this step's rows."""
    ids = some_ids(150)
    for floor in (0, 32):
        runs = [teacher_forced(WasmtimeBackend(step_files, kv_dtype=kv_dtype), ids, chunk, floor) for chunk in (16, 1, 7, 40)]
        for other in runs[1:]:
            assert np.array_equal(runs[0], other)
    fp32 = teacher_forced(WasmtimeBackend(step_files), ids, 16)
    kl = (np.exp(fp32) * (fp32 - runs[0])).sum(axis=1)
    assert 0 < kl.mean() < 0.05  # quantized, and near the fp32 pool


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_threads_split_a_decodes_segments_without_changing_a_number(step_files, kv_dtype):
    """A 300-token prompt, then decode steps of two rows and of one: on three threads a one-row decode's three
    (token, kv head) items are split by segments of 128 positions and folded after; on one thread (and for
    larger steps) each item folds its segments as it goes. The same logits, bit for bit."""
    from wasm.step_module import THREADED, WasmStep

    ids = some_ids(300)
    table, other = list(range(20)), [20, 21]
    steps = [build_step([Chunk(ids[s:s + 100], s, table[:(s + 99) // BS + 1], list(range(s, s + 100)), True,
                               logits_rows=4)], BS) for s in range(0, 300, 100)]
    steps.append(build_step([Chunk([5], 300, table, [300], True), Chunk([9, 8], 0, other, [320, 321], True)], BS))
    steps.append(build_step([Chunk([6], 301, table, [301], True), Chunk([7], 2, other, [322], True)], BS))
    steps += [build_step([Chunk([4 + p], p, table, [p], True)], BS) for p in (302, 303)]  # 3 items: split on 3 threads
    one = WasmStep(step_files / "step.wasm", step_files, 24, BS, max_tokens=128, kv_dtype=kv_dtype)
    split = WasmStep(step_files / THREADED, step_files, 24, BS, max_tokens=128, kv_dtype=kv_dtype, threads=3)
    tails = [TailSlots(BS), TailSlots(BS)]
    try:
        for batch in steps:
            got = split.run(batch, *tails[0].step_slots(batch))
            assert np.array_equal(got, one.run(batch, *tails[1].step_slots(batch)))
    finally:
        split.close()


def test_a_step_whose_exact_rows_have_no_tail_is_refused(step_files):
    """A token kept for a block with no tail slot, or a row reading exact rows of such a block from earlier
    steps: a clear error; with TailSlots' slots, the same steps run."""
    from wasm.step_module import WasmStep

    def make():
        return WasmStep(step_files / "step.wasm", step_files, 8, BS, max_tokens=32, kv_dtype="int8")

    first = build_step([Chunk(list(range(5, 25)), 0, [0, 1], list(range(20)), True)], BS)
    later = build_step([Chunk([7], 20, [0, 1], [20], True)], BS)
    wasm = make()
    with pytest.raises(ValueError, match="tails do not hold"):
        wasm.run(first, [3], [])
    wasm.run(first)  # its queries read exact rows of this step only
    with pytest.raises(ValueError, match="tails do not hold"):
        wasm.run(later)  # positions 0-19 exact, from tails never written
    wasm, tails = make(), TailSlots(BS)
    for batch in (first, later):
        wasm.run(batch, *tails.step_slots(batch))


def test_tail_slots_follow_the_blocks_being_written():
    """A sequence holds slots for its own block and the one before it (from its floor); a block the last step
    sealed keeps its slot through that step and gives it back before the next; dropped blocks give theirs back;
    freed slots are taken again."""
    tails = TailSlots(BS)

    def step(tokens, start, table, floor=0, dropped=()):
        slots = [table[p // BS] * BS + p % BS for p in range(start, start + len(tokens))]
        batch = build_step([Chunk(tokens, start, table, slots, True, exact_from=floor)], BS)
        batch.dropped_blocks = list(dropped)
        return tails.step_slots(batch)

    kept, changes = step(list(range(40)), 0, [5, 6, 9])  # a 40-token prompt: keeps blocks 6 and 9 (positions 16-39)
    assert kept == list(range(16, 40)) and changes == [(6, 0), (9, 1)]
    for p in range(40, 48):  # the step at 47 seals block 6: the next starts in block 2 and reads 9 and 2 exact
        kept, changes = step([1], p, [5, 6, 9] + [2] * (p == 47))
        assert kept == [0] and changes == []
    assert tails.slot_of == {6: 0, 9: 1}  # the step at 47 still read block 6 exact
    kept, changes = step([1], 48, [5, 6, 9, 2])  # block 6's slot goes back and block 2 takes it
    assert changes == [(6, -1), (2, 0)] and tails.slot_of == {9: 1, 2: 0}
    kept, changes = step([3], 0, [6], dropped=[5, 9, 2])  # another sequence; the first one's blocks dropped
    assert changes == [(2, -1), (9, -1), (6, 0)] and tails.slot_of == {6: 0} and tails.slots == 2


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_the_steps_pools_give_the_native_pools_numbers(step_files, smol_int4, kv_dtype):
    """SmolLM2's default package, 256 tokens of text teacher-forced in steps of 16: the step on its int8 / int4
    pool against the native engine on its own (the same rows bit for bit, attention summed in another order and
    activations rounded to int8 on both sides), no further apart than the two engines' fp32 pools plus what
    quantizing slightly different rows adds; and each as far from its own fp32 pool as the other."""
    from runtime.backends.native import NativeBackend
    from runtime.core.engine import Engine
    from runtime.package import load_package

    pkg = load_package(smol_int4)
    text = " ".join(["Gutenberg's press spread printing across Europe within decades."] * 3) + " " + \
        "The sea covers most of the Earth and holds most of its water, life and weather."
    ids = (Engine.from_package(smol_int4, verify=False).encode_prompt(text) * 8)[:256]

    def kl(a, b):
        return (np.exp(a) * (a - b)).sum(axis=1).mean()

    runs = {(engine, d): teacher_forced(make(d), ids, 16) for d in ("fp32", kv_dtype)
            for engine, make in (("native", lambda d: NativeBackend(pkg, kv_dtype=d)),
                                 ("wasm", lambda d: WasmtimeBackend(step_files, kv_dtype=d)))}
    base = kl(runs["native", "fp32"], runs["wasm", "fp32"])
    apart = kl(runs["native", kv_dtype], runs["wasm", kv_dtype])
    own = {e: kl(runs[e, "fp32"], runs[e, kv_dtype]) for e in ("native", "wasm")}
    assert apart < base + 2 * own["native"], (base, apart, own)
    assert own["wasm"] < 1.5 * own["native"] + 0.002, own
