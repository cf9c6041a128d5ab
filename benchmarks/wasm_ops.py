"""Time each weight route onnxruntime-web's WASM EP offers, per projection shape of a model.

The page's decode is bound by the bytes its projections read per token; fewer bytes need a quantized
route whose WASM kernel is fast. This builds one small graph per (route, shape, rows) with random
weights, runs each in Node on the onnxruntime-web build the page ships (web/node_modules), and prints
the median time per call. Routes:

  fp32         MatMul, fp32 weights (what the page runs today)
  nbits4-a0    MatMulNBits 4-bit, block 32, accuracy_level 0 (fp32 compute)
  nbits4-a4    MatMulNBits 4-bit, block 32, accuracy_level 4 (int8 compute)
  nbits8-a0/4  MatMulNBits 8-bit, block 32
  dq-int       DynamicQuantizeLinear + MatMulInteger (uint8 weights) + scales
  dqmm         com.microsoft DynamicQuantizeMatMul (int8 weights)
  fp16         MatMul in fp16 (Cast in and out)

    python benchmarks/wasm_ops.py --rows 1,16 --threads 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
# SmolLM2-135M's projections: (name, K, N)
SHAPES = [("q/o", 576, 576), ("k/v", 576, 192), ("gate/up", 576, 1536), ("down", 1536, 576), ("head", 576, 49152)]
ROUTES = ("fp32", "nbits4-a0", "nbits4-a4", "nbits8-a0", "nbits8-a4", "dq-int", "dqmm", "fp16")


def _model(nodes, inits, k: int, n: int, opsets=(("", 21), ("com.microsoft", 1))) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])
    graph = helper.make_graph(nodes, "op", [x], [y], [numpy_helper.from_array(a, name) for name, a in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets], ir_version=10)


def build(route: str, k: int, n: int, rng: np.random.Generator) -> tuple[onnx.ModelProto, np.ndarray]:
    """The route's graph and the [K, N] fp32 weight it computes with (for the accuracy check)."""
    w = rng.standard_normal((k, n), dtype=np.float32) * 0.05
    if route == "fp32":
        return _model([helper.make_node("MatMul", ["x", "w"], ["y"])], {"w": w}, k, n), w
    if route == "fp16":
        nodes = [helper.make_node("Cast", ["x"], ["xh"], to=TensorProto.FLOAT16),
                 helper.make_node("MatMul", ["xh", "w"], ["yh"]),
                 helper.make_node("Cast", ["yh"], ["y"], to=TensorProto.FLOAT)]
        return _model(nodes, {"w": w.astype(np.float16)}, k, n), w.astype(np.float16).astype(np.float32)
    if route.startswith("nbits"):
        bits, level = int(route[5]), int(route[-1])
        block = 32
        blocks = k // block
        q = rng.integers(0, 2 ** bits, size=(n, blocks, block), dtype=np.uint8)
        if bits == 4:
            packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
            zp = np.full((n, (blocks + 1) // 2), 0x88, np.uint8)
        else:
            packed = q
            zp = np.full((n, blocks), 128, np.uint8)
        scales = (rng.random((n, blocks), dtype=np.float32) * 0.01).astype(np.float32)
        node = helper.make_node("MatMulNBits", ["x", "w", "s", "zp"], ["y"], domain="com.microsoft", K=k, N=n,
                                bits=bits, block_size=block, accuracy_level=level)
        eff = ((q.astype(np.float32) - 2 ** (bits - 1)) * scales[..., None]).reshape(n, k).T
        return _model([node], {"w": packed, "s": scales.reshape(-1), "zp": zp.reshape(-1)}, k, n), eff
    if route == "dq-int":
        wq = rng.integers(0, 256, size=(k, n), dtype=np.uint8)
        nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
                 helper.make_node("MatMulInteger", ["xq", "w", "xz", "wz"], ["acc"]),
                 helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
                 helper.make_node("Mul", ["xs", "ws"], ["scale"]),
                 helper.make_node("Mul", ["accf", "scale"], ["y"])]
        return (_model(nodes, {"w": wq, "wz": np.array(128, np.uint8), "ws": np.array(0.001, np.float32)}, k, n),
                (wq.astype(np.float32) - 128) * 0.001)
    if route == "dqmm":
        wq = rng.integers(-127, 128, size=(k, n), dtype=np.int8)
        node = helper.make_node("DynamicQuantizeMatMul", ["x", "w", "ws", "wz"], ["y"], domain="com.microsoft")
        return (_model([node], {"w": wq, "ws": np.full((n,), 0.001, np.float32), "wz": np.zeros((n,), np.int8)}, k, n),
                wq.astype(np.float32) * 0.001)
    raise ValueError(route)


NODE_SCRIPT = r"""
const ort = await import(process.env.ORT_PATH);
const [dir, threads, rows, reps] = [process.argv[2], +process.argv[3], process.argv[4].split(',').map(Number), +process.argv[5]];
ort.env.wasm.numThreads = threads;
const fs = await import('node:fs');
const jobs = JSON.parse(fs.readFileSync(`${dir}/jobs.json`, 'utf8'));
const out = [];
for (const job of jobs) {
  let session;
  try {
    session = await ort.InferenceSession.create(fs.readFileSync(`${dir}/${job.file}`), { executionProviders: ['wasm'] });
  } catch (err) {
    for (const m of rows) out.push({ ...job, rows: m, error: String(err.message || err).slice(0, 160) });
    continue;
  }
  const xb = fs.readFileSync(`${dir}/x-${job.k}.bin`);
  const x0 = new Float32Array(xb.buffer.slice(xb.byteOffset, xb.byteOffset + xb.byteLength));
  const y0 = (await session.run({ x: new ort.Tensor('float32', x0, [1, job.k]) })).y.data;
  fs.writeFileSync(`${dir}/${job.file}.y`, Buffer.from(new Float32Array(y0).buffer));
  for (const m of rows) {
    const x = new ort.Tensor('float32', Float32Array.from({ length: m * job.k }, () => Math.random() - 0.5), [m, job.k]);
    try {
      for (let i = 0; i < 3; i++) await session.run({ x });
      const times = [];
      for (let i = 0; i < reps; i++) { const t = performance.now(); await session.run({ x }); times.push(performance.now() - t); }
      times.sort((a, b) => a - b);
      out.push({ ...job, rows: m, ms: times[times.length >> 1] });
    } catch (err) {
      out.push({ ...job, rows: m, error: String(err.message || err).slice(0, 160) });
    }
  }
  await session.release();
}
console.log(JSON.stringify(out));
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16", help="activation rows per call (1: a decode step)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--routes", default=",".join(ROUTES))
    ap.add_argument("--shapes", default=",".join(s for s, _, _ in SHAPES))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    ort = ROOT / "web" / "node_modules" / "onnxruntime-web" / "dist" / "ort.node.min.mjs"
    if not ort.exists():
        ort = ROOT / "web" / "node_modules" / "onnxruntime-web" / "dist" / "ort.mjs"
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        jobs, refs = [], {}
        shapes = [s for s in SHAPES if s[0] in args.shapes.split(",")]
        for name, k, n in shapes:
            for route in args.routes.split(","):
                f = f"{route}-{k}x{n}.onnx"
                x = np.random.default_rng(k).standard_normal(k, dtype=np.float32)
                x.tofile(f"{tmp}/x-{k}.bin")
                model, weight = build(route, k, n, rng)
                onnx.save(model, f"{tmp}/{f}")
                refs[f] = x @ weight
                jobs.append({"route": route, "shape": name, "k": k, "n": n, "file": f})
        Path(tmp, "jobs.json").write_text(json.dumps(jobs))
        Path(tmp, "run.mjs").write_text(NODE_SCRIPT)
        proc = subprocess.run(["node", f"{tmp}/run.mjs", tmp, str(args.threads), args.rows, str(args.repeats)],
                              capture_output=True, text=True, env={"ORT_PATH": str(ort), "PATH": "/usr/bin:/bin"})
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        rows = json.loads(proc.stdout.strip().splitlines()[-1])
        for r in rows:  # relative L2 error of one row against numpy on the same weights
            y = Path(tmp, r["file"] + ".y")
            if y.exists():
                ref = refs[r["file"]]
                r["rel_err"] = float(np.linalg.norm(np.fromfile(y, np.float32) - ref) / np.linalg.norm(ref))
    if args.json:
        print(json.dumps(rows))
        return 0
    base = {(r["shape"], r["rows"]): r.get("ms") for r in rows if r["route"] == "fp32"}
    print("| shape K x N | rows | " + " | ".join(args.routes.split(",")) + " |")
    print("|---|---:|" + "---:|" * len(args.routes.split(",")))
    for (shape, m), fp32 in base.items():
        cells = []
        for route in args.routes.split(","):
            r = next(x for x in rows if x["route"] == route and x["shape"] == shape and x["rows"] == m)
            cells.append(f"{r['ms']:.3f} ({fp32 / r['ms']:.2f}x)" if "ms" in r else "error")
        k, n = next((k, n) for s, k, n in shapes if s == shape)
        print(f"| {shape} {k}x{n} | {m} | " + " | ".join(cells) + " |")
    err = {}
    for r in rows:
        if "rel_err" in r:
            err[r["route"]] = max(err.get(r["route"], 0.0), r["rel_err"])
    print("relative error of one row vs numpy, worst shape: " + ", ".join(f"{k} {v:.1e}" for k, v in err.items()))
    errors = {r["route"]: r["error"] for r in rows if "error" in r}
    for route, err in errors.items():
        print(f"{route}: {err}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
