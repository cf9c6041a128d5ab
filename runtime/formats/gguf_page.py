"""A model package for the page's WASM step made from a GGUF's header alone (standard library, run in the
page's Pyodide): the manifest, tokenizer.json, the chat template, generation_config.json and step.json,
and the plan by which the page fills step.bin from the file's byte ranges (runtime/formats/step_plan.py).
No graphs: such a package runs on the WASM step only. What the exporter writes for the same file
(`python -m exporter convert FILE --target wasm`) is the reference: tests/web/test_wasm_step_types.py holds
the two alike, field by field.
"""

from __future__ import annotations

import hashlib
import json
import math

from runtime import contract as C
from runtime.core.request_fields import SAMPLING_FIELDS
from runtime.errors import PackageError
from runtime.formats.families import STEP_FAMILIES
from runtime.formats.gguf_file import GGUFHeader
from runtime.formats.step_abi import FORMAT
from runtime.formats.step_plan import StepPlan, step_plan
from runtime.text.gguf_vocab import tokenizer_json, tokenizer_meta
from runtime.text.tokenizer import remember_made

DEFAULT_MAX_CONTEXT = 32768  # the exporter's cap on a model's context (RoPE tables grow with it)
KV_BLOCK_SIZE = 16
# llama.cpp's converter writes the model's generation config here (runtime/core/request_fields.py's keys)
GGUF_SAMPLING = {f.gguf: f.name for f in SAMPLING_FIELDS if f.gguf}


def generation_fields(header: GGUFHeader) -> dict:
    """The generation_config.json fields a GGUF's own sampling settings set ({} for none)."""
    out = {}
    for key, name in GGUF_SAMPLING.items():
        value = header.field(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = int(value) if name == "top_k" else float(value)
    return out


def _entry(data: bytes) -> dict:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def page_package(header: GGUFHeader, name: str, source: str, max_context: int | None = None) -> tuple[dict[str, bytes], StepPlan]:
    """(the package's small files by name, the step's plan). manifest.json lists step.bin with its size only:
    the page adds its pieces' digests as it writes it (web/src/gguf_source.js). PackageError, by name, for a
    file the step cannot run, before any weight is read."""
    files, plan = step_files(header, name, source, max_context)
    return with_tokenizer(files, header), plan


def with_tokenizer(files: dict[str, bytes], header: GGUFHeader) -> dict[str, bytes]:
    """step_files' files with tokenizer.json, listed in their manifest. The slow part of a header (Gemma 3's
    262,144 tokens: seconds in Pyodide), so the page makes it while step.bin streams in (web/src/worker.js)."""
    tok_json = tokenizer_json(header)
    tok_text = json.dumps(tok_json)
    remember_made(tok_text, tok_json)  # the engine that opens this package reads the spec, not its JSON
    out = {**files, "tokenizer.json": tok_text.encode()}
    manifest = json.loads(files["manifest.json"])
    manifest["files"] = {**{n: _entry(b) for n, b in sorted(out.items()) if n != "manifest.json"},
                         "step.bin": manifest["files"]["step.bin"]}
    out["manifest.json"] = json.dumps(manifest).encode()
    return out


def step_files(header: GGUFHeader, name: str, source: str, max_context: int | None = None) -> tuple[dict[str, bytes], StepPlan]:
    """page_package's files but tokenizer.json (which its manifest does not list yet): all the step needs."""
    arch = header.architecture
    family = STEP_FAMILIES.get(arch)
    if family is None:
        raise PackageError(f"{source}: architecture {arch!r}; the page opens {', '.join(STEP_FAMILIES)} GGUFs "
                           "(`python -m exporter convert` exports the others)")
    context = int(header.arch_field("context_length", 2048))
    max_pos = min(context, max_context or DEFAULT_MAX_CONTEXT)
    plan = step_plan(header, max_pos, source)
    cfg = plan.config
    tok_meta = tokenizer_meta(header)
    template = header.field("tokenizer.chat_template")
    gen = {"bos_token_id": tok_meta["bos_token_id"], "eos_token_id": tok_meta["eos_token_id"],
           "pad_token_id": tok_meta["pad_token_id"], **generation_fields(header)}
    window = max(cfg["windows"]) or None
    files: dict[str, bytes] = {"generation_config.json": json.dumps(gen, indent=2).encode(),
                               "step.json": json.dumps(plan.index()).encode()}
    if isinstance(template, str) and template:
        files["chat_template.jinja"] = template.encode()
    layers = cfg["layers"]
    manifest = {
        "format": C.FORMAT_NAME, "format_version": C.FORMAT_VERSION, "name": name,
        "architecture": family.model_type,
        "config": {
            "num_layers": layers, "hidden_size": cfg["dim"], "num_heads": cfg["heads"], "num_kv_heads": cfg["kv_heads"],
            "head_dim": cfg["head_dim"], "intermediate_size": cfg["hidden"], "vocab_size": cfg["vocab"],
            "max_positions": max_pos, "rms_norm_eps": cfg["eps"], "sliding_window": None,  # per layer below
            "tie_word_embeddings": "head" not in plan.matrices,
            "num_parameters": sum(math.prod(t.shape) for t in header.tensors.values() if t.name != "rope_freqs.weight"),
            **({"layer_windows": [w or None for w in cfg["windows"]]} if window else {}),
            "compute": {"activation": family.activation, "embed_scale": cfg["embed_scale"],
                        "attn_scale": cfg["attn_scale"] if family.qk_norm else None, "qk_norm": family.qk_norm,
                        "sandwich_norms": family.sandwich_norms,
                        "layer_rope_local": [r == "rope_local" for r in cfg["layer_rope"]] if family.local_rope_base else None},
        },
        "graphs": {},
        "io": C.declared_io(layers, cfg["kv_heads"], cfg["head_dim"], cfg["vocab"]),
        "kv_cache": {"layout": "paged", "block_size": KV_BLOCK_SIZE, "dtype": "float32", "write": "step",
                     "num_layers": layers, "num_kv_heads": cfg["kv_heads"], "head_dim": cfg["head_dim"]},
        "quantization": {"weights": "the file's blocks", "method": "gguf", "types": sorted(set(plan.matrices.values())),
                         "compute": "the WASM step, at the file's own bits"},
        "lora": {"targets": list(C.LORA_TARGETS), "graph": None},  # the step's own adapters (no X-LoRA)
        "target": "wasm-step",
        "tokenizer": {k: v for k, v in tok_meta.items() if k != "chat_template"},
        "chat_template": "chat_template.jinja" if "chat_template.jinja" in files else None,
        "special_tokens": {"eos_token_ids": [tok_meta["eos_token_id"]] if tok_meta["eos_token_id"] is not None else [],
                           "bos_token_id": tok_meta["bos_token_id"]},
        "generation_config": "generation_config.json",
        "provenance": {"source": source, "source_kind": "gguf", "source_architecture": arch,
                       "made_by": "the page, from the GGUF's header (runtime/formats/gguf_page.py)"},
        "wasm_step": {"weights": "step.bin", "index": "step.json", "max_positions": max_pos, "format": FORMAT},
        "files": {**{n: _entry(b) for n, b in sorted(files.items())}, "step.bin": {"size": plan.size}},
    }
    files["manifest.json"] = json.dumps(manifest).encode()
    return files, plan

