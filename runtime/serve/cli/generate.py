"""`ruvllm generate`: one prompt, streamed to stdout."""

from __future__ import annotations

import json
import sys
import time

from runtime.errors import RuvLLMError
from runtime.serve.cli.options import add_lora, make_engine, sampling_from


def cmd_generate(args) -> int:
    if args.prompt is None:  # one positional given: it is the prompt
        args.package, args.prompt = None, args.package
    if args.prompt is None:
        raise RuvLLMError('generate needs a prompt: ruvllm generate "Why is the sky blue?"')
    if args.chat and args.raw:
        raise RuvLLMError("--chat and --raw: choose one")
    sampling_from(args)  # the flags are checked before anything loads
    engine = make_engine(args)
    params = sampling_from(args, engine)
    # a chat model gets a chat message, as llama-cli and Ollama send one; --raw sends the text as it is
    chat = args.chat or (not args.raw and engine.chat_template is not None)
    from runtime.serve.reasoning_print import ReplyPrinter

    adapter = add_lora(engine, args)
    started = time.perf_counter()
    prompt = engine.encode_prompt(messages=[{"role": "user", "content": args.prompt}]) if chat else args.prompt
    printer = ReplyPrinter(engine, prompt if chat else [], write=not args.json)  # a reasoning model's thinking, dimmed
    first = None
    ids, last, logprobs = [], None, []
    for out in engine.generate(prompt, params=params, adapter=adapter):
        logprobs.extend({"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top} for lp in out.logprobs)
        if first is None:
            first = time.perf_counter()
        printer.feed(out.delta, out.token_ids)
        ids.extend(out.token_ids)
        last = out
    printer.close()
    end = time.perf_counter()
    if args.json:
        n = last.completion_tokens if last else 0
        print(json.dumps({
            "text": "".join(printer.answer), **({"reasoning": "".join(printer.thought)} if printer.split else {}),
            "token_ids": ids, "prompt_tokens": last.prompt_tokens if last else 0,
            "completion_tokens": n, "finish_reason": last.finish_reason if last else None,
            "ttft_ms": round((first - started) * 1000, 1) if first else None,
            "decode_tokens_per_s": round((n - 1) / (end - first), 1) if first and n > 1 and end > first else None,
            **({"logprobs": logprobs} if params.logprobs is not None else {}),
        }))
    else:
        sys.stdout.write("\n")
    return 0
