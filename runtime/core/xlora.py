"""X-LoRA (PEFT's `XLoraConfig`): a classifier over N LoRA experts that mixes them per token.

Each step runs twice for an X-LoRA sequence, as PEFT's X-LoRA model does: a scaling pass (the experts
weighted by `scaling_pass_value`, 0 by default: the base model) whose last hidden states feed the
classifier, then the real pass with the classifier's per-token weights on the experts' adapter slots.
PEFT recomputes the whole sequence each step (it refuses a KV cache); both passes are causal, so the
engine keeps a KV cache per pass instead (the scheduler's shadow blocks) and gets the same numbers.

With `layerwise_scalings` the classifier weighs the experts apart for each of PEFT's LoRA layers (every
adapted Linear, in the model's module order); the graph then reads a set of weights per layer and target
(runtime.contract.lora_module), and each PEFT layer's weights go to the targets it holds.

Everything here reads JSON and safetensors headers only (it runs in Pyodide); the backend runs the
classifier (its numbers) and `expert_weights` turns its outputs into the experts' weights.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from runtime import contract as C
from runtime.core.adapters import (
    OWN_MANIFEST,
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    AdapterError,
    AdapterInfo,
    TensorRef,
    load_json,
    read_adapter,
    safetensors_index,
)

CLASSIFIER_FILE = "xlora_classifier.safetensors"  # keys layers.{i}.weight / .bias: the classifier's state_dict
_KEY = re.compile(r"internal_xlora_classifier\.layers(?:\.(\d+))?\.(weight|bias)$")


def is_xlora(path: str | Path) -> bool:
    """Whether a folder holds a PEFT X-LoRA model (its adapter_config.json says peft_type XLORA)."""
    try:
        cfg = json.loads((Path(path).expanduser() / PEFT_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and cfg.get("peft_type") == "XLORA"


@dataclass(frozen=True)
class XLoraSettings:
    """PEFT's settings that shape the experts' weights from the classifier's outputs."""

    enable_softmax: bool = True
    softmax_temperature: float = 1.0
    top_k_lora: int | None = None
    enable_softmax_topk: bool = False
    scaling_pass_value: float = 0.0
    global_scaling_weight: float = 1.0
    layerwise: bool = False  # layerwise_scalings: a set of weights per PEFT LoRA layer


@dataclass
class XLoraInfo:
    name: str
    path: Path
    id: str  # digest of the classifier, the settings and the experts' ids
    experts: list[AdapterInfo]
    settings: XLoraSettings
    classifier: list[tuple[Path, TensorRef, TensorRef]]  # the Linear layers in order: (file, weight, bias)
    kind: str = "xlora"
    # layerwise: PEFT's LoRA layers in its order, each as the graph's weight sets (contract.lora_module) it
    # covers (a fused qkv_proj covers three); None: one set for all
    modules: list[list[int]] | None = None
    num_sets: int = 1  # the graph's weight sets a step feeds for it (contract.lora_modules when layerwise)

    @property
    def rank(self) -> int:
        return max(e.rank for e in self.experts)


def expert_weights(logits: list[float], s: XLoraSettings) -> list[float]:
    """One token's classifier outputs -> each expert's weight, as PEFT's XLoraClassifier (softmax at a
    temperature) and XLoraLayer (top-k mask, softmax over the kept ones) compute it, times the global
    scaling weight."""
    w = list(logits)
    if s.enable_softmax:
        w = _softmax([x / s.softmax_temperature for x in w])
    if s.top_k_lora is not None:
        keep = set(sorted(range(len(w)), key=lambda i: -w[i])[:s.top_k_lora])
        w = [x if i in keep else 0.0 for i, x in enumerate(w)]
    if s.enable_softmax_topk:
        kept = [i for i, x in enumerate(w) if x != 0.0]
        soft = _softmax([w[i] for i in kept]) if kept else []
        w = [0.0] * len(w)
        for i, x in zip(kept, soft):
            w[i] = x
    return [x * s.global_scaling_weight for x in w]


def module_weights(logits: list[float], n: int, xlora: XLoraInfo) -> list:
    """One token's classifier outputs -> [(expert index, weight)] pairs' weights: a float per expert, or
    layerwise a list per expert over the graph's weight sets (PEFT's LoRA layers each weighed apart)."""
    if xlora.modules is None:
        return expert_weights(logits, xlora.settings)
    per_expert = [[0.0] * xlora.num_sets for _ in range(n)]
    for k, sets in enumerate(xlora.modules):  # PEFT reshapes the outputs to [layers, experts]
        for e, w in enumerate(expert_weights(logits[k * n:(k + 1) * n], xlora.settings)):
            for m in sets:
                per_expert[e][m] = w
    return per_expert


def mix_sets(mix: dict | None) -> int:
    """The weight sets a step's lora_weights rows need for these tokens' (slot, weight) pairs: the length
    of a layerwise X-LoRA's per-set weights, else 1 (every target weighs a token alike)."""
    return max((len(w) for pairs in (mix or {}).values() for _, w in pairs if isinstance(w, list)), default=1)


def scaling_pass_weights(n: int, s: XLoraSettings) -> list[float]:
    """The experts' weights in the scaling pass: PEFT's dummy scalings, all scaling_pass_value."""
    return [s.scaling_pass_value * s.global_scaling_weight] * n


def scaling_mix(xp) -> dict[int, list[tuple[int, float]]]:
    """The scaling pass's weights (a step_batch.XLoraPass): each of its tokens' (expert slot, dummy weight)."""
    mix = {}
    for g in xp.groups:
        pairs = list(zip(g.expert_slots, scaling_pass_weights(len(g.expert_slots), g.xlora.settings)))
        mix.update((t, pairs) for t in range(g.scaling_start, g.scaling_start + g.n))
    return mix


def step_mix(xp, outputs: list[list[list[float]]]) -> tuple[dict[int, list[tuple[int, float]]], list]:
    """The step's weights from each X-LoRA chunk's classifier outputs ([tokens][experts] per group, in
    order): ({token's index in the step: [(expert slot, weight)]}, the weights per group)."""
    mix, weights = {}, []
    for g, rows in zip(xp.groups, outputs):
        group = [module_weights(row, len(g.expert_slots), g.xlora) for row in rows]
        weights.append(group)
        mix.update((g.step_start + j, list(zip(g.expert_slots, w))) for j, w in enumerate(group))
    return mix, weights


def _softmax(xs: list[float]) -> list[float]:
    if not xs:
        return []
    top = max(xs)
    e = [math.exp(x - top) for x in xs]
    total = sum(e)
    return [x / total for x in e]


def read_xlora(name: str, path: str | Path, config: dict, architecture: str, max_rank: int,
               experts: dict[str, str | Path] | None = None) -> XLoraInfo:
    """Read a PEFT X-LoRA folder: its config, its classifier's weights and its expert adapters (the
    `adapters` its config names, or `experts` given here, by the same names; relative paths are taken
    from the folder). AdapterError says what is missing or does not fit the package."""
    p = Path(path).expanduser()
    cfg = load_json(p / PEFT_CONFIG)
    if cfg.get("peft_type") != "XLORA":
        raise AdapterError(f"{p}: not an X-LoRA model (peft_type {cfg.get('peft_type')!r})")
    if cfg.get("hidden_size") != config["hidden_size"]:
        raise AdapterError(f"{p}: an X-LoRA classifier for hidden size {cfg.get('hidden_size')}, this model's is "
                           f"{config['hidden_size']} (another base model?)")
    top_k = cfg.get("top_k_lora")
    settings = XLoraSettings(bool(cfg.get("enable_softmax", True)), float(cfg.get("softmax_temperature", 1.0)),
                             int(top_k) if top_k is not None else None, bool(cfg.get("enable_softmax_topk", False)),
                             float(cfg.get("scaling_pass_value", 0.0)), float(cfg.get("global_scaling_weight", 1.0)),
                             bool(cfg.get("layerwise_scalings", False)))
    if settings.top_k_lora is not None and settings.scaling_pass_value != 0:
        raise AdapterError(f"{p}: top_k_lora with a non-zero scaling_pass_value picks among equal dummy scalings "
                           "in an order PEFT leaves to torch.topk; not supported")
    named = dict(cfg.get("adapters") or {})
    named.update(experts or {})
    if not named:
        raise AdapterError(f"{p}: the X-LoRA config names no expert adapters")
    loaded = []
    for expert, where in named.items():
        folder = Path(where).expanduser()
        folder = folder if folder.is_absolute() else p / folder
        if not (folder / PEFT_CONFIG).exists() and not (folder / OWN_MANIFEST).exists():
            raise AdapterError(f"{p}: X-LoRA expert {expert!r} is not at {folder}; give its LoRA folder "
                               f"(experts={{{expert!r}: PATH}})")
        loaded.append(read_adapter(f"{name}/{expert}", folder, config, architecture, max_rank))
    modules = peft_lora_layers(loaded, config["num_layers"]) if settings.layerwise else None
    layers = _classifier(p, cfg, len(loaded), config["hidden_size"], len(modules) if modules else 1)
    h = hashlib.sha256(json.dumps(settings.__dict__, sort_keys=True).encode())
    for e in loaded:
        h.update(e.id.encode())
    for file, w, b in layers:
        with open(file, "rb") as fh:
            for ref in (w, b):
                fh.seek(ref.start)
                h.update(fh.read(ref.end - ref.start))
    return XLoraInfo(name, p, h.hexdigest()[:32], loaded, settings, layers, modules=modules,
                     num_sets=C.lora_modules(config["num_layers"]) if modules else 1)


# The order in which the families' decoder layers register their Linears (PEFT numbers its LoRA layers in
# module order): Llama's q, k, v, o, gate, up, down; Phi-3's o, qkv, gate_up, down. A model has either the
# separate or the fused ones.
_MODULE_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj",
                 "down_proj")


def peft_lora_layers(experts: list[AdapterInfo], num_layers: int) -> list[list[int]]:
    """PEFT's LoRA layers of an X-LoRA over these experts (a Linear is one when any expert adapts it), in
    module order, each as the graph's weight sets it covers. The exporter's adapter format keeps no
    module names: its targets count as adapted in every layer."""
    covers: dict[tuple[int, str], set[int]] = {}
    for e in experts:
        if e.kind == "peft":
            for (layer, target), part in e.parts.items():
                covers.setdefault((layer, part.module or target), set()).add(C.lora_module(layer, target))
        else:
            for target in e.stacked:
                for layer in range(num_layers):
                    covers.setdefault((layer, target), set()).add(C.lora_module(layer, target))
    order = sorted(covers, key=lambda k: (k[0], _MODULE_ORDER.index(k[1]) if k[1] in _MODULE_ORDER else 99))
    return [sorted(covers[k]) for k in order]


def _classifier(p: Path, cfg: dict, n_experts: int, hidden: int,
                n_layers: int = 1) -> list[tuple[Path, TensorRef, TensorRef]]:
    """The classifier's Linear layers. PEFT's save_pretrained (0.21) keeps some of them only in the
    experts' subfolders, with the subfolder's name (an index) cut out of the key: `layers.0.weight` is
    `layers.weight` in subfolder 0. Read them from wherever they are, checked by shape."""
    depth = int(cfg.get("xlora_depth", 1))
    size = int(cfg.get("xlora_size", 2048))
    stride = 3 if float(cfg.get("xlora_dropout_p", 0.2)) > 0 else 2  # Linear, ReLU (, Dropout)
    want = [i * stride for i in range(depth)]
    dims = [hidden] + [size] * (depth - 1) + [n_experts * n_layers]  # layerwise: n_layers LoRA layers' weights
    found: dict[int, dict[str, tuple[Path, TensorRef]]] = {}
    own = p / CLASSIFIER_FILE
    files = [(own, None)] if own.exists() else []
    files.append((p / PEFT_WEIGHTS, None))
    files += [(d / PEFT_WEIGHTS, int(d.name)) for d in sorted(p.iterdir()) if d.is_dir() and d.name.isdigit()]
    for file, sub in files:
        if not file.exists():
            continue
        for key, ref in safetensors_index(file).items():
            m = _KEY.search(key) or (re.fullmatch(r"layers\.(\d+)\.(weight|bias)", key) if file == own else None)
            if not m:
                continue
            index = int(m.group(1)) if m.group(1) is not None else sub
            if index is not None:
                found.setdefault(index, {}).setdefault(m.group(2), (file, ref))
    layers = []
    for n, index in enumerate(want):
        parts = found.get(index, {})
        if set(parts) != {"weight", "bias"}:
            raise AdapterError(f"{p}: the X-LoRA classifier's layer {index} is missing (PEFT's save_pretrained "
                               "drops some of its weights in some versions): save "
                               "model.base_model.internal_xlora_classifier.state_dict() with safetensors as "
                               f"{CLASSIFIER_FILE} in the folder")
        (wf, w), (bf, b) = parts["weight"], parts["bias"]
        if w.shape != (dims[n + 1], dims[n]) or b.shape != (dims[n + 1],) or wf != bf:
            layerwise = f", layerwise over {n_layers} LoRA layers" if n_layers > 1 else ""
            raise AdapterError(f"{p}: the X-LoRA classifier's layer {index} is {list(w.shape)}, expected "
                               f"{[dims[n + 1], dims[n]]} ({n_experts} experts{layerwise}, xlora_size {size})")
        if w.dtype not in ("F32", "F16", "BF16"):
            raise AdapterError(f"{p}: classifier dtype {w.dtype} is not supported")
        layers.append((wf, w, b))
    return layers
