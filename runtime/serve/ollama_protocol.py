"""Ollama's API in the OpenAI requests the server already runs, and its answers from theirs (stdlib).

A body of /api/chat or /api/generate becomes the OpenAI chat or completions body it means: `options` are read
through the sampling fields' one declaration (runtime/core/request_fields.py, each field's Ollama name), plus
`num_predict` and `stop`; `format` ("json" or a schema) is structured output; `think` is the template's
enable_thinking. The OpenAI responses and chunks it gets back become Ollama's objects and NDJSON lines,
counts and durations (nanoseconds) included. What Ollama would apply and RuvLLM does not (mirostat, typical-p,
images, a raw context) is refused by name, never ignored; what only says how a model runs (GPUs, threads,
num_ctx: a package's context is its own) is accepted and changes nothing.
"""

from __future__ import annotations

import json
import time

from runtime.core.request_fields import SAMPLING_FIELDS

BY_OLLAMA = {f.ollama: f.name for f in SAMPLING_FIELDS if f.ollama}
# how a model runs on Ollama's server, not what it generates: accepted, they change nothing here
RUNTIME_OPTIONS = ("num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "vocab_only", "use_mmap",
                   "use_mlock", "numa", "num_thread", "num_keep", "embedding_only", "logits_all")
# samplers RuvLLM does not have: refused unless at the value that turns them off
NEUTRAL = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0, "penalize_newline": False}


class OllamaError(Exception):
    """A request Ollama's API refuses: {"error": message} with this status."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


def served_name(name, names) -> str:
    """A request's `model` as `name[:tag]`: a served model or adapter's name, with or without `:latest`."""
    if not isinstance(name, str) or not name:
        raise OllamaError("'model' is required")
    if name in names:
        return name
    base, _, tag = name.rpartition(":")
    if base and tag == "latest" and base in names:
        return base
    raise OllamaError(f"model '{name}' not found", 404)


def listed_name(name: str) -> str:
    return name if ":" in name else f"{name}:latest"


def sampling(options) -> dict:
    """The OpenAI body's fields for Ollama's `options`."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise OllamaError("'options' must be an object")
    out: dict = {}
    for key, value in options.items():
        if key in BY_OLLAMA:
            out[BY_OLLAMA[key]] = value
        elif key == "num_predict":
            if isinstance(value, bool) or not isinstance(value, int):
                raise OllamaError("option 'num_predict' must be an integer")
            if value >= 0:  # -1: until it ends, -2: until the context is full (the default here)
                out["max_tokens"] = value
        elif key == "stop":
            out["stop"] = value
        elif key in NEUTRAL:
            if value is not None and value != NEUTRAL[key]:
                raise OllamaError(f"option '{key}' is not supported (only {NEUTRAL[key]!r}, which turns it off)")
        elif key not in RUNTIME_OPTIONS:
            raise OllamaError(f"option '{key}' is not one Ollama knows or RuvLLM applies")
    return out


def _format(fmt) -> dict:
    if fmt in (None, ""):
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(fmt, dict):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}}
    raise OllamaError("'format' must be \"json\" or a JSON schema")


def _think(think) -> dict:
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"chat_template_kwargs": {"enable_thinking": think}}
    if think in ("low", "medium", "high"):  # an effort: thinking on
        return {"chat_template_kwargs": {"enable_thinking": True}}
    raise OllamaError("'think' must be true, false, or an effort (\"low\", \"medium\", \"high\")")


def _common(body: dict) -> dict:
    for field in ("images", "context", "suffix", "template"):
        if body.get(field):
            raise OllamaError(f"'{field}' is not supported: RuvLLM serves text models through their own template")
    out = {"stream": body.get("stream", True), **sampling(body.get("options")), **_format(body.get("format"))}
    if not isinstance(out["stream"], bool):
        raise OllamaError("'stream' must be a boolean")
    if out["stream"]:
        out["stream_options"] = {"include_usage": True}  # the last line's counts
    return out


def _messages(messages) -> list[dict]:
    """Ollama's messages as OpenAI's: tool calls' arguments as JSON text, a tool's reply by its call's name."""
    if not isinstance(messages, list):
        raise OllamaError("'messages' must be an array")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise OllamaError(f"messages[{i}] must be an object")
        if m.get("images"):
            raise OllamaError(f"messages[{i}].images: this model reads text only")
        msg = {"role": m.get("role"), "content": m.get("content") or ""}
        calls = m.get("tool_calls")
        if calls:
            msg["tool_calls"] = [{"id": f"call_{i}_{k}", "type": "function",
                                  "function": {"name": (c.get("function") or {}).get("name"),
                                               "arguments": json.dumps((c.get("function") or {}).get("arguments") or {})}}
                                 for k, c in enumerate(calls)]
        if m.get("role") == "tool":
            msg["tool_call_id"] = m.get("tool_name") or m.get("tool_call_id") or ""
        out.append(msg)
    return out


def chat_body(body: dict, model: str) -> dict:
    """/api/chat's body as an OpenAI chat body."""
    out = {"model": model, "messages": _messages(body.get("messages")), **_common(body), **_think(body.get("think"))}
    if body.get("tools"):
        out["tools"] = body["tools"]
    return out


def generate_body(body: dict, model: str, templated: bool) -> tuple[dict, bool]:
    """/api/generate's body as an OpenAI body, and whether it is a chat: its prompt (and system) through the
    model's template as one user turn, or as it is when `raw` or the model has no template."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise OllamaError("'prompt' must be a string")
    if body.get("raw") or not templated:
        return {"model": model, "prompt": prompt, **_common(body)}, False
    messages = ([{"role": "system", "content": body["system"]}] if body.get("system") else []) + [
        {"role": "user", "content": prompt}]
    return {"model": model, "messages": messages, **_common(body), **_think(body.get("think"))}, True


def now_iso() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


def timings(usage: dict | None, started: float, first: float | None) -> dict:
    """The counts and nanosecond durations Ollama's last object carries."""
    total = int((time.monotonic() - started) * 1e9)
    prompt_ns = int(((first or time.monotonic()) - started) * 1e9)
    usage = usage or {}
    return {"total_duration": total, "load_duration": 0, "prompt_eval_count": usage.get("prompt_tokens", 0),
            "prompt_eval_duration": prompt_ns, "eval_count": usage.get("completion_tokens", 0),
            "eval_duration": max(0, total - prompt_ns)}


def _calls(calls: list | None) -> list | None:
    """OpenAI tool calls as Ollama's: arguments as an object."""
    if not calls:
        return None
    out = []
    for c in calls:
        fn = c.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            args = {}
        out.append({"function": {"name": fn.get("name"), "arguments": args}})
    return out


def done_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def whole(resp: dict, model: str, chat: bool, as_chat: bool, started: float, first: float | None) -> dict:
    """A whole OpenAI response as Ollama's one object (`as_chat`: /api/chat's shape, else /api/generate's)."""
    choice = resp["choices"][0]
    if chat:
        msg = choice["message"]
        text, thinking, calls = msg.get("content") or "", msg.get("reasoning"), _calls(msg.get("tool_calls"))
    else:
        text, thinking, calls = choice.get("text") or "", None, None
    out = {"model": model, "created_at": now_iso()}
    if as_chat:
        message = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        out["message"] = message
    else:
        out["response"] = text
        if thinking:
            out["thinking"] = thinking
    return {**out, "done": True, "done_reason": done_reason(choice.get("finish_reason")),
            **timings(resp.get("usage"), started, first)}


class StreamLines:
    """OpenAI chunks in, Ollama's NDJSON objects out: a line per piece of text (or thinking), tool calls whole
    at the end (Ollama sends them with their arguments as an object), then the last object with the counts."""

    def __init__(self, model: str, as_chat: bool, started: float) -> None:
        self.model, self.as_chat, self.started = model, as_chat, started
        self.first: float | None = None
        self.reason: str | None = None
        self.calls: dict[int, dict] = {}

    def _obj(self, text: str, thinking: str = "", done: bool = False) -> dict:
        out: dict = {"model": self.model, "created_at": now_iso()}
        if self.as_chat:
            out["message"] = {"role": "assistant", "content": text}
            if thinking:
                out["message"]["thinking"] = thinking
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        out["done"] = done
        return out

    def feed(self, chunk: dict) -> list[dict]:
        if "error" in chunk:
            return [{"error": chunk["error"].get("message", "error")}]
        if not chunk.get("choices"):  # the usage chunk: the end
            last = self._obj("", done=True)
            calls = _calls([self.calls[k] for k in sorted(self.calls)])
            if calls and self.as_chat:
                last["message"]["tool_calls"] = calls
            return [{**last, "done_reason": done_reason(self.reason), **timings(chunk.get("usage"), self.started,
                                                                                 self.first)}]
        choice = chunk["choices"][0]
        if self.first is None:
            self.first = time.monotonic()
        self.reason = choice.get("finish_reason") or self.reason
        delta = choice.get("delta")
        if delta is None:  # a completion chunk
            text, thinking = choice.get("text") or "", ""
        else:
            text, thinking = delta.get("content") or "", delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or []:
                held = self.calls.setdefault(call["index"], {"function": {"name": None, "arguments": ""}})
                fn = call.get("function") or {}
                if fn.get("name"):
                    held["function"]["name"] = fn["name"]
                held["function"]["arguments"] += fn.get("arguments") or ""
        return [self._obj(text, thinking)] if text or thinking else []


def package_details(manifest: dict) -> dict:
    """A package's `details` as Ollama lists a model's."""
    arch = manifest.get("architecture", "")
    params = (manifest.get("config") or {}).get("num_parameters") or 0
    size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"
    quant = manifest.get("quantization") or {}
    return {"parent_model": "", "format": "onnx", "family": arch, "families": [arch], "parameter_size": size,
            "quantization_level": str(quant.get("weights") or quant.get("method") or "")}


def package_size(manifest: dict) -> int:
    return sum(int(f.get("size", 0)) for f in (manifest.get("files") or {}).values())


def package_digest(manifest: dict) -> str:
    import hashlib

    files = manifest.get("files") or {}
    return hashlib.sha256("".join(files[k].get("sha256", "") for k in sorted(files)).encode()).hexdigest()
