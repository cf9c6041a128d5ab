"""Random PEFT LoRA adapters on the embedded SmolLM2 (for `ruvllm bench --adapters`): speed only.

    python benchmarks/make_adapters.py OUT_DIR [--count 4] [--rank 16]

Each adapter targets all seven projections at the given rank with non-zero B (PEFT's
init_lora_weights=False), saved with save_pretrained as a user's would be.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from runtime.aliases import embedded_gguf_path
    from runtime.contract import LORA_TARGETS

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--count", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    gguf = embedded_gguf_path()
    for i in range(args.count):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        peft = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=list(LORA_TARGETS),
                                                init_lora_weights=False))
        peft.save_pretrained(Path(args.out) / f"adapter-{i}")
        print(Path(args.out) / f"adapter-{i}")


if __name__ == "__main__":
    main()
