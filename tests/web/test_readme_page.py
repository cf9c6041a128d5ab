"""README.md's page example, as written, in a page of the offline bundle ('ruvllm-web' mapped to it)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import readme_block

pytestmark = pytest.mark.slow


def test_the_page_example_streams_an_answer(offline_page, web_models):
    page = f"""<!doctype html><meta charset="utf-8">
<script type="importmap">{json.dumps({"imports": {"ruvllm-web": "/ruvllm/index.js"}})}</script>
<script>
addEventListener('error', (e) => {{ window.readmeError = String(e.error?.stack ?? e.message); }});
addEventListener('unhandledrejection', (e) => {{ window.readmeError = String(e.reason?.stack ?? e.reason); }});
</script>
<script type="module">
{readme_block("page")}
window.readmeDone = true;
</script><body></body>"""
    (web_models / "readme.html").write_text(page, encoding="utf-8")
    p = offline_page()
    p.goto("/test-models/readme.html")
    try:
        p.page.wait_for_function("window.readmeDone || window.readmeError")
    except Exception as err:  # the console says why (a module that failed to load sets neither)
        raise AssertionError("\n".join(p.console[-20:])) from err
    assert p.evaluate("window.readmeError || null") is None, "\n".join(p.console)
    assert p.evaluate("document.body.textContent").strip()
