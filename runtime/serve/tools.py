"""OpenAI tools on chat completions: the request's tools into the prompt, the reply's calls out of the text.

The model is asked in the Hermes / Qwen format: its chat template's own when the template takes `tools`
(Qwen2.5's does), else a system message describing them, with past calls as `<tool_call>` blocks and
tool results as `<tool_response>` user turns. `tool_choice` "required" or a named function constrains the
reply to such calls, their arguments by each function's parameter schema (a Lark grammar over JSON
schemas: runtime.core.constraints); "auto" lets the model choose and parses what it wrote. Pure standard
library, so the page's engine can shape the same replies.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from runtime.core.constraints import JSON_LAYOUT, Constraint

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CALLS = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.S)


class ToolError(ValueError):
    """A tools field that is not as OpenAI defines it; `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Tools:
    functions: list[dict]  # each {"name", "description", "parameters"}
    choice: str | None  # None (auto), "none", "required", or a function's name
    parallel: bool = True

    @property
    def active(self) -> bool:
        return bool(self.functions) and self.choice != "none"


def parse_tools(body: dict) -> Tools | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat request; ToolError names what is wrong."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise ToolError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise ToolError("'tools' must be a non-empty array", "tools")
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
            raise ToolError(f"'tools[{i}]' must be {{'type': 'function', 'function': {{'name': ...}}}} with a name "
                            "of letters, digits, _ or - (at most 64)", f"tools[{i}]")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"'tools[{i}].function.parameters' must be a JSON schema object", f"tools[{i}]")
        if not isinstance(fn.get("description", ""), str):
            raise ToolError(f"'tools[{i}].function.description' must be a string", f"tools[{i}]")
        functions.append({"name": fn["name"], "description": fn.get("description", ""), "parameters": params})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("'tools' names a function twice", "tools")
    if choice is None or choice == "auto":
        picked = None
    elif choice in ("none", "required"):
        picked = choice
    elif (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
          and choice["function"].get("name") in names):
        picked = choice["function"]["name"]
    else:
        raise ToolError("'tool_choice' must be none, auto, required or {'type': 'function', 'function': "
                        "{'name': one of the tools}}", "tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    return Tools(functions, picked, parallel)


def constraint(tools: Tools) -> Constraint | None:
    """A required or named call: the reply is one (or, in parallel, several) `<tool_call>` blocks, each a
    {"name", "arguments"} object whose arguments follow that function's parameters."""
    if not tools.active or tools.choice is None:
        return None
    fns = [f for f in tools.functions if tools.choice == "required" or f["name"] == tools.choice]
    calls = [json.dumps({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                         "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": JSON_LAYOUT})
             for f in fns]
    rules = "\n".join(f"call_{i}: %json {schema}" for i, schema in enumerate(calls))
    one = f'"{CALL_OPEN}\\n" (' + " | ".join(f"call_{i}" for i in range(len(calls))) + f') "\\n{CALL_CLOSE}"'
    several = tools.parallel and tools.choice == "required"  # a named function: that one call
    start = 'start: call ("\\n" call)*\n' if several else "start: call\n"
    return Constraint("grammar", start + f"call: {one}\n" + rules)


def system_text(tools: Tools) -> str:
    """The Hermes-format tool instructions, for a chat template that does not take `tools` itself."""
    sigs = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in tools.functions)
    return ("You may call one or more functions to assist with the user query.\n\nYou are provided with function "
            f"signatures within <tools></tools> XML tags:\n<tools>\n{sigs}\n</tools>\n\nFor each function call, "
            "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
            f'{CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CALL_CLOSE}')


def render_messages(messages: list[dict], tools: Tools | None, template_takes_tools: bool) -> list[dict]:
    """Messages the chat template can render: past assistant calls as `<tool_call>` text and tool results
    as `<tool_response>` user turns (unless the template handles them), and the tools' instructions in the
    system message when the template does not take `tools`."""
    if template_takes_tools:
        return messages
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [f'{CALL_OPEN}\n{json.dumps({"name": c["function"]["name"], "arguments": _args(c)})}\n{CALL_CLOSE}'
                     for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m.get("content") or "", *calls]))})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools is not None and tools.active:
        text = system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _args(call: dict):
    raw = call["function"].get("arguments", "{}")
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return raw


def parse_calls(text: str, tools: Tools) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a reply: each well-formed `<tool_call>` block naming one of the tools
    becomes a call with an id and its arguments as JSON text; the rest stays content (None when empty)."""
    names = {f["name"] for f in tools.functions}
    calls = []
    for block in _CALLS.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and call.get("name") in names and isinstance(call.get("arguments", {}), dict):
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}})
    if not calls:
        return text, []
    rest = _CALLS.sub("", text).strip()
    return rest or None, calls
