"""The binary formats RuvLLM's engines share, each described once (standard library only, so the page's
Pyodide reads them too): `block_types` (a GGUF block type as the file stores it and as each engine reads it)
and `step_abi` (the WASM step's structs and the constants its callers share).

`python -m runtime.formats.generate` writes them into the C, C++ and JS files that cannot import Python
(each marked as generated); `tests/runtime/test_formats.py` fails when one of those is stale.
"""
