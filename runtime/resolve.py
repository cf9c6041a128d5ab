"""Where a model argument leads: a package folder as given, or an alias, a hub id, a .gguf file or a Hugging Face
folder exported once into the cache (by the exporter, in a process of its own: runtime never imports it). The CLI,
`runtime.load`, the page's build and the benchmarks resolve models here.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from runtime.aliases import (
    ALIASES,
    DEFAULT_ALIAS,
    cached_package_dir,
    is_hub_id,
    is_model_source,
    source_cache_key,
)
from runtime.errors import RuvLLMError


def resolve_package(arg: str | None, quant: str = "int4", quiet: bool = False, isq: str | None = None) -> Path:
    """A package folder as given, or an alias / hub id exported once into the cache; with isq (--isq
    int4[:method]) any model source quantized into memory for this process (runtime/serve/isq.py)."""
    if arg is None:
        arg = DEFAULT_ALIAS
    if isq:
        from runtime.serve.isq import quantize_source

        return quantize_source(arg, isq, export_into_cache, quiet)
    p = Path(arg).expanduser()
    if (p.exists() and not is_model_source(p)) or (not p.exists() and arg.startswith((".", "/", "~"))):
        return p  # load_package says what is wrong with it
    if arg in ALIASES or is_hub_id(arg) or p.exists():  # a .gguf or a Hugging Face folder: exported once
        key, source = source_cache_key(arg)
        target = cached_package_dir(key, quant)
        if not (target / "manifest.json").exists():
            export_into_cache(source, quant, target, quiet)
        return target
    return p


def export_into_cache(source: str, quant: str, dest: Path, quiet: bool = False, target: str = "cpu",
                      extra: tuple[str, ...] = (), once: bool = True) -> None:
    """Run the exporter (a subprocess: runtime never imports it); extra: further `convert` flags.

    Its progress goes to our stderr as it comes (bars when that is a terminal, else a line per stage);
    its one `error:` line becomes this RuvLLMError's message instead of being printed twice."""
    if not quiet:
        print(f"exporting {source} ({quant}, {target}) into {dest}{' (once)' if once else ''} ...", file=sys.stderr)
    cmd = [sys.executable, "-m", "exporter", "convert", source, "-o", str(dest), "--quant", quant, "--target", target,
           *extra]
    if quiet:
        cmd.append("--quiet")
    env = {**os.environ, "RUVLLM_PROGRESS": "off" if quiet else ("bars" if sys.stderr.isatty() else "lines")}
    spec = importlib.util.find_spec("exporter")  # found, not imported: where this process would import it from
    if spec is not None and spec.origin:  # the child finds it too, whatever its working directory
        env["PYTHONPATH"] = os.pathsep.join([str(Path(spec.origin).parent.parent), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL if quiet else None, stderr=subprocess.PIPE, env=env)
    held, errors, seen = b"", [], []
    while chunk := proc.stderr.read1(1 << 14):
        held += chunk
        *lines, held = held.split(b"\n")
        for line in lines:
            seen.append(line)
            if line.startswith(b"error:"):
                errors.append(line.decode(errors="replace"))
            elif not quiet:
                sys.stderr.buffer.write(line + b"\n")
        if held and not quiet and not b"error:".startswith(held[:6]):  # held back: it may become an error line
            sys.stderr.buffer.write(held)  # a bar redrawn in place (no newline yet)
            held = b""
        sys.stderr.flush()
    seen.append(held)
    if proc.wait() != 0:
        if errors:
            raise RuvLLMError(errors[-1][len("error: "):])
        text = b"\n".join(seen).decode(errors="replace")
        if "No module named exporter" in text or "No module named 'exporter'" in text:
            raise RuvLLMError("exporting needs the exporter: pip install 'ruvllm[export]'")
        last = [ln for ln in text.strip().splitlines() if ln.strip()]
        raise RuvLLMError(f"export of {source} failed: {last[-1] if last else proc.returncode}")
