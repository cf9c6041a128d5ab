"""LoRA adapters as the engine sees them: what one is (read from its folder, checked against the
package), and which of the graph's adapter slots holds it.

An adapter is a folder, either as PEFT writes it (`adapter_config.json` + `adapter_model.safetensors`)
or as `python -m exporter adapter` writes it (`adapter.json` + `adapter.safetensors`, the graph's own
stacked layout with the scale folded in). Everything here reads only JSON (a safetensors file starts
with a JSON header naming every tensor's dtype and shape), so it runs in Pyodide; the backend reads
the numbers. An adapter's id is a digest of its weights and scaling, so the prefix cache keys blocks
by content: one adapter under two names shares blocks, two adapters never do.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from runtime import contract as C
from runtime.errors import RequestError

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
OWN_MANIFEST, OWN_WEIGHTS = "adapter.json", "adapter.safetensors"
ADAPTER_FORMAT = "ruvllm-adapter"
DEFAULT_MAX_LORA_RANK = 16
_PEFT_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


# PEFT modules of checkpoints that store projections fused (Phi-3), and the graph targets they hold, in order
FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_ITEM_BYTES = {"F32": 4, "F16": 2, "BF16": 2}


def _rows(ref: TensorRef, first: int, count: int) -> TensorRef:
    """Rows [first, first + count) of a 2-D tensor: contiguous bytes, so a narrower reference."""
    row = ref.shape[1] * _ITEM_BYTES.get(ref.dtype, 0)
    return TensorRef(ref.dtype, (count, ref.shape[1]), ref.start + first * row, ref.start + (first + count) * row)


def own_tensor(target: str, which: str) -> str:
    """A tensor's name in the exporter's adapter file: [layers, in, rank] for A, [layers, rank, out] for B."""
    return f"{target}.{which}"


class AdapterError(RequestError):
    """An adapter that cannot serve this package: a wrong base, too large a rank, missing or corrupt files."""


class UnknownAdapterError(RequestError):
    """A request names an adapter that is not loaded (or was unloaded)."""


def target_features(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each LoRA target for a package's config."""
    h, d = config["hidden_size"], config["head_dim"]
    q, kv, inter = config["num_heads"] * d, config["num_kv_heads"] * d, config["intermediate_size"]
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


@dataclass(frozen=True)
class TensorRef:
    """One tensor of a safetensors file: where its bytes are."""

    dtype: str  # safetensors' name: F32, F16, BF16
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def safetensors_index(path: Path) -> dict[str, TensorRef]:
    """The tensors a safetensors file holds, from its JSON header; AdapterError when it is not one."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            (size,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
            total = path.stat().st_size
            if not 0 < size <= total - 8:
                raise ValueError("bad header length")
            header = json.loads(fh.read(size))
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise AdapterError(f"{path}: not a readable safetensors file ({err})") from None
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        if not 0 <= start <= end <= total - 8 - size:
            raise AdapterError(f"{path}: corrupt safetensors file (tensor {name} lies outside it)")
        out[name] = TensorRef(meta["dtype"], tuple(meta["shape"]), 8 + size + start, 8 + size + end)
    return out


@dataclass
class LoraPart:
    """One (layer, target) of an adapter: where its A and B are and the scale B is multiplied by."""

    a: TensorRef  # PEFT: [r, in]; own format: the stacked [layers, in, r] of the target
    b: TensorRef
    scale: float
    module: str = ""  # PEFT: the model's Linear it adapts (q_proj, or a fused qkv_proj that holds the target)


@dataclass
class AdapterInfo:
    name: str
    path: Path
    kind: str  # "peft" or "ruvllm"
    id: str  # digest of the weights and their scaling: what the prefix cache keys blocks by
    rank: int
    targets: tuple[str, ...]
    weights: Path
    parts: dict[tuple[int, str], LoraPart] = field(default_factory=dict)  # PEFT: per (layer, target)
    stacked: dict[str, tuple[TensorRef, TensorRef]] = field(default_factory=dict)  # own format: per target
    base: str | None = None  # the base model it was trained on, as its config names it


def _digest(weights: Path, scaling: dict | None) -> str:
    """sha256 of the weights file, after the scaling settings' JSON when there are any (a PEFT folder's
    numbers mean nothing without them): the adapter's id, or (scaling None) a file's plain sha256."""
    h = hashlib.sha256(json.dumps(scaling, sort_keys=True).encode() if scaling is not None else b"")
    with open(weights, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest() if scaling is None else h.hexdigest()[:32]


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the module name's end."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_adapter(name: str, path: str | Path, config: dict, architecture: str,
                 max_rank: int = DEFAULT_MAX_LORA_RANK) -> AdapterInfo:
    """Read and check an adapter folder against a package's config; AdapterError says what is wrong."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise AdapterError(f"{path}: no such adapter folder")
    if (p / OWN_MANIFEST).exists():
        info = _read_own(name, p, config, architecture)
    elif (p / PEFT_CONFIG).exists():
        info = _read_peft(name, p, config)
    else:
        raise AdapterError(f"{path}: not a LoRA adapter (no {PEFT_CONFIG} or {OWN_MANIFEST})")
    if info.rank > max_rank:
        raise AdapterError(f"adapter {name!r} has rank {info.rank}, more than --max-lora-rank {max_rank}")
    return info


def peft_lora_config(rank: int, alpha: float, targets, base: str = "", layers=None) -> dict:
    """adapter_config.json of a plain LoRA as PEFT writes it (a user's adapter: micro_lora.py natively,
    runtime/serve/web_personal.py in the page); `layers`: PEFT's layers_to_transform (None: every layer)."""
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "base_model_name_or_path": base, "use_rslora": False, "use_dora": False}
    if layers is not None:
        config["layers_to_transform"] = sorted(layers)
    return config


def load_json(path: Path) -> dict:
    """A JSON object file of an adapter folder; AdapterError when unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise AdapterError(f"{path}: unreadable ({err})") from None
    if not isinstance(data, dict):
        raise AdapterError(f"{path}: not a JSON object")
    return data


def _read_peft(name: str, p: Path, config: dict) -> AdapterInfo:
    cfg = load_json(p / PEFT_CONFIG)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{p}: a {cfg.get('peft_type')} adapter; only LoRA adapters are served")
    for flag, what in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D) layers")):
        if cfg.get(flag):
            raise AdapterError(f"{p}: {what} is not supported")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"{p}: modules_to_save ({cfg['modules_to_save']}) would replace base weights; not supported")
    if cfg.get("lora_bias"):
        raise AdapterError(f"{p}: LoRA biases are not supported")
    weights = p / PEFT_WEIGHTS
    if not weights.exists():
        raise AdapterError(f"{p}: missing {PEFT_WEIGHTS} (adapter_model.bin is not read: save with safetensors)")
    index = safetensors_index(weights)
    r, alpha, rslora = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", 8)), bool(cfg.get("use_rslora"))
    ranks, alphas = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    features, layers = target_features(config), config["num_layers"]
    found: dict[tuple[int, str], dict[str, TensorRef]] = {}
    modules: dict[tuple[int, str], str] = {}
    for key, ref in index.items():
        m = _PEFT_KEY.search(key)
        if not m:
            if "lora_" in key:
                raise AdapterError(f"{p}: LoRA weight {key} is not on one of {', '.join(C.LORA_TARGETS)}")
            continue
        layer, target, which = int(m.group(1)), m.group(2), m.group(3)
        if target in FUSED_TARGETS:  # one A for all, B's rows split among the graph's targets
            if layer >= layers:
                raise AdapterError(f"{p}: layer {layer} is beyond this model's {layers} layers (another base model?)")
            outs = [features[t][1] for t in FUSED_TARGETS[target]]
            if which == "B" and (len(ref.shape) != 2 or ref.shape[0] != sum(outs)):
                raise AdapterError(f"{p}: layer {layer} {target}'s B is {list(ref.shape)}; this model's {target} has "
                                   f"{sum(outs)} outputs (an adapter for another base model?)")
            row = 0
            for part, out in zip(FUSED_TARGETS[target], outs):
                found.setdefault((layer, part), {})[which] = _rows(ref, row, out) if which == "B" else ref
                modules[layer, part] = key.split(".lora_")[0]
                row += out
            continue
        if target not in features:
            raise AdapterError(f"{p}: LoRA target {target} is not one of {', '.join(C.LORA_TARGETS)}")
        if layer >= layers:
            raise AdapterError(f"{p}: layer {layer} is beyond this model's {layers} layers (another base model?)")
        found.setdefault((layer, target), {})[which] = ref
        modules[layer, target] = key.split(".lora_")[0]
    if not found:
        raise AdapterError(f"{p}: no LoRA weights in {PEFT_WEIGHTS}")
    parts, rank = {}, 0
    for (layer, target), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{p}: layer {layer} {target} has lora_{next(iter(ab))} without its pair")
        fin, fout = features[target]
        a, b = ab["A"], ab["B"]
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != fin or b.shape[0] != fout or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{p}: layer {layer} {target} is A {list(a.shape)}, B {list(b.shape)}; this model's "
                               f"{target} is {fin} -> {fout} (an adapter for another base model?)")
        for ref in (a, b):
            if ref.dtype not in ("F32", "F16", "BF16"):
                raise AdapterError(f"{p}: tensor dtype {ref.dtype} is not supported")
        module = modules[layer, target]
        r_m = int(_pattern_value(ranks, module, r))
        alpha_m = float(_pattern_value(alphas, module, alpha))
        if a.shape[0] != r_m:
            raise AdapterError(f"{p}: layer {layer} {target} has rank {a.shape[0]}, its config says {r_m}")
        parts[layer, target] = LoraPart(a, b, alpha_m / (r_m ** 0.5 if rslora else r_m), module.rsplit(".", 1)[-1])
        rank = max(rank, r_m)
    scaling = {"r": r, "alpha": alpha, "rslora": rslora, "ranks": ranks, "alphas": alphas}
    targets = tuple(t for t in C.LORA_TARGETS if any(t == tgt for _, tgt in parts))
    return AdapterInfo(name, p, "peft", _digest(weights, scaling), rank, targets, weights, parts=parts,
                       base=cfg.get("base_model_name_or_path"))


def _read_own(name: str, p: Path, config: dict, architecture: str) -> AdapterInfo:
    manifest = load_json(p / OWN_MANIFEST)
    if manifest.get("format") != ADAPTER_FORMAT:
        raise AdapterError(f"{p}: {OWN_MANIFEST} is not a RuvLLM adapter manifest")
    base = manifest.get("base") or {}
    if base.get("architecture") != architecture:
        raise AdapterError(f"{p}: an adapter for a {base.get('architecture')} model, this package is {architecture}")
    weights = p / OWN_WEIGHTS
    meta = (manifest.get("files") or {}).get(OWN_WEIGHTS) or {}
    if not weights.exists():
        raise AdapterError(f"{p}: missing {OWN_WEIGHTS}")
    if weights.stat().st_size != meta.get("size"):
        raise AdapterError(f"{p}: corrupt adapter, {OWN_WEIGHTS} has {weights.stat().st_size} bytes, "
                           f"its manifest says {meta.get('size')}")
    if _digest(weights, None) != meta.get("sha256"):
        raise AdapterError(f"{p}: corrupt adapter, {OWN_WEIGHTS} does not match the sha256 in its manifest")
    index = safetensors_index(weights)
    features, layers, rank = target_features(config), config["num_layers"], int(manifest["rank"])
    stacked = {}
    for target in manifest["targets"]:
        if target not in features:
            raise AdapterError(f"{p}: LoRA target {target} is not one of {', '.join(C.LORA_TARGETS)}")
        a, b = index.get(own_tensor(target, "A")), index.get(own_tensor(target, "B"))
        fin, fout = features[target]
        if a is None or b is None or a.shape != (layers, fin, rank) or b.shape != (layers, rank, fout):
            raise AdapterError(f"{p}: {target}'s tensors do not fit this model ({layers} layers, {fin} -> {fout}, "
                               f"rank {rank}): an adapter for another base model?")
        stacked[target] = (a, b)
    return AdapterInfo(name, p, "ruvllm", str(meta["sha256"])[:32], rank,
                       tuple(stacked), weights, stacked=stacked, base=base.get("name"))


class AdapterRegistry:
    """The adapters an engine can serve, by the name requests use; slots load by content id."""

    def __init__(self, package, backend, config) -> None:
        self.pkg, self.backend, self.config = package, backend, config
        self.by_name: dict[str, AdapterInfo] = {}
        self._by_id: dict[str, AdapterInfo] = {}  # kept after a removal: running sequences may need a slot again

    def read(self, name: str, path, experts: dict | None = None):
        """Read and check an adapter (or X-LoRA) folder against the package and the slots, touching neither
        the backend nor the registry: AdapterError says what does not fit. A front end that only routes
        (the Ray Serve ingress) validates with it."""
        from runtime.core.xlora import is_xlora, read_xlora

        arch, rank = self.pkg.manifest["architecture"], self.config.max_lora_rank
        if not is_xlora(path):
            return read_adapter(name, path, self.pkg.config, arch, rank)
        info = read_xlora(name, path, self.pkg.config, arch, rank, experts)
        if info.settings.layerwise and not (self.pkg.manifest.get("lora") or {}).get(C.LORA_PER_MODULE):
            raise AdapterError(f"X-LoRA {name!r} has layerwise_scalings, which this package's LoRA graph cannot "
                               "weigh per layer (exported before RuvLLM read them): re-export the package")
        if len(info.experts) > self.config.max_loras:
            raise AdapterError(f"X-LoRA {name!r} has {len(info.experts)} experts, more than --max-loras "
                               f"{self.config.max_loras} adapter slots")
        return info

    def add(self, name: str, path, experts: dict | None = None):
        """Register a LoRA adapter folder (PEFT's or `python -m exporter adapter`'s), or a PEFT X-LoRA
        folder (its experts from its config, or `experts`: name -> folder), under a name; weights are
        read when a request first needs slots for them. AdapterError says what does not fit."""
        info = self.read(name, path, experts)
        if info.kind == "xlora":
            self.backend.enable_xlora(self.config.max_loras, self.config.max_lora_rank, info)
            for expert in info.experts:
                self._by_id.setdefault(expert.id, expert)
        else:
            self.backend.enable_lora(self.config.max_loras, self.config.max_lora_rank)
        self.by_name[name] = info
        self._by_id.setdefault(info.id, info)
        return info

    def remove(self, name: str) -> bool:
        """New requests can no longer name it; those running on it finish."""
        return self.by_name.pop(name, None) is not None

    def named(self, name: str | None):
        """The adapter (an AdapterInfo, or an XLoraInfo) requests call `name`."""
        if name is None:
            return None
        info = self.by_name.get(name)
        if info is None:
            raise UnknownAdapterError(f"no adapter named {name!r} is loaded", "adapter")
        return info

    def load_slots(self, loads: list[tuple[int, str]]) -> None:
        """Put the adapters the scheduler just gave slots into the backend's LoRA inputs."""
        for slot, adapter_id in loads:
            self.backend.set_adapter(slot, self._by_id[adapter_id])

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def __iter__(self):
        return iter(self.by_name.values())


class AdapterSlots:
    """Which adapter each of the graph's adapter slots holds (slot 0 is "no adapter", always zero), with
    reference counts of the running sequences that use it; an unused slot is reused least recently
    used first. The scheduler admits a sequence only when its adapter has a slot."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.holder: list[str | None] = [None] * (max_loras + 1)  # slot -> adapter id
        self.users = [0] * (max_loras + 1)
        self._idle: OrderedDict[int, None] = OrderedDict((s, None) for s in range(1, max_loras + 1))
        self.loads: list[tuple[int, str]] = []  # (slot, adapter id) assigned since the backend last took them

    def acquire(self, adapter_id: str | None) -> int | None:
        """A slot holding the adapter (0 for none), taken by one more sequence; None when every slot is busy."""
        if adapter_id is None:
            return 0
        if adapter_id in self.holder:
            slot = self.holder.index(adapter_id)
        elif self._idle:
            slot = next(iter(self._idle))
            self.holder[slot] = adapter_id
            self.loads.append((slot, adapter_id))
        else:
            return None
        self.users[slot] += 1
        self._idle.pop(slot, None)
        return slot

    def release(self, slot: int) -> None:
        if slot <= 0:
            return
        self.users[slot] -= 1
        if self.users[slot] == 0:
            self._idle[slot] = None  # still holds its adapter: reused by the next request for it

    def take_loads(self) -> list[tuple[int, str]]:
        loads, self.loads = self.loads, []
        return loads
