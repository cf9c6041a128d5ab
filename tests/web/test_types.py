"""The npm package's published types compile against a consumer that uses all of them (tsc --noEmit)."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess

from runtime.core.request_fields import SAMPLING_FIELDS, SamplingField
from runtime.formats import generate
from tests.conftest import ROOT

TSC = ROOT / "web" / "node_modules" / "typescript" / "bin" / "tsc"
TYPES = ROOT / "tests" / "web" / "types"


def tsc(project) -> subprocess.CompletedProcess:
    assert TSC.exists(), "typescript is a devDependency of web/: (cd web && npm ci)"
    return subprocess.run(["node", str(TSC), "-p", str(project)], capture_output=True, text=True, timeout=300)


def test_index_d_ts_serves_a_consumer_of_every_export():
    proc = tsc(TYPES / "tsconfig.json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_a_misuse_of_the_api_is_a_type_error(tmp_path):
    for name in ("tsconfig.json", "consumer.ts"):
        shutil.copy(TYPES / name, tmp_path / name)
    (tmp_path / "tsconfig.json").write_text((tmp_path / "tsconfig.json").read_text().replace(
        "../../../web/src/index.d.ts", str(ROOT / "web" / "src" / "index.d.ts")))
    bad = (tmp_path / "consumer.ts").read_text().replace("const id: number = stream.id;", "const id: string = stream.id;")
    (tmp_path / "consumer.ts").write_text(bad)
    proc = tsc(tmp_path / "tsconfig.json")
    assert proc.returncode != 0 and "stream.id" not in proc.stderr and "TS2322" in proc.stdout, proc.stdout[-2000:]


def test_a_sampling_field_added_to_the_declaration_reaches_the_page_types(tmp_path):
    """runtime/core/request_fields.py's rows, generated into web/src/request_fields.d.ts: a request with a field
    added to a copy of the declaration compiles against the regenerated types, and not against today's."""
    fake = SamplingField("xtc_probability", "number", 0.0, (0.0, 1.0, False), "XTC: how often to exclude top choices",
                         "llama.cpp's server")
    spec = dataclasses.replace(generate.Spec(), sampling_fields=(*SAMPLING_FIELDS, fake))
    assert (ROOT / generate.FIELDS_TS).read_text() == generate.outputs()[generate.FIELDS_TS]
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(ROOT / "web" / "src" / "index.d.ts", src / "index.d.ts")
    (tmp_path / "consumer.ts").write_text(
        "import type { ChatCompletionRequest, CompletionRequest } from 'ruvllm-web';\n"
        "const chat: ChatCompletionRequest = { messages: [{ role: 'user', content: 'hi' }], xtc_probability: 0.5 };\n"
        "const text: CompletionRequest = { prompt: 'hi', xtc_probability: 0.5, temperature: 0 };\n"
        "export { chat, text };\n")
    (tmp_path / "tsconfig.json").write_text((TYPES / "tsconfig.json").read_text().replace(
        "../../../web/src/index.d.ts", str(src / "index.d.ts")))
    (src / "request_fields.d.ts").write_text(generate.outputs()[generate.FIELDS_TS])
    proc = tsc(tmp_path / "tsconfig.json")
    assert proc.returncode != 0 and "xtc_probability" in proc.stdout, proc.stdout[-2000:]
    (src / "request_fields.d.ts").write_text(generate.outputs(spec)[generate.FIELDS_TS])
    proc = tsc(tmp_path / "tsconfig.json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
