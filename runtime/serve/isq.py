"""In-situ quantization (`--isq int4[:method]`): a model source quantized as it loads, no package kept.

mistral.rs' ISQ quantizes a checkpoint's weights in memory at load time. Here the exporter does the
quantizing (the runtime never imports it: a subprocess, as alias exports are), into a folder in RAM
(/dev/shm where the system has one) that lives as long as this process and is removed when it ends:
the same weights, byte for byte, as `python -m exporter convert SRC --quant Q --method M` writes, with
nothing left on disk. The native backend maps the weights from there and may open the LoRA graph later.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from runtime.errors import RuvLLMError

QUANTS = ("int4", "int8", "w8a8")
_made: list[Path] = []


def parse_isq(spec: str) -> tuple[str, str | None]:
    """'int4' | 'int4:awq' | 'w8a8:smoothquant' -> (quant, method or None: the exporter's default)."""
    quant, _, method = spec.partition(":")
    if quant not in QUANTS or (":" in spec and not method):
        raise RuvLLMError(f"--isq {spec!r}: expected one of {', '.join(QUANTS)}, optionally with :METHOD "
                          "(e.g. int4:awq, int4:hqq, int8:rtn)")
    return quant, method or None


def isq_root() -> Path:
    """Where in-memory packages go: RUVLLM_ISQ_DIR, else /dev/shm (RAM) where writable, else the temp folder."""
    given = os.environ.get("RUVLLM_ISQ_DIR")
    if given:
        return Path(given)
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def quantize_source(source: str, spec: str, export, quiet: bool = False) -> Path:
    """Quantize a model source (HF folder, hub id, .gguf, alias) with the exporter (export: cli's
    export_into_cache) into a folder removed when this process ends; returns that package folder."""
    quant, method = parse_isq(spec)
    p = Path(source).expanduser()
    if (p / "manifest.json").exists():
        raise RuvLLMError(f"--isq quantizes a model source (a Hugging Face folder, a .gguf file, a hub id or an "
                          f"alias), but {source} is already a model package")
    root = isq_root()
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ruvllm-isq-", dir=root))
    _remember(work)
    started = time.perf_counter()
    export(source, quant, work / "package", quiet, extra=("--method", method) if method else (), once=False)
    if not quiet:
        print(f"--isq {spec}: {source} quantized in memory ({work}) in {time.perf_counter() - started:.1f} s",
              file=sys.stderr)
    return work / "package"


def _remember(path: Path) -> None:
    if not _made:
        atexit.register(_remove_all)
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):  # a stopped server's RAM comes back too
            signal.signal(signal.SIGTERM, _on_signal)
    _made.append(path)


def _remove_all() -> None:
    while _made:
        shutil.rmtree(_made.pop(), ignore_errors=True)


def _on_signal(signum, frame) -> None:
    _remove_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
