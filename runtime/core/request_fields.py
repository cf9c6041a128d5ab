"""A request's scalar sampling fields, each declared once: name, kind, default, range and help. SamplingParams'
defaults and RANGES (runtime/core/sampling.py), the OpenAI request parser and its published schema
(runtime/serve/openai_protocol.py) and the CLI's flags (runtime/serve/cli/parser.py) are made from this table;
a new field is a row here (and the step that applies it). Standard library (the page's engine reads it too).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingField:
    name: str  # OpenAI's spelling, and vLLM's and llama.cpp's server's where they extend it
    kind: str  # "number" or "integer" (JSON's)
    default: float | int | None  # what a request that leaves it out gets (before the model's own settings)
    range: tuple[float | None, float | None, bool] | None = None  # (lowest, highest or None, lowest excluded)
    help: str = ""  # the CLI's help and the schema's description
    origin: str = "OpenAI"  # whose field it is

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def python_type(self) -> type:
        return float if self.kind == "number" else int


SAMPLING_FIELDS: tuple[SamplingField, ...] = (
    SamplingField("temperature", "number", 1.0, (0.0, 2.0, False),
                  "0: greedy (default: the model's own setting, else 0.8 with top-k 40, top-p 0.95, min-p 0.05)"),
    SamplingField("top_k", "integer", 0, (-1, None, False), "keep the K likeliest tokens (0 or -1: off)", "vLLM"),
    SamplingField("top_p", "number", 1.0, (0.0, 1.0, True), "keep the likeliest tokens whose probabilities sum to P"),
    SamplingField("min_p", "number", 0.0, (0.0, 1.0, False),
                  "drop tokens less likely than P times the likeliest's probability", "vLLM"),
    # the graph divides float32 logits by it: 1e-300 would be 0
    SamplingField("repetition_penalty", "number", 1.0, (0.01, 10.0, False),
                  "divide the logits of tokens already seen by this (1: off)", "vLLM"),
    SamplingField("presence_penalty", "number", 0.0, (-2.0, 2.0, False), "subtract this from tokens already seen"),
    SamplingField("frequency_penalty", "number", 0.0, (-2.0, 2.0, False),
                  "subtract this times a token's count so far"),
    SamplingField("seed", "integer", None, None, "the sampler's seed: the same seed, the same tokens"),
    SamplingField("dry_multiplier", "number", 0.0, (0.0, 100.0, False),
                  "DRY, llama.cpp's repetition sampler: its strength (0: off, the default; 0.8 is usual)",
                  "llama.cpp's server"),
    SamplingField("dry_base", "number", 1.75, (1.0, 10.0, True), "DRY: penalty growth per repeated token (1.75)",
                  "llama.cpp's server"),
    SamplingField("dry_allowed_length", "integer", 2, (1, 1000, False), "DRY: repeats this long go free (2)",
                  "llama.cpp's server"),
    SamplingField("dry_penalty_last_n", "integer", -1, (-1, None, False), "DRY: tokens looked back (-1: all; 0: off)",
                  "llama.cpp's server"),
)
BY_NAME = {f.name: f for f in SAMPLING_FIELDS}
