"""RuvLLM exporter: Hugging Face checkpoints (hub id, folder, GGUF) -> RuvLLM model packages."""

__version__ = "0.1.0"
