"""`python -m exporter adapter`: a PEFT LoRA folder into the package's adapter format.

The format is what the runtime reads fastest and the page can fetch as two files: adapter.json (base
model, rank, targets, the file's size and sha256) and adapter.safetensors holding, per target, A
[layers, in, rank] and B [layers, rank, out] with PEFT's scale (alpha / r, rsLoRA, per-module
patterns) folded into B, zero where a layer lacks the target. fp16 halves the file; the runtime
computes in fp32 either way.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from exporter.staging import staging_dir
from runtime.backends.adapter_weights import adapter_arrays
from runtime.core.adapters import (
    ADAPTER_FORMAT,
    DEFAULT_MAX_LORA_RANK,
    OWN_MANIFEST,
    OWN_WEIGHTS,
    PEFT_CONFIG,
    AdapterError,
    own_tensor,
    read_adapter,
)
from runtime.package import file_digest, load_package

DTYPES = {"fp32": np.float32, "fp16": np.float16}


def convert_adapter(peft_dir: str | Path, base: str | Path, out_dir: str | Path, dtype: str = "fp32",
                    max_rank: int = DEFAULT_MAX_LORA_RANK) -> Path:
    """Check a PEFT adapter against the base package and write it in the package's adapter format."""
    from safetensors.numpy import save_file

    if dtype not in DTYPES:
        raise AdapterError(f"unknown --dtype {dtype!r}; choose fp32 or fp16")
    pkg = load_package(base)
    peft = Path(peft_dir).expanduser()
    if not (peft / PEFT_CONFIG).exists():
        raise AdapterError(f"{peft_dir}: not a PEFT LoRA folder (no {PEFT_CONFIG})")
    info = read_adapter(peft.name, peft, pkg.config, pkg.manifest["architecture"], max_rank)
    arrays = adapter_arrays(info, pkg.config)
    tensors = {}
    for target, (a, b) in arrays.items():
        tensors[own_tensor(target, "A")] = np.ascontiguousarray(a.astype(DTYPES[dtype]))
        tensors[own_tensor(target, "B")] = np.ascontiguousarray(b.astype(DTYPES[dtype]))
    out = Path(out_dir)
    tmp = staging_dir(out.parent, "adapter")
    try:
        save_file(tensors, str(tmp / OWN_WEIGHTS))
        peft_cfg = json.loads((peft / PEFT_CONFIG).read_text())
        manifest = {
            "format": ADAPTER_FORMAT, "format_version": 1, "name": peft.name, "rank": info.rank,
            "targets": list(info.targets), "dtype": dtype, "scale": "folded into B",
            "base": {"architecture": pkg.manifest["architecture"], "name": pkg.name,
                     "trained_on": info.base, "num_layers": pkg.config["num_layers"],
                     "hidden_size": pkg.config["hidden_size"]},
            "source": {"kind": "peft", "id": info.id, **{k: peft_cfg.get(k) for k in (
                "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_modules")}},
            "files": {OWN_WEIGHTS: {"size": (tmp / OWN_WEIGHTS).stat().st_size, "sha256": file_digest(tmp / OWN_WEIGHTS)}},
        }
        (tmp / OWN_MANIFEST).write_text(json.dumps(manifest, indent=2))
        read_adapter(peft.name, tmp, pkg.config, pkg.manifest["architecture"], max_rank)  # the runtime's own check
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def export_user_adapter(user: str, key: str, state_dir: str | None, base: str, output: str | Path) -> Path:
    """A user's newest learned adapter (runtime/serve/personalization.py) as a PEFT folder: the deep loop
    starts from it with PEFT, and the result comes back as any adapter does."""
    from runtime.serve.personalization import package_root, stored_adapter

    pkg = load_package(base)
    root = package_root(pkg, state_dir)
    folder = stored_adapter(root, key, user)
    if folder is None:
        raise AdapterError(f"no adapter is stored for user {user!r} (key {key!r}) of {pkg.name} in {root.parent}")
    output = Path(output)
    if output.exists():
        raise AdapterError(f"{output} exists; choose a new folder")
    shutil.copytree(folder, output)
    return output
