"""Run by tests/runtime/test_clients.py in a venv with the official `ollama` client: what it gets from a
`ruvllm serve` at argv[1] for model argv[2], as JSON on stdout."""

import json
import sys

import ollama

client = ollama.Client(host=sys.argv[1])
model = sys.argv[2]
out = {"listed": [m.model for m in client.list().models], "running": [m.model for m in client.ps().models]}
shown = client.show(model + ":latest")
out["capabilities"] = list(shown.capabilities or [])
out["family"] = shown.details.family
messages = [{"role": "user", "content": "Tell me about the sea."}]
options = {"temperature": 0, "num_predict": 12, "seed": 7}
whole = client.chat(model=model, messages=messages, options=options)
out["chat"] = whole.message.content
out["chat_counts"] = [whole.prompt_eval_count, whole.eval_count, whole.done_reason]
out["chat_durations"] = [whole.total_duration, whole.eval_duration]
parts = list(client.chat(model=model, messages=messages, options=options, stream=True))
out["streamed"] = "".join(p.message.content for p in parts)
out["streamed_last"] = [parts[-1].done, parts[-1].eval_count, len(parts)]
gen = client.generate(model=model, prompt="The sea is", raw=True, options=options)
out["generate"] = [gen.response, gen.eval_count]
schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"],
          "additionalProperties": False}
formatted = client.chat(model=model, messages=[{"role": "user", "content": "A name, as JSON."}], format=schema,
                        options={"temperature": 0, "num_predict": 40})
out["formatted"] = formatted.message.content
for name, call in (("missing", lambda: client.chat(model="no-such-model", messages=messages)),
                   ("mirostat", lambda: client.chat(model=model, messages=messages, options={"mirostat": 2}))):
    try:
        call()
        out[name] = None
    except ollama.ResponseError as err:
        out[name] = [err.status_code, err.error]
print(json.dumps(out))
