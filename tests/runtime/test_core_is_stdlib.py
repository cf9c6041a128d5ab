"""The runtime core imports and works with numpy, onnxruntime, tokenizers and torch absent (as in Pyodide)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import ROOT

BLOCKER = textwrap.dedent("""
    import importlib.abc, sys
    BLOCKED = {"numpy", "onnxruntime", "tokenizers", "torch", "transformers", "onnx", "regex"}
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"blocked: {name}", name=name)
            return None
    sys.meta_path.insert(0, Block())
""")


def test_core_modules_import_without_native_libraries(smol_tokenizer_dir):
    code = BLOCKER + textwrap.dedent(f"""
        import runtime.core.engine, runtime.text.tokenizer, runtime.core.sampling, runtime.core.stop, runtime.package
        import runtime.core.kv_blocks, runtime.core.step_batch, runtime.text.chat_template, runtime.contract, runtime.serve.cli
        from runtime.text.tokenizer import Tokenizer
        tok = Tokenizer.from_file({str(smol_tokenizer_dir / "tokenizer.json")!r})
        assert tok.backend == "pure-python", tok.backend
        ids = tok.encode("Hello, world! 123")
        assert tok.decode(ids) == "Hello, world! 123"
        for name in ("numpy", "onnxruntime", "tokenizers"):
            assert name not in sys.modules, name
        print("ok", ids)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok")


def test_native_backend_reports_missing_onnxruntime(tiny_package):
    code = BLOCKER + textwrap.dedent(f"""
        from runtime.serve.cli import main
        sys.exit(main(["generate", {str(tiny_package("llama"))!r}, "hi", "--max-tokens", "2"]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT))
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: the native backend needs numpy and onnxruntime")
    assert "Traceback" not in proc.stderr


def test_runtime_load_imports_no_cli(tiny_package):
    """Model resolution is the runtime's (runtime/resolve.py): a library user's `runtime.load` never imports the CLI
    (every command's code) nor the server."""
    code = textwrap.dedent(f"""
        import sys, runtime
        engine = runtime.load({str(tiny_package("llama"))!r})
        from runtime.core.sampling import SamplingParams
        assert list(engine.generate("hi", SamplingParams(max_tokens=2)))
        clis = sorted(m for m in sys.modules if m.startswith("runtime.serve"))
        print(clis)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_the_pages_preload_leaves_the_skipped_packages_unimported():
    """The page's snapshot imports what the page reaches and nothing it skips (the CLI is a package: walking into it
    would import it whole, and a heap past 32 MB is a snapshot Pyodide cannot restore)."""
    code = textwrap.dedent("""
        import sys, types
        sys.modules["pyodide"] = types.ModuleType("pyodide")
        sys.modules["pyodide.ffi"] = types.ModuleType("pyodide.ffi")
        from runtime.serve.web_preload import preload_modules
        preload_modules()
        print(sorted(m for m in sys.modules if m.startswith(("runtime.serve.cli", "runtime.resolve"))))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout
