"""A user's MicroLoRA (issue 51): a small LoRA learned from that user's text by the instant loop, kept as
a PEFT folder that the engine serves like any adapter (runtime/core/adapters.py).

The gradients come from lora_gradients.py (numpy, no torch); the steps are Adam's on the factors only.
A starts as PEFT's (Kaiming-uniform, a = sqrt 5) and B at zero, so a new user's adapter changes nothing
until it has learned something.

EWC++ (`ewc` > 0) keeps the factors near that start, the model as it was, in the directions that matter to
what it did well: each step adds ewc * F * (factors - start), F an online diagonal Fisher of the factors
(squared gradients of the loss on a reference text, in units of their mean, decayed by `fisher_decay` at
each refresh). The
background loop (`consolidate`) refreshes F at the current factors; the reference text is the caller's
choice (benchmarks/sona.py: the model's own sampled text, so nothing outside the model is needed).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from runtime.backends.lora_gradients import DenseDecoder, Lora, loss_and_grads
from runtime.core.adapters import peft_lora_config
from runtime.core.feedback_plan import text_chunks

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
PEFT_MODULE = {t: ("self_attn" if t in ATTENTION else "mlp") for t in
               ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}


def ewc_pull(g: np.ndarray, w: np.ndarray, fisher: np.ndarray, start: np.ndarray, ewc: float) -> np.ndarray:
    """The gradient with EWC++'s pull toward the start added: g + ewc x F x (w - start)."""
    return g + ewc * fisher * (w - start)


def weight_rms(w: np.ndarray) -> float:
    """A projection's root mean square, summed in float64 (the page's step sums the same way)."""
    return float(np.sqrt(np.mean(np.square(w, dtype=np.float64))))


def adam_update(w: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, t: int, lr: float) -> None:
    """Adam's step t on w in place (moments m, v in place), in float32 throughout, as the page's step
    computes it (wasm/step/learn.h: learn_adam)."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    m *= b1
    m += (1 - b1) * g
    v *= b2
    v += (1 - b2) * g * g
    w -= (lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)).astype(np.float32)


def read_peft(folder: str | Path, config: dict) -> Lora:
    """A PEFT LoRA folder (a user's, natively or from the page, or any of these targets) as the trainer's
    Lora, read and checked against the package's `config` by the engine's own reader (core/adapters.py:
    rank and alpha patterns, rsLoRA, fused targets): each part's scale is carried in its B."""
    from runtime.backends.adapter_weights import read_tensor
    from runtime.core.adapters import read_adapter

    info = read_adapter("peft", folder, config, "", max_rank=1 << 16)
    with open(info.weights, "rb") as fh:
        factors = {key: (read_tensor(info.weights, part.a, fh), read_tensor(info.weights, part.b, fh) * np.float32(part.scale))
                   for key, part in info.parts.items()}
    return Lora(factors, 1.0)


class MicroLora:
    def __init__(self, decoder: DenseDecoder, targets: tuple[str, ...] = ("q_proj", "v_proj"), rank: int = 4,
                 alpha: float = 8.0, lr: float = 0.02, seed: int = 0, ewc: float = 0.0, fisher_decay: float = 0.5,
                 layers: Iterable[int] | None = None) -> None:
        """`layers`: the layers adapted (PEFT's layers_to_transform; None: every one); `lr`: Adam's step as a
        share of each adapted projection's weight RMS (rates)."""
        self.dec, self.targets, self.rank, self.alpha, self.lr = decoder, tuple(targets), rank, alpha, lr
        self.ewc, self.fisher_decay = ewc, fisher_decay
        count = len(decoder.layers)
        self.layers = sorted(set(range(count) if layers is None else layers))
        if not self.layers or not all(0 <= i < count for i in self.layers):
            raise ValueError(f"adapted layers must be among the model's 0-{count - 1}, not {self.layers}")
        rng = np.random.default_rng(seed)
        factors = {}
        for i in self.layers:
            for t in self.targets:
                fin, fout = decoder.features[t]
                bound = 1.0 / np.sqrt(fin)  # kaiming_uniform_(a=sqrt(5)) on [rank, fin]
                factors[(i, t)] = (rng.uniform(-bound, bound, (rank, fin)).astype(np.float32),
                                   np.zeros((fout, rank), np.float32))
        self.lora = Lora(factors, alpha / rank)
        self.start = {k: (a.copy(), b.copy()) for k, (a, b) in factors.items()}
        self.fisher = self.lora.zeros_like()
        self._m = self.lora.zeros_like()
        self._v = self.lora.zeros_like()
        self._t = 0
        self._rates: dict | None = None

    @property
    def steps(self) -> int:
        """Adam steps taken (kept with the state)."""
        return self._t

    @property
    def rates(self) -> dict[tuple[int, str], float]:
        """Each factor pair's step: lr times its projection's weight RMS (weight_rms), so that a step moves
        an adapter by the same share of what it adapts whatever the model's scale (Gemma 3 270M's
        projections are 5-10 times smaller than SmolLM2's; one absolute step made it forget 12 %)."""
        if self._rates is None:
            self._rates = {k: self.lr * weight_rms(self.dec.projection(*k)) for k in self.lora.factors}
        return self._rates

    def step(self, ids: list[int], scored_from: int = 0, unlikely: bool = False, lr_scale: float = 1.0) -> float:
        """One Adam step on the text's mean next-token loss (from `scored_from` on; the unlikelihood loss
        for `unlikely`), at rates x lr_scale; the loss before the step."""
        rates = self.rates
        loss, grads = loss_and_grads(self.dec, ids, self.lora, scored_from=scored_from, unlikely=unlikely)
        if self.ewc:
            grads = {k: tuple(ewc_pull(g, w, f, w0, self.ewc) for g, f, w, w0 in
                              zip(pair, self.fisher[k], self.lora.factors[k], self.start[k])) for k, pair in grads.items()}
        self._t += 1
        for key, pair in grads.items():
            for j, g in enumerate(pair):
                adam_update(self.lora.factors[key][j], g, self._m[key][j], self._v[key][j], self._t,
                            lr_scale * rates[key])
        return loss

    def consolidate(self, reference: list[int], chunk: int = 256) -> None:
        """The background loop's part: the Fisher refreshed at the current factors on a reference text,
        decayed into the running one (EWC++'s online estimate)."""
        fresh = self.lora.zeros_like()
        parts = list(text_chunks(reference, chunk))
        for part in parts:
            _, grads = loss_and_grads(self.dec, part, self.lora)
            for k, pair in grads.items():
                for f, g in zip(fresh[k], pair):
                    f += g * g / len(parts)
        # in units of its mean, so that `ewc` weighs the penalty against the loss whatever the text's gradient scale
        mean = float(np.mean(np.concatenate([f.ravel() for pair in fresh.values() for f in pair])))
        if mean > 0:
            for pair in fresh.values():
                for f in pair:
                    f /= mean
        d = self.fisher_decay
        for k, pair in self.fisher.items():
            for f, new in zip(pair, fresh[k]):
                f *= d
                f += (1 - d) * new

    def learn(self, ids: list[int], chunk: int = 256, epochs: int = 1, reference: list[int] | None = None,
              consolidate_every: int = 4) -> dict:
        """Steps over the text in chunks of `chunk` tokens; what it cost and the mean loss per epoch."""
        started, losses, steps = time.perf_counter(), [], 0
        if self.ewc and reference and not self._t:
            self.consolidate(reference, chunk)
        for _ in range(epochs):
            seen = []
            for part in text_chunks(ids, chunk):
                seen.append(self.step(part))
                steps += 1
                if self.ewc and reference and steps % consolidate_every == 0:
                    self.consolidate(reference, chunk)
            losses.append(float(np.mean(seen)))
        return {"seconds": time.perf_counter() - started, "tokens": len(ids) * epochs, "epoch_losses": losses}

    def save_peft(self, folder: str | Path, base: str = "") -> Path:
        """The adapter as PEFT writes one (adapter_config.json, adapter_model.safetensors)."""
        from safetensors.numpy import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for (i, t), (a, b) in self.lora.factors.items():
            prefix = f"base_model.model.model.layers.{i}.{PEFT_MODULE[t]}.{t}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b)
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        every = len(self.layers) == len(self.dec.layers)
        config = peft_lora_config(self.rank, self.alpha, self.targets, base, None if every else self.layers)
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
        return folder

    # ---- the trainer's state beside the PEFT folder, so that a user's loop resumes where it stopped ----

    def state_tensors(self) -> dict[str, np.ndarray]:
        out = {}
        for (i, t), pair in self.lora.factors.items():
            for role, j in (("A", 0), ("B", 1)):
                key = f"{i}.{t}.{role}"
                out[f"factor.{key}"] = pair[j]
                out[f"start.{key}"] = self.start[(i, t)][j]
                out[f"fisher.{key}"] = self.fisher[(i, t)][j]
                out[f"adam_m.{key}"] = self._m[(i, t)][j]
                out[f"adam_v.{key}"] = self._v[(i, t)][j]
        return {k: np.ascontiguousarray(v) for k, v in out.items()}

    def save_state(self, path: str | Path) -> None:
        from safetensors.numpy import save_file

        save_file(self.state_tensors(), str(path), metadata={"adam_t": str(self._t)})

    def load_state(self, path: str | Path) -> None:
        """Resume from save_state's file (the same decoder, targets and rank)."""
        from safetensors import safe_open

        with safe_open(str(path), "np") as fh:
            stored = {k.removeprefix("factor.").rsplit(".", 1)[0] for k in fh.keys() if k.startswith("factor.")}
            mine = {f"{i}.{t}" for i, t in self.lora.factors}
            if stored != mine:  # the settings changed (targets, layers) since this state was written
                raise ValueError(f"{path}: factors of {len(stored)} (layer, target) pairs, this trainer's "
                                 f"{len(mine)}; written with other personalization settings")
            self._t = int(fh.metadata().get("adam_t", "0"))
            for (i, t) in self.lora.factors:
                for role, j in (("A", 0), ("B", 1)):
                    key = f"{i}.{t}.{role}"
                    for store, prefix in ((None, "factor"), (self.start, "start"), (self.fisher, "fisher"),
                                          (self._m, "adam_m"), (self._v, "adam_v")):
                        target = self.lora.factors[(i, t)][j] if store is None else store[(i, t)][j]
                        value = fh.get_tensor(f"{prefix}.{key}")
                        if value.shape != target.shape:
                            raise ValueError(f"{path}: {prefix}.{key} is {value.shape}, this trainer's {target.shape}")
                        target[...] = value
