"""GPTQ (Frantar et al. 2022) for the decoder's projections, on the grid MatMulNBits computes.

Round-to-nearest rounds each weight on its own. GPTQ rounds a projection's input columns one at a
time and spreads each column's rounding error over the columns not yet rounded, weighted by the
inverse of H = X^T X (X: the projection's calibration inputs), so the error of the *output* on real
activations is what is minimized. Layers go in order, each calibrated on the outputs of the layers
already quantized before it, so later layers correct for earlier layers' error.

The grid is MatMulNBits' (asymmetric, blocks along the input dimension, zero in range). With act
order (the default) columns go in order of decreasing H diagonal and every block's scale and zero
point are fixed first, from the weights as given (AWQ's clipped ones); without it a block's are set
when GPTQ reaches its first column, from the weights as the earlier columns' errors have left them.
The result is the integers themselves, packed as
MatMulNBits stores them (`pack_nbits`), since quantizing the dequantized weights again could pick
another grid; the float weights the graph is built from are replaced by their dequantized values.
"""

from __future__ import annotations

import numpy as np

from exporter.heap import release_freed
from exporter.quantizers.awq import block_grid
from exporter.quantizers.grid import Grid

# of H's mean diagonal, added to its diagonal. 0.1 rather than the paper's 0.01: a few thousand
# calibration tokens overfit, and text unlike them (chat answers, licence text) suffered (SmolLM2, AWQ
# then GPTQ in blocks of 128, KL to fp32: 0.35 -> 0.29 on chat, 0.39 -> 0.36 on licences; pydoc same)
DAMP = 0.1
SELF_SAMPLES, SELF_SAMPLE_LEN = 8, 512  # the model's own text added to the default calibration (model_samples)
ACT_ORDER = True  # SmolLM2, AWQ then GPTQ in blocks of 128, 7k tokens of pydoc: KL 0.140 with, 0.145 without
LAZY_COLUMNS = 128  # columns whose updates are applied together (GPTQ's lazy batch)
ROWS = 1024  # output rows a whole-matrix copy is made of at a time (a 7B gate_up's float32 copy is 470 MB)


def gptq_quantize(w, h, block: int, bits: int, act_order: bool = ACT_ORDER, consume: bool = False) -> Grid:
    """Quantize w [out, in] (torch, float) given h = X^T X [in, in] of its calibration inputs.

    act_order: round the columns in order of decreasing H diagonal (the inputs with the most energy
    first, while many columns are left to absorb their error), with every block's grid fixed
    beforehand from the weights as given (a block's columns are then not rounded together).
    consume: w (float32) is worked on in its own memory, not copied (gptq_layer's concatenation)."""
    import torch

    out_f, in_f = w.shape
    h = h.detach().float().contiguous()  # consumed: the caller's accumulator (gptq_layer's) is not kept
    dead = torch.diag(h) == 0  # an input that is always zero: its weights do not matter
    h[dead, dead] = 1
    levels = 2 ** bits - 1
    blocks = -(-in_f // block)
    w = w.detach()
    scales, zeros = torch.zeros(out_f, blocks), torch.zeros(out_f, blocks)
    if act_order:
        for r in range(0, out_f, ROWS):  # no padded copy of the whole matrix
            padded = torch.nn.functional.pad(w[r:r + ROWS].float(), (0, -in_f % block))
            padded[:, :in_f][:, dead] = 0
            scales[r:r + ROWS], zeros[r:r + ROWS] = block_grid(padded.reshape(-1, blocks, block), bits)
        perm = torch.argsort(torch.diag(h), descending=True)
    else:  # each block's grid is set when its first column comes up
        perm = torch.arange(in_f)
    w = _permuted_columns(w, perm, consume and w.dtype == torch.float32)
    w[:, dead[perm]] = 0
    _permute_symmetric_(h, perm)
    h.diagonal().add_(DAMP * torch.mean(torch.diag(h)))
    # the upper Cholesky factor of H^-1: row i holds how column i's error moves the later columns, made in
    # H's own memory (a 7B's down projection's H is 0.8 GB; torch's factorizations would each make another)
    u = _inverse_cholesky_upper_(h)
    q = torch.zeros(out_f, in_f, dtype=torch.uint8)
    lazy = max(LAZY_COLUMNS, block)  # a multiple of block (both powers of two): a block starts a batch or lies in one
    for i1 in range(0, in_f, lazy):
        i2 = min(i1 + lazy, in_f)
        w1, err = w[:, i1:i2].clone(), torch.zeros(out_f, i2 - i1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            g = int(perm[col]) // block
            if not act_order and col % block == 0:
                scales[:, g], zeros[:, g] = block_grid(w1[:, i:i + block], bits)
            scale, zero = scales[:, g], zeros[:, g]
            x = w1[:, i]
            qi = torch.clamp(torch.round(x / scale + zero), 0, levels)
            e = (x - (qi - zero) * scale) / u1[i, i]
            w1[:, i:] -= e[:, None] * u1[i, i:][None, :]
            err[:, i] = e
            q[:, col] = qi.to(torch.uint8)
        w[:, i2:].addmm_(err, u[i1:i2, i2:], alpha=-1)  # in place: err @ u whole is w's size again
    del u, h
    q = q[:, torch.argsort(perm)]
    return Grid(q.numpy(), scales.numpy().astype(np.float32), zeros.numpy().astype(np.uint8), block, bits)


def _permuted_columns(w, perm, in_place: bool):
    """w[:, perm] in float32: into w itself (in_place), else into one new matrix, ROWS rows at a time."""
    import torch

    out = w if in_place else torch.empty(w.shape, dtype=torch.float32)
    for r in range(0, w.shape[0], ROWS):
        out[r:r + ROWS] = w[r:r + ROWS][:, perm].float()
    return out


def _permute_rows_(m, perm) -> None:
    """m[perm] into m's own memory, one row held aside per cycle of the permutation."""
    p = perm.tolist()
    done = [False] * len(p)
    for start in range(len(p)):
        if done[start] or p[start] == start:
            continue
        held, i = m[start].clone(), start
        while True:
            done[i] = True
            if p[i] == start:
                m[i] = held
                break
            m[i] = m[p[i]]
            i = p[i]


def _permute_symmetric_(h, perm) -> None:
    """h[perm][:, perm] (h symmetric) in h's own memory: rows permuted, h transposed in place (blocks swapped),
    rows permuted again."""
    _permute_rows_(h, perm)
    n, b = h.shape[0], 512
    for i in range(0, n, b):
        h[i:i + b, i:i + b] = h[i:i + b, i:i + b].T.clone()
        for j in range(i + b, n, b):
            held = h[i:i + b, j:j + b].clone()
            h[i:i + b, j:j + b] = h[j:j + b, i:i + b].T
            h[j:j + b, i:i + b] = held.T
    _permute_rows_(h, perm)


def _inverse_cholesky_upper_(h):
    """U, upper triangular, with U^T U = h^-1 (h symmetric positive definite, float32, C-contiguous),
    computed in h's memory by LAPACK's potrf, potri and potrf again; returned as a view of it."""
    import torch
    from scipy.linalg import lapack

    def check(name: str, out, info: int) -> None:
        if info != 0 or not np.shares_memory(out, a):
            raise RuntimeError(f"GPTQ: LAPACK's {name} failed (info {info}) on the damped Hessian")

    a = h.numpy().T  # the same memory in Fortran order; h is symmetric, so a is h
    check("potrf", *lapack.spotrf(a, lower=0, clean=0, overwrite_a=1))  # a = R^T R, R upper
    check("potri", *lapack.spotri(a, lower=0, overwrite_c=1))  # a^-1's upper triangle
    check("potrf", *lapack.spotrf(a, lower=0, clean=1, overwrite_a=1))  # U, the rest zeroed
    return torch.from_numpy(a)


def model_samples(model, n: int = SELF_SAMPLES, length: int = SELF_SAMPLE_LEN, seed: int = 0) -> list[list[int]]:
    """Text the model writes itself, sampled at temperature 1 from a random first token (as LLM-QAT's
    data-free calibration does): what the model's activations look like on its own distribution, where
    the standard library's docs alone made GPTQ fit pydoc and lose elsewhere (chat answers' KL to fp32
    0.29 with pydoc alone, 0.23 with half pydoc and half these)."""
    import torch

    vocab = model.config.vocab_size
    length = min(length, getattr(model.config, "max_position_embeddings", length))
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(seed)
        first = torch.randint(min(100, vocab // 2), vocab, (n, 1))  # past the special and byte tokens
        out = model.generate(first, attention_mask=torch.ones_like(first), do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=length - 1, min_new_tokens=length - 1,
                             pad_token_id=0)
    return out.tolist()


class _Stop(Exception):
    pass


def apply_gptq(model, sequences: list[list[int]], block: int, bits: int, mlp_block: int | None = None,
               progress: bool = False, act_order: bool = ACT_ORDER) -> dict[str, Grid]:
    """Quantize the projections of a Llama-family `transformers` model layer by layer, in place (each
    weight becomes its dequantized value), and return each fused graph weight's Grid by its name in
    the decoder graph (`layers.{i}.qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`)."""
    from exporter.progress import stage

    layers = model.model.layers
    captured = capture_first_layer(model, sequences)

    grids: dict[str, Grid] = {}
    for i, layer in enumerate(stage("GPTQ (layers)", layers, enabled=progress)):
        found, captured = gptq_layer(i, layer, captured, block, bits, mlp_block, act_order)
        grids.update(found)
    return grids


def capture_first_layer(model, sequences: list[list[int]]) -> list[tuple]:
    """The first decoder layer's inputs (hidden states, keyword arguments: rotary tables, mask) for each
    sequence: the model run up to that layer, no further."""
    import torch

    captured: list[tuple] = []

    def catch(module, args, kwargs):
        captured.append((args[0] if args else kwargs.pop("hidden_states"), kwargs))
        raise _Stop

    hook = model.model.layers[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        with torch.no_grad():
            for seq in sequences:
                try:  # no KV cache: the layers run on these inputs more than once
                    model(torch.tensor([seq]), use_cache=False)
                except _Stop:
                    pass
    finally:
        hook.remove()
    return captured


def gptq_layer(i: int, layer, captured: list[tuple], block: int, bits: int, mlp_block: int | None = None,
               act_order: bool = ACT_ORDER) -> tuple[dict[str, Grid], list[tuple]]:
    """One layer's GPTQ on its inputs `captured` (capture_first_layer's, then this function's): the
    fused graph weights' Grids, the layer's weights replaced by their dequantized values, and the next
    layer's inputs (this one's quantized outputs, written into `captured` as each input is let go).

    The groups go in the order the layer computes them, each calibrated on what the groups before it give
    once quantized (GPTQ's reference's "true sequential"), so one group's Hessian lives at a time (a 7B's
    down projection's alone is 0.8 GB) and each pass stops at the projection it measures. A group's float
    weights are let go while it is quantized, and the attention's while the MLP is: their values are in
    their grids, and come back from them."""
    import torch

    grids: dict[str, Grid] = {}
    width = {"qkv_proj": block, "o_proj": block, "gate_up_proj": mlp_block or block, "down_proj": mlp_block or block}
    with torch.no_grad():
        attn, mlp = layer.self_attn, layer.mlp
        groups = {"qkv_proj": [attn.q_proj, attn.k_proj, attn.v_proj], "o_proj": [attn.o_proj],
                  "gate_up_proj": [mlp.gate_proj, mlp.up_proj], "down_proj": [mlp.down_proj]}

        def quantize(name: str, module, inputs: list[tuple], pop: bool = False, keep: bool = True) -> None:
            """keep: the dequantized weights put back (the passes after run them)."""
            mods = groups[name]
            hessian = [_hessian(module, inputs, mods[0], pop)]
            shapes = [m.weight.shape for m in mods]
            w = torch.empty(sum(s[0] for s in shapes), shapes[0][1])
            start = 0
            for m, shape in zip(mods, shapes):  # one float32 copy of the group, each part let go as it is made
                w[start:start + shape[0]] = m.weight
                start += shape[0]
                let_go(m)
            grid = gptq_quantize(w, hessian.pop(), width[name], bits, act_order, consume=True)
            del w
            grids[f"layers.{i}.{name}"] = grid
            if keep:
                restore(name)
            release_freed()  # the group's Hessian and working copies, out of glibc's heap

        def let_go(*mods) -> None:
            for m in mods:
                m.weight.data = torch.empty(0, dtype=m.weight.dtype)

        def restore(*names: str) -> None:  # the dequantized weights, ROWS rows at a time
            for name in names:
                grid, start = grids[f"layers.{i}.{name}"], 0
                for m in groups[name]:
                    out_f = m.out_features
                    m.weight.data = torch.empty(out_f, m.in_features, dtype=m.weight.dtype)
                    for r in range(0, out_f, ROWS):
                        m.weight[r:r + ROWS].copy_(torch.from_numpy(_dequantized(grid, start + r, start + out_f)))
                    start += out_f

        quantize("qkv_proj", layer, captured)
        quantize("o_proj", layer, captured)
        mlp_in = [(x, {}) for x in _inputs(layer, captured, mlp)]  # through the quantized attention
        let_go(*groups["qkv_proj"], *groups["o_proj"])
        quantize("gate_up_proj", mlp, mlp_in, keep=False)
        # down's inputs: gate and up computed from their grid a few rows at a time (a 7B's are 0.47 GB in float32)
        with _from_grid(groups["gate_up_proj"], grids[f"layers.{i}.gate_up_proj"]):
            quantize("down_proj", mlp, mlp_in, pop=True, keep=False)  # the MLP's inputs go as the Hessian is made
        release_freed()
        restore(*groups)
        # the next layer calibrates on this one's quantized outputs
        for n, (hidden, kwargs) in enumerate(captured):
            captured[n] = (layer_output(layer(hidden, **kwargs)), kwargs)
        return grids, captured


def _dequantized(grid: Grid, start: int, stop: int):
    """Up to ROWS of a grid's rows from `start` (to `stop` at most), dequantized."""
    return grid.rows(start, min(start + ROWS, stop)).dequantize()


def _from_grid(mods: list, grid: Grid):
    """A context in which the linear modules `mods` (the grid's rows, in order; their weights let go)
    compute their outputs from the grid, ROWS output features at a time."""
    import contextlib

    import torch

    def linear(start: int, m):
        def forward(x):
            out = torch.empty(*x.shape[:-1], m.out_features, dtype=x.dtype)
            for r in range(0, m.out_features, ROWS):
                w = torch.from_numpy(_dequantized(grid, start + r, start + m.out_features)).to(x.dtype)
                out[..., r:r + len(w)] = torch.nn.functional.linear(x, w)
            return out if m.bias is None else out + m.bias
        return forward

    @contextlib.contextmanager
    def computed():
        start = 0
        for m in mods:
            m.forward = linear(start, m)
            start += m.out_features
        try:
            yield
        finally:
            for m in mods:
                del m.forward
    return computed()


def _hessian(module, inputs: list[tuple], target, pop: bool = False):
    """X^T X of `target`'s input as `module` runs on `inputs` ((hidden states, keyword arguments) pairs),
    each pass stopped there; pop: each input is let go once used."""
    hs: dict = {"h": 0}
    add = _accumulate(hs, "h")

    def hook(mod, args) -> None:
        add(mod, args)
        raise _Stop

    _run_to(module, inputs, target, hook, pop)
    return hs["h"]


def _inputs(module, inputs: list[tuple], target) -> list:
    """`target`'s first argument as `module` runs on each of `inputs`, the pass stopped there."""
    got: list = []

    def hook(mod, args) -> None:
        got.append(args[0])
        raise _Stop

    _run_to(module, inputs, target, hook)
    return got


def _run_to(module, inputs: list[tuple], target, hook, pop: bool = False) -> None:
    handle = target.register_forward_pre_hook(hook)
    try:
        n = 0
        while n < len(inputs):
            hidden, kwargs = inputs[n]
            try:
                module(hidden, **kwargs)
            except _Stop:
                pass
            if pop:
                del inputs[n]
            else:
                n += 1
            release_freed()  # a sequence's temporaries (glibc's heap grew ~24 MB a sequence at 7B without)
    finally:
        handle.remove()


def _accumulate(hs: dict, name: str):
    """A pre-hook adding X^T X of a projection's input to hs[name], in place and in float32 (as GPTQ's
    reference implementation keeps it; the damping dominates float32's rounding)."""
    import torch

    def hook(module, args) -> None:
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        if isinstance(hs[name], int):
            hs[name] = torch.zeros(x.shape[1], x.shape[1])
        hs[name].addmm_(x.T, x)
    return hook


def layer_output(out):
    """A decoder layer's hidden states, whether transformers returns them alone or in a tuple."""
    return out[0] if isinstance(out, tuple) else out
