"""A GGUF opened by the page itself, no exporter (issue 75): `createEngine({ model })` with a .gguf URL (read in
byte ranges), a File or an ArrayBuffer. The page's Python makes the package from the header, the step repacks
the tensors as they stream in, and the package is kept for the next load. Tokens equal those of the same file
exported by Python (the bundle's SmolLM2 package, on the same WASM step)."""

from __future__ import annotations

import shutil

import pytest

from tests.exporter.test_gguf_import import write_tiny_gguf
from tests.exporter.test_streamed_export import MIX, write_mixed_gguf
from tests.web.conftest import CHAT, LOAD_ENGINE

pytestmark = pytest.mark.slow

SMOL = "/models/smollm2-135m/"
QUESTION = [{"role": "user", "content": "Name the capital of France, then describe the city."}]
GREEDY = {"max_tokens": 24, "temperature": 0, "return_token_ids": True}
LOAD_ERROR = """async ([model, opts]) => {
  try { await window.createEngine({ model, ...opts }); return null; }
  catch (e) { return String(e.message ?? e); }
}"""
FROM_FILE = """async ([url, opts]) => {
  const blob = await (await fetch(url)).blob();
  window.engine = await window.createEngine({ model: new File([blob], 'picked.gguf'), ...opts });
  return window.engine.info;
}"""


@pytest.fixture(scope="module")
def ggufs(web_models, smol_gguf, workdir):
    """The embedded SmolLM2 GGUF, and one of Q2_K projections (a type the step does not read), served."""
    folder = web_models / "gguf"
    folder.mkdir(exist_ok=True)
    if not (folder / "smol.gguf").exists():
        shutil.copy(smol_gguf, folder / "smol.gguf")
    if not (folder / "whole.gguf").exists():  # a tiny llama, whole and as gguf-split's three parts
        write_tiny_gguf(folder / "whole.gguf", smol_gguf, "Q4_K")
        write_tiny_gguf(folder / "split.gguf", smol_gguf, "Q4_K", split_max_tensors=7)
    if not (folder / "q2k.gguf").exists():
        write_mixed_gguf(folder / "q2k.gguf", smol_gguf, {name: "Q2_K" for name in MIX}, embedding="Q8_0", head=None)
    return "/test-models/gguf/"


def ids_of(p) -> list[int]:
    return p.evaluate(CHAT, {"messages": QUESTION, **GREEDY})["choices"][0]["token_ids"]


def test_a_gguf_url_opens_in_the_page_alone_and_is_kept_for_the_next_load(offline_page, ggufs):
    p = offline_page()
    p.api()
    url = ggufs + "smol.gguf"
    info = p.evaluate(LOAD_ENGINE, [url, {"threads": 1}])
    assert info["backend"] == "wasm-step" and info["gguf"] == "smol.gguf" and info["cache"]["downloaded"] == 1
    got = ids_of(p)
    ranges = [r for u, r in p.ranges if u.endswith("/smol.gguf")]
    assert ranges and all(r and r.startswith("bytes=") for r in ranges), ranges  # no request for the whole file
    p.evaluate("async () => { await window.engine.unload(); }")
    p.evaluate(LOAD_ENGINE, [SMOL, {"threads": 1, "backend": "wasm-step"}])
    assert got == ids_of(p)  # the exporter's package of the same file on the same step
    # a reload: the kept package, from storage, the GGUF not read again
    p.api()
    before = len(p.requests)
    info = p.evaluate(LOAD_ENGINE, [url, {"threads": 1}])
    assert info["gguf"] == "smol.gguf" and info["cache"]["fromCache"] > 0 and info["cache"]["downloaded"] == 0
    assert not [u for u in p.requests[before:] if u.endswith("/smol.gguf")]
    assert ids_of(p) == got


def test_a_picked_file_and_an_array_buffer_open_alike(offline_page, ggufs):
    p = offline_page()
    p.api()
    info = p.evaluate(FROM_FILE, [ggufs + "smol.gguf", {"threads": 2}])
    assert info["gguf"] == "picked.gguf" and info["threads"] == 2
    from_file = ids_of(p)
    p.evaluate("async () => { await window.engine.unload(); }")
    p.evaluate("""async ([url, opts]) => {
      const bytes = await (await fetch(url)).arrayBuffer();
      window.engine = await window.createEngine({ model: bytes, ...opts });
    }""", [ggufs + "smol.gguf", {"threads": 1}])
    assert ids_of(p) == from_file


def test_a_split_gguf_opens_as_its_one_file(offline_page, ggufs):
    """gguf-split's parts, by the first part's URL or as Files in any order, answer as the whole file does; a
    later part's URL, or parts missing, are refused by name."""
    p = offline_page()
    p.api()
    p.evaluate(LOAD_ENGINE, [ggufs + "whole.gguf", {"threads": 1}])
    want = ids_of(p)
    p.evaluate("async () => { await window.engine.unload(); }")
    info = p.evaluate(LOAD_ENGINE, [ggufs + "split-00001-of-00003.gguf", {"threads": 1}])
    assert info["gguf"] == "split-00001-of-00003.gguf" and info["cache"]["downloaded"] == 1
    assert ids_of(p) == want
    assert {u.rsplit("/", 1)[1] for u, _ in p.ranges if "split-" in u} == {f"split-0000{k}-of-00003.gguf" for k in (1, 2, 3)}
    p.evaluate("async () => { await window.engine.unload(); }")
    p.evaluate("""async ([base, names, opts]) => {
      const files = await Promise.all(names.map(async (n) => new File([await (await fetch(base + n)).blob()], n)));
      window.engine = await window.createEngine({ model: files, ...opts });
    }""", [ggufs, [f"split-0000{k}-of-00003.gguf" for k in (3, 1, 2)], {"threads": 2}])
    assert ids_of(p) == want
    err = p.evaluate(LOAD_ERROR, [ggufs + "split-00002-of-00003.gguf", {}])
    assert err and "part 2 of a split GGUF" in err, err
    err = p.evaluate("""async ([url]) => {
      const file = new File([await (await fetch(url)).blob()], 'split-00001-of-00003.gguf');
      try { await window.createEngine({ model: file }); return null; } catch (e) { return String(e.message ?? e); }
    }""", [ggufs + "split-00001-of-00003.gguf"])
    assert err and "3 parts: 1 given" in err, err


def test_a_gguf_the_step_cannot_run_is_refused_by_name_before_its_weights(offline_page, ggufs):
    p = offline_page()
    p.api()
    err = p.evaluate(LOAD_ERROR, [ggufs + "q2k.gguf", {}])
    assert err and "Q2_K" in err, err
    ranges = [r for u, r in p.ranges if u.endswith("/q2k.gguf")]
    assert ranges and all(r.startswith("bytes=0-") for r in ranges), ranges  # the header's reads only
    err = p.evaluate(LOAD_ERROR, [ggufs + "smol.gguf", {"backend": "onnxruntime"}])
    assert err and "wasm-step" in err, err
