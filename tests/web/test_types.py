"""The npm package's published types compile against a consumer that uses all of them (tsc --noEmit)."""

from __future__ import annotations

import shutil
import subprocess

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
