"""Same request, same tokens (issue 50): a request's tokens and logprobs, bit for bit, whatever runs beside it.

Each request's solo run (alone in a fresh engine, no prefix cache, no drafts) is the reference; random mixes
then run the same requests together: any concurrency, shared and unshared system prompts, prefix-cache hits
and misses, step budgets that cut prompts into chunks anywhere, prompt-lookup drafts on and off, a pool small
enough to preempt and recompute, greedy, penalized and seeded sampled rows side by side.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.backends.kernel_library import operators
from runtime.core.engine import Engine

TOPICS = ["bees and how they make honey", "the history of the bicycle", "volcanoes and how they erupt",
          "the rules of chess"]
QUESTIONS = ["Give me one fact.", "What is the most surprising thing about it?", "Explain it to a child.",
             "Summarize it in one sentence."]
KINDS = {"greedy": {"temperature": 0.0}, "penalized": {"temperature": 0.0, "frequency_penalty": 0.5},
         "seeded": {"temperature": 0.9, "top_p": 0.95, "seed": 7}}


def system_prompt(topic: str, case: int | None = None) -> str:
    """~200 tokens of instructions about one topic; `case` makes it a request's own (no prefix shared)."""
    rules = " ".join(f"Rule {i}: answer briefly, stay on {topic}, and be accurate and friendly." for i in range(12))
    return ("" if case is None else f"Case {case}. ") + f"You are an expert on {topic}. {rules}"


def requests(shared: bool) -> list[list[dict]]:
    """16 chats: 4 system prompts x 4 questions (shared: the 4 questions of a topic share its system prompt)."""
    return [[{"role": "system", "content": system_prompt(t, None if shared else i)}, {"role": "user", "content": q}]
            for i, (t, q) in enumerate((t, q) for t in TOPICS for q in QUESTIONS)]


def params(engine: Engine, kind: str, tokens: int):
    return engine.sampling_params(**KINDS[kind], max_tokens=tokens, ignore_eos=True, logprobs=0)


def run(engine: Engine, batch: list, tokens: int, per_step: int, add=None) -> list[tuple]:
    """`per_step` requests join at each step until all have; each one's (token ids, their logprobs).
    add(engine, item, tokens) submits one item (default: a chat of a KINDS kind)."""
    add = add or (lambda e, item, n: e.add_request(messages=item[0], params=params(e, item[1], n)))
    pending, ids = list(enumerate(batch)), {}
    out: list[tuple[list[int], list[float]]] = [([], []) for _ in batch]
    while pending or engine.has_unfinished():
        for _ in range(per_step):
            if pending:
                i, item = pending.pop(0)
                ids[add(engine, item, tokens)] = i
        for o in engine.step():
            out[ids[o.request_id]][0].extend(o.token_ids)
            out[ids[o.request_id]][1].extend(lp.logprob for lp in o.logprobs)
    return out


def solo(package, batch: list[tuple[list[dict], str]], tokens: int) -> list[tuple]:
    engine = Engine.from_package(package, enable_prefix_cache=False, max_num_seqs=1, speculative_tokens=0)
    return [run(engine, [item], tokens, 1)[0] for item in batch]


def differing(got: list[tuple], want: list[tuple]) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(got, want)) if a != b]


@pytest.fixture(scope="module")
def smol_cases(smol_int4):
    """SmolLM2: the 16 chats of the issue (greedy), each one's solo run; and each kind's solo runs of all 16."""
    tokens = 12
    chats = requests(shared=True) + requests(shared=False)
    return tokens, chats, {kind: solo(smol_int4, [(c, kind) for c in chats], tokens) for kind in KINDS}


def test_sixteen_chats_sharing_system_prompts_answer_as_they_do_alone(smol_int4, smol_cases):
    """The issue's case: 16 chats, 4 system prompts of ~200 tokens x 4 questions, sent at once through
    `ruvllm serve`'s engine: 3 of the 16 answers changed beside the others (the shared prefix's cascade
    attention rounded differently from a lone row)."""
    tokens, chats, want = smol_cases
    engine = Engine.from_package(smol_int4)
    got = run(engine, [(c, "greedy") for c in chats[:16]], tokens, per_step=16)
    assert differing(got, want["greedy"][:16]) == []
    assert engine.stats_snapshot()["prefix_cache_hits"] > 0  # the system prompts were shared


@pytest.mark.slow
def test_sixty_four_requests_at_once_answer_as_they_do_alone(smol_int4, smol_cases):
    """The issue's upper concurrency: 64 requests in one batch (the 32 chats, greedy and seeded sampled), with
    the prefix cache and a step budget that takes many prompts in one step, cutting them otherwise than their
    solo runs."""
    tokens, chats, want = smol_cases
    engine = Engine.from_package(smol_int4, max_num_seqs=64, max_batch_tokens=4096, num_blocks=64 * 20,
                                 long_prefill_tokens=0)  # every prompt admitted while others decode
    batch = [(c, "greedy") for c in chats] + [(c, "seeded") for c in chats]
    got = run(engine, batch, tokens, per_step=64)
    assert differing(got, want["greedy"] + want["seeded"]) == []
    stats = engine.stats_snapshot()
    assert stats["peak_running"] == 64 and stats["prefix_cache_hits"] > 0


@pytest.mark.slow
def test_on_an_int8_pool_too(smol_int4, smol_cases):
    """The two-tier int8 pool: beside each other, with drafts, preempted and recomputed, at step budgets that
    chunk the prompts otherwise than the solo runs, each chat gives its solo tokens. With a budget of 37 the
    chess chat once differed: a request that hit the other chess chat's blocks in the prefix cache gave back
    their exact tails' pages, which that chat still read (kv_pool._tail_tokens, own_from)."""
    tokens, chats, _ = smol_cases
    batch = [(c, "greedy") for c in chats[:16]]
    solo_engine = Engine.from_package(smol_int4, enable_prefix_cache=False, max_num_seqs=1, speculative_tokens=0,
                                      kv_dtype="int8")
    want = [run(solo_engine, [item], tokens, 1)[0] for item in batch]
    for options in ({}, {"speculative_tokens": 3, "speculative_max_batch": 16}, {"num_blocks": 40},
                    {"max_batch_tokens": 37}, {"max_batch_tokens": 16, "num_blocks": 40}):
        engine = Engine.from_package(smol_int4, kv_dtype="int8", **options)
        assert engine.batch_invariance == ""
        assert differing(run(engine, batch, tokens, per_step=16), want) == [], options
        assert engine.stats_snapshot()["prefix_cache_hits"] > 0


MIX = st.fixed_dictionaries({
    "picks": st.lists(st.tuples(st.integers(0, 31), st.sampled_from(sorted(KINDS))), min_size=2, max_size=12),
    "per_step": st.integers(1, 12),
    "max_num_seqs": st.integers(1, 16),
    "max_batch_tokens": st.sampled_from([16, 37, 128, 512]),
    "speculative_tokens": st.sampled_from([0, 3]),
    "num_blocks": st.sampled_from([None, 40]),  # 40 blocks of 16: a few chats at a time, the rest preempted
    "prefix_cache": st.booleans(),
    "warm": st.integers(0, 3),  # chats run first, leaving their blocks in the prefix cache
})


@pytest.mark.slow
@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mix=MIX)
def test_any_mix_of_requests_gives_each_its_solo_tokens(smol_int4, smol_cases, mix):
    tokens, chats, want = smol_cases
    engine = Engine.from_package(smol_int4, max_num_seqs=mix["max_num_seqs"], max_batch_tokens=mix["max_batch_tokens"],
                                 speculative_tokens=mix["speculative_tokens"], speculative_max_batch=16,
                                 num_blocks=mix["num_blocks"], enable_prefix_cache=mix["prefix_cache"])
    picks = mix["picks"]
    if mix["warm"]:
        run(engine, [(chats[i], kind) for i, kind in picks[-mix["warm"]:]], tokens, per_step=1)
    got = run(engine, [(chats[i], kind) for i, kind in picks], tokens, mix["per_step"])
    assert differing(got, [want[kind][i] for i, kind in picks]) == [], mix
    assert engine.scheduler.allocator.num_used == 0


@pytest.mark.skipif("PagedAttention" not in operators(), reason="the graph's own attention: onnxruntime's kernels")
def test_the_engine_and_v1_models_say_where_batch_invariance_holds(smol_int4, tiny_package, peft_adapters):
    """RuvLLM's kernels promise it; an fp32 package's projections on onnxruntime's MatMul and the int8 pool's
    chunk-dependent tails do not, and the model card says which."""
    from runtime.core.async_engine import AsyncEngine
    from runtime.serve.server import ServedModel, model_cards

    engine = Engine.from_package(smol_int4)
    assert engine.backend.batch_invariant and engine.backend.batch_invariance == ""
    card = model_cards({"smol": ServedModel("smol", AsyncEngine(engine), 0)})[0]
    assert card["batch_invariant"] is True and "batch_invariance" not in card
    fp32 = Engine.from_package(tiny_package("llama"), kv_dtype="int8")
    assert not fp32.backend.batch_invariant
    assert fp32.backend.batch_invariance == "projections on onnxruntime's kernels"
    card = model_cards({"tiny": ServedModel("tiny", AsyncEngine(fp32), 0)})[0]
    assert card["batch_invariant"] is False and card["batch_invariance"] == fp32.backend.batch_invariance
    awq = Engine.from_package(tiny_package("llama", "int4"))  # AWQ: its up projections carry a scale
    assert awq.backend.batch_invariant
    awq.adapters.add("attn4", peft_adapters("llama")["attn4"])  # the adapter graph's MLPs stay unfused
    assert awq.backend.batch_invariance.startswith("adapters' MLPs on onnxruntime's elementwise operators")


@pytest.mark.skipif("PagedAttention" not in operators(), reason="the graph's own attention: onnxruntime's kernels")
def test_ruvllm_info_says_it_for_this_host(smol_int4, tiny_package):
    """`ruvllm info` opens the graph as serving would and gives the same answer as /v1/models."""
    import json

    from tests.conftest import run_cli

    proc = run_cli("info", str(smol_int4), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    host = json.loads(proc.stdout)["host"]
    assert host["batch_invariant"] is True and host["batch_invariance"] == ""
    assert host["attention_kernel"].startswith("ruvllm.PagedAttention")
    proc = run_cli("info", str(tiny_package("llama")), "--kv-dtype", "int8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "batch invariant no (projections on onnxruntime's kernels)" in proc.stdout


def test_batch_invariant_flag_serves_one_request_at_a_time_where_kernels_do_not_promise_it(tiny_package):
    """--batch-invariant: onnxruntime's kernels make no promise, so the engine takes the solo path for every
    request (one at a time, no prefix cache, no drafts); where RuvLLM's kernels promise it, nothing changes."""
    from runtime.core.config import EngineConfig

    engine = Engine.from_package(tiny_package("llama"), batch_invariant=True, max_num_seqs=8)
    assert engine.batch_invariance  # an fp32 package: onnxruntime's MatMul
    c = engine.config
    assert (c.max_num_seqs, c.enable_prefix_cache, c.speculative_tokens) == (1, False, 0)
    kept = EngineConfig(max_num_seqs=8, batch_invariant=True)
    assert kept.invariant_for("") is kept and EngineConfig(max_num_seqs=8).invariant_for("why").max_num_seqs == 8


TINY_KINDS = {"greedy": {}, "attn4": {"adapter": "attn4"}, "all16": {"adapter": "all16"},
              "json": {"constraint": "json_object"}, "seeded": {"temperature": 0.9, "seed": 11}}


def tiny_add(engine: Engine, item: tuple[list[int], str], tokens: int) -> str:
    """A token prompt on the tiny model, whose kind picks an adapter or a JSON constraint."""
    from runtime.core.constraints import Constraint
    from runtime.core.sampling import SamplingParams

    prompt, kind = item
    k = TINY_KINDS[kind]
    params = SamplingParams(max_tokens=tokens, temperature=k.get("temperature", 0.0), seed=k.get("seed"),
                            ignore_eos=True, logprobs=0,
                            constraint=Constraint(k["constraint"]) if "constraint" in k else None)
    return engine.add_request(prompt, params, adapter=k.get("adapter"))


def tiny_run(engine: Engine, batch: list[tuple[list[int], str]], tokens: int, per_step: int) -> list[tuple]:
    return run(engine, batch, tokens, per_step, tiny_add)


def tiny_engine(package, adapters: dict, **options) -> Engine:
    engine = Engine.from_package(package, **options)
    for name in ("attn4", "all16"):
        engine.adapters.add(name, adapters[name])
    return engine


@pytest.fixture(scope="module")
def tiny_cases(workdir, tiny_model_dir, peft_adapters):
    """The tiny llama at int4 RTN (RuvLLM's projection kernels, and its adapters' MLPs in ruvllm.LoraSwiGLU):
    24 prompts sharing 3 prefixes of 70 tokens, and each one's solo run per kind."""
    import random

    from exporter.convert import ConvertOptions, convert

    rng = random.Random(3)
    prefixes = [[rng.randrange(3, 2000) for _ in range(70)] for _ in range(3)]
    prompts = [prefixes[i % 3] + [rng.randrange(3, 2000) for _ in range(rng.randrange(1, 40))] for i in range(24)]
    package = convert(str(tiny_model_dir("llama")), workdir / "pkg-llama-int4-rtn",
                      ConvertOptions(quant="int4", method="rtn", progress=False))
    adapters = peft_adapters("llama")
    engine = tiny_engine(package, adapters, enable_prefix_cache=False, max_num_seqs=1, speculative_tokens=0)
    assert engine.backend.batch_invariant, engine.backend.batch_invariance
    want = {kind: [tiny_run(engine, [(p, kind)], 10, 1)[0] for p in prompts] for kind in TINY_KINDS}
    return package, adapters, prompts, want


@pytest.mark.slow
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mix=MIX.map(lambda m: {**m, "picks": [(i % 24, k) for i, k in m["picks"]]}),
       kinds=st.lists(st.sampled_from(sorted(TINY_KINDS)), min_size=12, max_size=12))
def test_adapters_and_constrained_rows_in_the_mix_keep_every_rows_tokens(tiny_cases, mix, kinds):
    """The tiny model: rows on adapters (two slots and the base model in one step) and rows under a JSON
    constraint beside the rest."""
    package, adapters, prompts, want = tiny_cases
    engine = tiny_engine(package, adapters, max_num_seqs=mix["max_num_seqs"], max_batch_tokens=mix["max_batch_tokens"],
                         speculative_tokens=mix["speculative_tokens"], speculative_max_batch=16,
                         num_blocks=mix["num_blocks"] and 12, enable_prefix_cache=mix["prefix_cache"])
    picks = [(i, kinds[n]) for n, (i, _) in enumerate(mix["picks"])]
    if mix["warm"]:
        tiny_run(engine, [(prompts[i], kind) for i, kind in picks[-mix["warm"]:]], 10, 1)
    got = tiny_run(engine, [(prompts[i], kind) for i, kind in picks], 10, mix["per_step"])
    assert differing(got, [want[kind][i] for i, kind in picks]) == [], (mix, picks)


# ---- the attention operator alone: the same query, its numbers bit for bit on every path ----

def attention_feeds(Hq: int, Hkv: int, D: int, rows: list[tuple[int, int, list[int]]], K, V, Q, kv: str):
    """One step of ruvllm.PagedAttention. rows: (first position, tokens, table) over one shared context: the
    keys and values of every position are K, V [positions, Hkv, D] (the pool holds those before a row's first
    position, the step's rows the rest), a token's queries Q [positions, Hq, D]; kv: the pool's numbers."""
    import numpy as np

    from runtime.backends.kv_pool import quantize_rows, quantize_rows_int4
    from runtime.core.kv_blocks import kv_int4_groups

    bs, blocks = 16, 1 + max(max(t) for _, _, t in rows)
    pool_k, pool_v = np.zeros((Hkv, blocks, bs, D), np.float32), np.zeros((Hkv, blocks, bs, D), np.float32)
    qk, v, pos = [], [], []
    S = max(n for _, n, _ in rows)
    qidx, at = np.zeros((len(rows), S), np.int64), 0
    for b, (start, n, table) in enumerate(rows):
        for t in range(start):
            pool_k[:, table[t // bs], t % bs], pool_v[:, table[t // bs], t % bs] = K[t], V[t]
        for t in range(start, start + n):
            qk.append(np.concatenate([Q[t], K[t]]))
            v.append(V[t])
            pos.append(t)
        qidx[b] = [at + min(i, n - 1) for i in range(S)]
        at += n
    width = max(len(t) for _, _, t in rows)
    feeds = {"qk": np.concatenate(qk).astype(np.float32), "v": np.concatenate(v).astype(np.float32),
             "pool_k": pool_k, "pool_v": pool_v, "qidx": qidx, "pos": np.array(pos, np.int64),
             "tables": np.array([t + [0] * (width - len(t)) for _, _, t in rows], np.int64)}
    if kv == "int8":
        (feeds["pool_k"], feeds["scale_k"]), (feeds["pool_v"], feeds["scale_v"]) = quantize_rows(pool_k), quantize_rows(pool_v)
    elif kv == "int4":
        gk, gv = kv_int4_groups(D)
        (feeds["pool_k"], feeds["scale_k"]), (feeds["pool_v"], feeds["scale_v"]) = (quantize_rows_int4(pool_k, gk),
                                                                                    quantize_rows_int4(pool_v, gv))
    return feeds


@pytest.mark.skipif("PagedAttention" not in operators(), reason="the graph's own attention: onnxruntime's kernels")
@pytest.mark.parametrize("kv", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("Hq,Hkv,D,window,softcap", [(4, 2, 16, 0, 0.0), (9, 3, 64, 0, 0.0), (8, 2, 128, 0, 1.5),
                                                      (6, 1, 64, 0, 0.0), (8, 2, 32, 24, 0.0)])
def test_a_querys_numbers_are_the_same_on_every_path_of_the_operator(Hq, Hkv, D, window, softcap, kv):
    """A prompt of 600 positions computed in one chunk and in chunks of 1, 2, 7, 16, 40 and 300 tokens; its
    last token decoded alone (its keys cut into ranges across threads), beside 8 other rows, and in a group
    of rows sharing its first blocks (cascade): every position's output bit for bit the same."""
    import numpy as np
    import onnxruntime as ort

    from runtime.backends.kernel_library import library
    from tests.runtime.test_cpu_kernels import attention_graph

    T, bs = 600, 16
    rng = np.random.default_rng(D + Hq)
    K = rng.standard_normal((T, Hkv, D), dtype=np.float32)
    V = rng.standard_normal((T, Hkv, D), dtype=np.float32)
    Q = rng.standard_normal((T, Hq, D), dtype=np.float32)
    table = list(range(1, 1 + T // bs + 1))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.register_custom_ops_library(str(library()[0]))
    if kv == "int4" and D % 32:
        pytest.skip("an int4 pool needs head_dim a multiple of 32")
    op = ort.InferenceSession(attention_graph(Hq, Hkv, window, 1 / np.sqrt(D), kv, softcap), opts)

    def step(rows):
        return op.run(None, attention_feeds(Hq, Hkv, D, rows, K, V, Q, kv))[0]

    whole = step([(0, T, table)])
    for size in (1, 2, 7, 16, 40, 300):
        for start in range(0, T, size) if size > 2 else (0, 5, 17, 255, 256, 257, T - 1):
            n = min(size, T - start)
            assert np.array_equal(step([(start, n, table)]), whole[start:start + n]), (size, start)
    last = whole[T - 1]
    others = [(rng.integers(40, 500), 1, list(range(100 + 40 * i, 140 + 40 * i))) for i in range(8)]
    paths = {"alone": [(T - 1, 1, table)], "beside": [(T - 1, 1, table)] + others,
             "shared": [(T - 1, 1, table)] + [(T - 1 - 30 + i, 1, table[:32] + list(range(500 + 8 * i, 508 + 8 * i)))
                                               for i in range(5)]}
    for name, rows in paths.items():
        assert np.array_equal(step(rows)[0], last), name
