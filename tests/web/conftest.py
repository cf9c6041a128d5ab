"""Browser fixtures: the offline bundle, a static server with COOP/COEP, and Debian's Chromium via Playwright.

Every page runs with the network cut off: Chromium resolves no host but 127.0.0.1, and the
context aborts (and records) any request that leaves it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import ROOT, made_once, run_cli

CHROMIUM = Path("/usr/bin/chromium")
LAUNCH_ARGS = ["--no-sandbox", "--disable-quic", "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
               "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]
PAGES = Path(__file__).parent / "pages"
LOAD_TIMEOUT_MS = 300_000


@pytest.fixture(scope="session")
def step_files(shared, smol_gguf):
    """step.wasm (and its SIMD128 and threaded builds), and SmolLM2's step weights (its GGUF's own blocks, repacked) beside it."""
    def make(out: Path) -> None:
        from exporter.step_weights import write_step_weights
        from wasm.step_module import FALLBACK, THREADED, build

        out.mkdir()
        build(out / "step.wasm")
        build(out / FALLBACK, relaxed=False)
        build(out / THREADED, threads=True)
        write_step_weights(smol_gguf, out, max_pos=1024)

    return made_once(shared, shared / "wasm-step", make)


@pytest.fixture(scope="session")
def web_bundle(shared, test_cache) -> Path:
    """dist/web built from this checkout, with SmolLM2 exported for the browser into the test cache."""
    def make(out: Path) -> None:
        proc = run_cli("build", "--out", str(out), module="wasm", env={"RUVLLM_CACHE_DIR": str(test_cache)}, timeout=1200)
        assert proc.returncode == 0, proc.stderr[-3000:]

    return made_once(shared, shared / "web", make)


@pytest.fixture(scope="session")
def web_models(workdir) -> Path:
    """A folder served at /test-models/: tests copy (or link) packages into it."""
    d = workdir / "test-models"
    d.mkdir(exist_ok=True)
    return d


@pytest.fixture(scope="session")
def site(web_bundle, web_models, workdir):
    from wasm.serve import serve_in_thread

    npm = workdir / "npm"
    npm.mkdir(exist_ok=True)
    mounts = {"/test/": PAGES, "/test-models/": web_models, "/npm/": npm,
              "/node_modules/": ROOT / "web" / "node_modules"}
    server, url = serve_in_thread(web_bundle, mounts)
    yield url
    server.shutdown()


def publish(web_models: Path, package: Path, name: str) -> str:
    """Serve a package folder at /test-models/<name>/ and return that path."""
    dest = web_models / name
    if not dest.exists():
        shutil.copytree(package, dest)
    return f"/test-models/{name}/"


@pytest.fixture(scope="package")
def playwright():
    """One Playwright driver for tests/web (its sync API allows only one at a time).

    Package scope, not session: while the driver lives, its event loop counts as running in this
    thread, and any later test calling asyncio.run() would fail.
    """
    if not CHROMIUM.exists():
        pytest.fail("browser tests need Debian's Chromium: apt-get install -y chromium (.ci/run does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        yield p


def launch(playwright, *extra: str):
    return playwright.chromium.launch(executable_path=str(CHROMIUM), args=LAUNCH_ARGS + list(extra))


@pytest.fixture(scope="package")
def browser(playwright):
    b = launch(playwright)
    yield b
    b.close()


class OfflinePage:
    """A fresh browser context whose requests must stay on 127.0.0.1."""

    def __init__(self, browser, base: str) -> None:
        self.base = base
        self.context = browser.new_context()
        self.off_origin: list[str] = []
        self.requests: list[str] = []
        self.ranges: list[tuple[str, str | None]] = []  # (url, its Range header) of every request
        self.console: list[str] = []
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.set_default_timeout(LOAD_TIMEOUT_MS)
        self.page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}"))
        self.page.on("pageerror", lambda e: self.console.append(f"pageerror: {e}"))

    def _route(self, route) -> None:
        url = route.request.url
        self.requests.append(url)
        self.ranges.append((url, route.request.headers.get("range")))
        if url.startswith(("http://127.0.0.1", "blob:", "data:")):
            route.continue_()
        else:
            self.off_origin.append(url)
            route.abort()

    def goto(self, path: str) -> None:
        self.page.goto(self.base + path.lstrip("/"))

    def api(self) -> None:
        """Open the API test page (imports createEngine)."""
        self.goto("/test/api.html")
        self.page.wait_for_function("window.apiReady || window.apiError")
        assert self.page.evaluate("window.apiError || null") is None

    def evaluate(self, script: str, arg=None):
        return self.page.evaluate(script, arg)

    def close(self) -> None:
        self.context.close()


def pages_on(browser, site, ready=lambda p: None):
    """A fixture's body: a factory of OfflinePages on `browser` (each passed to `ready` first); at teardown
    each is closed and fails the test if a request left 127.0.0.1."""
    pages: list[OfflinePage] = []

    def make(*args, **kwargs) -> OfflinePage:
        p = OfflinePage(browser, site)
        pages.append(p)
        ready(p, *args, **kwargs)
        return p
    yield make
    for p in pages:
        log = "\n".join(p.console[-30:])
        p.close()
        assert not p.off_origin, f"requests left 127.0.0.1: {p.off_origin}\n{log}"


@pytest.fixture
def offline_page(browser, site):
    yield from pages_on(browser, site)


LOAD_ENGINE = """async ([model, opts]) => {
  window.engine = await window.createEngine({ model, ...(opts || {}) });
  return window.engine.info;
}"""

CHAT = """async (request) => {
  const r = await window.engine.chat.completions.create(request);
  return r;
}"""

STREAM = """async (request) => {
  const stream = await window.engine.chat.completions.create({ ...request, stream: true });
  const chunks = [];
  for await (const c of stream) chunks.push({ t: performance.now(), c });
  return chunks;
}"""


def stream_ids(chunks: list[dict]) -> list[int]:
    return [t for ch in chunks for choice in ch["c"].get("choices", []) for t in choice.get("token_ids", [])]


def dump(obj) -> str:
    return json.dumps(obj, indent=1)[:3000]
