"""`ruvllm chat` driven through stdin: commands and a conversation that keeps its history."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT


def chat(pkg, script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime", "chat", str(pkg), "--temperature", "0",
                           "--max-tokens", "8"], input=script, capture_output=True, text=True,
                          cwd=str(ROOT), env=os.environ, timeout=300)


def test_chat_commands_and_turns(tiny_package):
    script = "/help\n/system You are terse.\n/temp 0.5\n/temp nope\nhello there\n/clear\n/bogus\nagain\n/quit\n"
    proc = chat(tiny_package("llama"), script)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for expected in ("/system PROMPT", "(system prompt set; conversation cleared)", "(temperature 0.5)",
                     "usage: /temp VALUE", "(conversation cleared)", "unknown command /bogus"):
        assert expected in out, out


def test_second_turn_reuses_the_first_turns_kv(tiny_package):
    """The second turn's prompt contains the first exchange, and its blocks come from the prefix cache."""
    from runtime.core.engine import Engine
    from runtime.core.sampling import SamplingParams

    engine = Engine.from_package(tiny_package("llama"))
    first = [{"role": "user", "content": "hello"}]
    outs = list(engine.generate(messages=first, params=SamplingParams(temperature=0, max_tokens=8)))
    reply = "".join(o.delta for o in outs)
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
    outs2 = list(engine.generate(messages=second, params=SamplingParams(temperature=0, max_tokens=8)))
    assert outs2[-1].prompt_tokens > outs[-1].prompt_tokens + 5
    first_blocks = outs[-1].prompt_tokens // engine.block_size * engine.block_size
    assert outs2[-1].cached_tokens >= first_blocks > 0  # the first turn is not prefilled again
    assert chat(tiny_package("llama"), "hello\nand then?\n/exit\n").returncode == 0
