"""`ruvllm chat`: the interactive chat, and its per-user adaptation commands."""

from __future__ import annotations

import sys

from runtime.core.sampling import SamplingParams, check_range, range_text
from runtime.errors import RuvLLMError
from runtime.serve.cli.options import add_lora, make_engine, personal_settings, sampling_from

CHAT_HELP = """commands:
  /help            this help
  /clear           forget the conversation
  /system PROMPT   set the system prompt (and clear)
  /temp VALUE      set the temperature
  /good, /bad      rate the last answer (with --user: the adapter learns from it)
  /prefer TEXT     the answer you wanted to the last question (with --user)
  /forget          reset your adapter (with --user)
  /quit, /exit     leave"""



def cmd_chat(args) -> int:
    from runtime.serve.reasoning_print import ReplyPrinter

    sampling_from(args)  # the flags are checked before anything loads
    engine = make_engine(args)
    params = sampling_from(args, engine)
    adapter = add_lora(engine, args)
    me = None
    if args.user:
        if adapter:
            raise RuvLLMError("--user learns the user's own adapter; it does not combine with --lora")
        from runtime.serve.personalization import LocalUser

        me = LocalUser(engine, args.user, personal_settings(args), args.state_dir)
    system = args.system
    history: list[dict] = []
    interactive = sys.stdin.isatty()
    print(f"ruvllm chat: {engine.pkg.name} ({engine.pkg.manifest['quantization']['weights']}). /help for commands."
          + (f" Learning from {args.user}'s messages." if me else ""))
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            print()
            break
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            cmd, _, rest = line.partition(" ")
            if cmd in ("/quit", "/exit"):
                break
            if cmd == "/help":
                print(CHAT_HELP)
            elif cmd == "/clear":
                history = []
                print("(conversation cleared)")
            elif cmd == "/system":
                system = rest.strip() or None
                history = []
                print(f"(system prompt {'set' if system else 'removed'}; conversation cleared)")
            elif cmd == "/temp":
                try:
                    value = float(rest)
                    check_range("temperature", value)
                    params.temperature = value
                    print(f"(temperature {value})")
                except (ValueError, RuvLLMError):
                    print(f"usage: /temp VALUE (temperature {range_text('temperature')})")
            elif me is not None and cmd in ("/good", "/bad", "/prefer", "/forget"):
                personal_command(me, cmd, rest, history, system)
            else:
                print(f"unknown command {cmd}; /help lists them")
            continue
        if me is not None:
            adapter = me.adapter
        history.append({"role": "user", "content": line})
        messages = ([{"role": "system", "content": system}] if system else []) + history
        printer = None
        try:
            ids = engine.encode_prompt(messages=messages)
            printer = ReplyPrinter(engine, ids)  # a reasoning model's thinking, dimmed; only the answer is kept
            for out in engine.generate(ids, params=SamplingParams(**vars(params)), adapter=adapter):
                printer.feed(out.delta, out.token_ids)
        except KeyboardInterrupt:
            pass
        except RuvLLMError as err:
            history.pop()
            print(f"error: {err}")
            continue
        if printer is not None:
            printer.close()
        print()
        history.append({"role": "assistant", "content": "".join(printer.answer) if printer else ""})
        if me is not None:  # the user's own writing: their words, their subjects
            learned = me.learn({"kind": "text", "text": line})
            print(f"(learned from your message: version {learned['version']}, {learned['seconds']:.1f} s)",
                  file=sys.stderr)
    return 0


def personal_command(me, cmd: str, rest: str, history: list[dict], system: str | None) -> None:
    """/good and /bad rate the last answer, /prefer TEXT gives the answer wanted, /forget resets the user."""
    if cmd == "/forget":
        print("(your adapter is reset)" if me.forget() else "(nothing was learned yet)")
        return
    if len(history) < 2 or history[-1]["role"] != "assistant":
        print("(no answer to rate yet)")
        return
    messages = ([{"role": "system", "content": system}] if system else []) + history[:-1]
    if cmd == "/prefer":
        if not rest.strip():
            print("usage: /prefer THE ANSWER YOU WANTED")
            return
        what = {"kind": "preferred", "messages": messages, "answer": rest.strip()}
        history[-1] = {"role": "assistant", "content": rest.strip()}
    else:
        what = {"kind": "rating", "messages": messages, "answer": history[-1]["content"],
                "rating": 1.0 if cmd == "/good" else -1.0}
    learned = me.learn(what)
    print(f"(learned: version {learned['version']}, {learned['seconds']:.1f} s)")
