"""Lesson 18: tensor parallelism — two worker processes, each with half of every layer, tied by all-reduces."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

import statistics

from benchmarks.tensor_parallel import collective_share, time_steps
from engine import LLM, SamplingParams
from engine.model_executor.layers.vocab_parallel_embedding import pad_vocab_size
from lessons.cli import main
from lessons.framework import events_of, queue_request, table
from tracer.tui.fmt import fmt_bytes

TITLE = "Tensor parallelism"
SUMMARY = ("Two ranks, one worker process each: which heads, MLP columns and vocabulary rows each holds, the "
           "all-reduces and the logits all-gather, logits equal to one rank, and what the communication costs here.")
TP = 2
PROMPT = "The paged KV cache stores the keys and values of every token in fixed-size blocks."


def span(r) -> str:
    return f"{r[0]}–{r[1] - 1}"


def run(lesson) -> None:
    lesson.intro(
        "When a model no longer fits one GPU, or one GPU is too slow for it, vLLM splits **every layer** "
        "across *N* ranks (`--tensor-parallel-size N`), Megatron-style: each rank holds a slice of each weight "
        "matrix and a slice of the KV cache, all ranks run every step together, and after each layer's "
        "attention and MLP the ranks add up their partial results with an **all-reduce**. You will start an "
        f"engine with {TP} ranks, one worker process each (gloo over loopback stands in for NCCL over NVLink), "
        "and look at what each rank holds, what it receives, what it sends, and what that costs.")
    llm, session = lesson.engine(tensor_parallel_size=TP, num_kv_blocks=64)
    engine = llm.llm_engine
    cfg = engine.engine_core.engine_core.model_config
    events = events_of(session)

    # ---- who holds what ----
    padded = _what_each_rank_loaded(lesson, cfg, events)
    _each_rank_caches_its_own_heads(lesson, events)
    lesson.pause()

    # ---- a step: the same scheduler output, two all-reduces per layer ----
    sub = session.bus.subscribe()
    req = queue_request(engine, "A", PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5))
    engine.step()
    engine.step()
    step_events = sub.pull().events
    _every_rank_gets_the_same_step(lesson, step_events)
    _the_collectives_of_a_step(lesson, cfg, step_events, req, padded)
    lesson.pause()

    # ---- the same logits ----
    _the_same_logits_as_one_rank(lesson, engine)
    lesson.pause()

    # ---- the cost ----
    _what_communication_costs(lesson, session, engine, cfg)
    lesson.done(
        f"- `--tensor-parallel-size {TP}` starts {TP} worker processes; each holds whole attention heads, a slice of "
        "the MLP, its heads' share of the KV cache (same block ids everywhere) and a slice of the vocabulary "
        "(wte, which is also the tied LM head; padded to a multiple of 64).\n"
        "- Every step, all ranks receive the same scheduler output; the logits are all-gathered, every rank "
        "samples the same tokens, and the executor keeps rank 0's.\n"
        "- One all-reduce for the embedding and two per layer (after attn.c_proj and mlp.c_proj), carrying "
        "tokens × n_embd floats.\n"
        "- Results equal one rank's up to float summation order.\n"
        "- Communication is a barrier per all-reduce: on a small CPU it dominates; on GPUs with NVLink and big "
        "layers it is a small share, and the split memory is the point.")


def _what_each_rank_loaded(lesson, cfg, events: list) -> int:
    """Heads, MLP columns, vocabulary rows and parameters per rank: returns the padded vocabulary size."""
    loads = sorted((e.attrs for e in events if (e.layer, e.name, e.kind) == ("worker", "model_load", "end")),
                   key=lambda a: a["rank"])
    padded = loads[0]["vocab_padded"]
    rows = [[a["rank"], a["pid"], span(a["heads"]), span(a["mlp"]), span(a["vocab"]), f"{a['params']:,}",
             a["torch_threads"]] for a in loads]
    lesson.show(table(["rank", "pid", f"heads (of {cfg.n_head})", f"mlp.c_fc columns (of {cfg.n_inner})",
                       f"wte / LM-head rows (of {padded})", "parameters", "torch threads"], rows,
                      title="what each worker process loaded (trace: worker/model_load)"))
    heads = [tuple(a["heads"]) for a in loads]
    lesson.check(heads == [(r * cfg.n_head // TP, (r + 1) * cfg.n_head // TP) for r in range(TP)],
                 f"each rank holds {cfg.n_head // TP} whole attention heads of {cfg.n_head}, none twice: c_attn is "
                 "split column-wise by heads, taking the rank's columns from each of the q, k and v thirds")
    lesson.check([tuple(a["mlp"]) for a in loads] == [(r * cfg.n_inner // TP, (r + 1) * cfg.n_inner // TP)
                                                      for r in range(TP)],
                 f"mlp.c_fc is split by output columns ({cfg.n_inner // TP} each; GELU is elementwise, so each "
                 "rank applies it to its own columns), and mlp.c_proj by the matching input rows")
    lesson.check(len({a["pid"] for a in loads}) == TP and all(a["torch_threads"] >= 1 for a in loads),
                 f"{TP} worker processes, each with its own torch thread count: cores shared out, not oversubscribed")
    lesson.check(padded % 64 == 0 and padded >= cfg.vocab_size > padded - 64 and pad_vocab_size(50257, TP) == 50304 and
                 [tuple(a["vocab"]) for a in loads] == [(r * padded // TP, (r + 1) * padded // TP) for r in range(TP)],
                 f"the token embedding wte is split by vocabulary: its {cfg.vocab_size} rows, padded to {padded} (a "
                 f"multiple of 64), in {TP} equal shards; GPT-2's 50,257 would pad to 50,304")
    layer = 4 * cfg.n_embd * cfg.n_embd + 2 * cfg.n_embd * cfg.n_inner  # c_attn + attn.c_proj, mlp
    full = sum(p.numel() for p in LLM(lesson.model).llm_engine.engine_core.engine_core.model.parameters())
    # what every rank holds whole: all but wte and the split weights and biases (c_attn's, c_fc's)
    replicated = full - cfg.vocab_size * cfg.n_embd - cfg.n_layer * (layer + 3 * cfg.n_embd + cfg.n_inner)
    lesson.check(all(a["params"] < full for a in loads) and sum(a["params"] for a in loads) ==
                 full + (TP - 1) * replicated + (padded - cfg.vocab_size) * cfg.n_embd,
                 f"each rank holds fewer parameters than the whole model ({full:,}), and together more by exactly "
                 "what is replicated (wpe, the layer norms, the row-parallel biases) and the zero padding rows")
    lesson.say(f"Per layer, the {layer:,} weights of the four big matrices are split in {TP}. So is the token "
               f"embedding ({cfg.vocab_size} × {cfg.n_embd}), by vocabulary, as vLLM's GPT-2 does "
               "(`VocabParallelEmbedding` in `vllm/model_executor/layers/vocab_parallel_embedding.py`): a rank "
               "looks up only the ids in its shard, zeroes the others' vectors, and an **all-reduce** adds the "
               "ranks' results. The tied **LM head** is that same shard: each rank computes the logits of its "
               "slice of the vocabulary, and they are **all-gathered** (V1's `LogitsProcessor._gather_logits` in "
               "`layers/logits_processor.py`), so every rank holds the whole logits and runs the sampler. The "
               "vocabulary is padded to a multiple of 64 (`pad_vocab_size`, whatever the TP size) and the "
               "padding's columns are cut off after the gather. Only `wpe`, the layer norms and the row-parallel "
               "biases are replicated. "
               "(Our one difference: with one rank we do not pad, since nothing is split; vLLM pads even then.)")
    return padded


def _each_rank_caches_its_own_heads(lesson, events: list) -> None:
    kv = next(e.attrs for e in events if (e.layer, e.name, e.kind) == ("engine", "kv_cache_alloc", "end"))
    lesson.show(table(["rank", "heads", "bytes per block", "KV-cache bytes"],
                      [[r["rank"], span(r["heads"]), fmt_bytes(r["bytes_per_block"]), fmt_bytes(r["bytes"])]
                       for r in kv["ranks"]], title=f"the KV cache: {kv['num_blocks']} blocks on every rank"))
    lesson.check(all(r["bytes_per_block"] * TP == kv["bytes_per_block"] for r in kv["ranks"]),
                 "each rank caches K and V of its own heads only: half the bytes per block; block ids, and so "
                 "the scheduler's one block table per request, are the same on every rank")


def _every_rank_gets_the_same_step(lesson, step_events: list) -> None:
    """Both workers receive the same scheduler output and sample the same tokens."""
    received = [e for e in step_events if (e.layer, e.name) == ("worker", "execute_model")]
    lesson.show(table(["step", "rank", "num_scheduled_tokens", "digest"],
                      [[e.step, e.attrs["rank"], e.attrs["num_scheduled_tokens"], e.attrs["digest"]]
                       for e in received], title="what each worker received (trace: worker/execute_model)"))
    lesson.check(all(len({e.attrs["digest"] for e in received if e.step == s}) == 1 and
                     sorted(e.attrs["rank"] for e in received if e.step == s) == list(range(TP))
                     for s in (0, 1)),
                 "every step, both workers receive the same scheduler output (one message, encoded once)")
    lesson.say("vLLM writes that message once into a shared-memory ring that every local worker reads "
               "(`MessageQueue` in `vllm/distributed/device_communicators/shm_broadcast.py`, enqueued by "
               "`MultiprocExecutor.collective_rpc` in `vllm/v1/executor/multiproc_executor.py`). We send it over "
               "one ZMQ socket per rank, on purpose: the message is a few KB and a ZMQ round trip tens of "
               "microseconds against a step of milliseconds (the docstring of "
               "`engine/executor/multiproc_executor.py` says so).")
    sampled = [e for e in step_events if (e.layer, e.name) == ("sampler", "sampled")]
    lesson.check(all(sorted(e.attrs["rank"] for e in sampled if e.step == s) == list(range(TP)) and
                     len({tuple(e.attrs["token_ids"]) for e in sampled if e.step == s}) == 1 for s in (0, 1)),
                 "every rank ran the sampler on the same all-gathered logits and drew the same tokens "
                 "(trace: sampler/sampled, one per rank)")
    lesson.say("As in V1, `execute_model` runs the forward pass on every rank and `sample_tokens` samples; the "
               "executor takes the `ModelRunnerOutput` from rank 0 only: `MultiprocExecutor.sample_tokens` "
               "calls `collective_rpc(..., unique_reply_rank=self.output_rank)`. V1's other ranks send nothing "
               "back; ours reply with no tokens but with their trace events, which is how you see rank 1 here.")


def _the_collectives_of_a_step(lesson, cfg, step_events: list, req, padded: int) -> None:
    """The all-reduces and the all-gather of a prefill and a decode step, per rank, with their bytes."""
    kernels = [e for e in step_events if e.layer == "kernel" and e.step is not None]
    rows = []
    for s, num_tokens in ((0, req.num_prompt_tokens), (1, 1)):
        for rank in range(TP):
            mine = [e for e in kernels if e.step == s and e.attrs["rank"] == rank]
            reduces = [e for e in mine if e.name == "all_reduce"]
            gather = [e for e in mine if e.name == "all_gather"]
            rows.append([s, rank, num_tokens, len(reduces), fmt_bytes(reduces[0].attrs["meta"]["bytes"]),
                         fmt_bytes(gather[0].attrs["meta"]["bytes"]),
                         f"{sum(e.attrs['duration_ns'] for e in reduces + gather) / 1e3:.0f} µs"])
            lesson.check([x.attrs["meta"]["site"] for x in reduces] == ["wte"] + ["attn.c_proj", "mlp.c_proj"]
                         * cfg.n_layer and all(x.attrs["meta"]["bytes"] == num_tokens * cfg.n_embd * 4 for x in reduces)
                         and len(gather) == 1 and gather[0].attrs["meta"]["bytes"] == padded // TP * 4,
                         f"step {s}, rank {rank}: {2 * cfg.n_layer + 1} all-reduces (the embedding's, then "
                         f"{cfg.n_layer} layers × attn.c_proj and mlp.c_proj), each of {num_tokens} token(s) × "
                         f"{cfg.n_embd} floats × 4 bytes; one all-gather of this rank's {padded // TP} logits")
    lesson.show(table(["step", "rank", "tokens", "all-reduces", "bytes each", "all-gather bytes",
                       "time in collectives"], rows, title="the collectives, traced as kernel launches"))
    lesson.say("The all-reduce carries the **hidden state** (tokens × n_embd), not weights: so prefill's all-reduces "
               "grow with the prompt, and a decode step's are tiny. Row-parallel layers add their bias once, on "
               "rank 0 before the sum, not once per rank.")


def _the_same_logits_as_one_rank(lesson, engine) -> None:
    """Finish request A and compare its tokens and logprobs with one rank's."""
    final = None
    while engine.has_unfinished_requests():
        final = next((o.outputs[0] for o in engine.step() if o.finished), final)
    one = LLM(lesson.model, num_kv_blocks=64).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5), use_tqdm=False)[0]
    diff = max(abs(lp.logprob - b[t].logprob) for a, b in zip(final.logprobs, one.outputs[0].logprobs)
               for t, lp in a.items())
    lesson.check(final.token_ids == one.outputs[0].token_ids and
                 all(a.keys() == b.keys() for a, b in zip(final.logprobs, one.outputs[0].logprobs)),
                 "TP=2 produced the same tokens, with the same top-5 candidates at every position, as one rank")
    lesson.check(diff < 1e-4, f"the log-probabilities differ by at most {diff:.1e}: the same sums, added in "
                              "another order (each rank sums half the products, then the all-reduce adds the halves)")


def _what_communication_costs(lesson, session, engine, cfg) -> None:
    """Decode steps timed on one rank and on two, and the share of a traced step spent in collectives."""
    lesson.say("Now the cost. The same batch (8 requests of 64 tokens, then decode steps) on one rank and on two, "
               "in turn:")
    single = LLM(lesson.model, num_kv_blocks=128)
    two = LLM(lesson.model, tensor_parallel_size=TP, num_kv_blocks=128)
    times = {1: [], 2: []}
    try:
        for rnd in range(3):
            for tp, lm in ((1, single), (TP, two)):
                got = time_steps(lm.llm_engine, 8, 64, 8, tag=f"t{rnd}-")
                if rnd:  # the first round warms up
                    times[tp] += got["decode_ms"]
    finally:
        two.shutdown()
    t1, t2 = statistics.median(times[1]), statistics.median(times[TP])
    sub = session.bus.subscribe()
    time_steps(engine, 8, 64, 2, tag="c")
    comm, total = collective_share([(e.layer, e.name, e.kind, e.request_id, e.step, e.attrs)
                                    for e in sub.pull().events
                                    if e.step == engine.engine_core.engine_core.step_count - 1])
    lesson.show(table(["", "TP=1", f"TP={TP}"], [["decode step (median)", f"{t1:.1f} ms", f"{t2:.1f} ms"]],
                      title="measured just now"))
    lesson.check(comm > 0 and total > 0, f"in a traced TP={TP} decode step, rank 0 spent {comm:.0f} µs of its "
                                         f"{total:.0f} µs of kernel time in all-reduce and all-gather "
                                         f"({comm / total:.0%})")
    if t2 > t1:
        lesson.say(f"**TP={TP} was {t2 / t1:.1f}× slower here**, and that is expected. Each rank does half "
                   "the arithmetic, but this model's matrices are tiny, so a layer's compute takes microseconds "
                   "while an all-reduce is a *barrier*: it waits for the slower rank, then crosses loopback TCP "
                   f"through gloo; {2 * cfg.n_layer + 2} collectives per step. And both ranks share this machine's "
                   "cores with the process that schedules. On GPUs the balance flips for big models: NCCL over "
                   "NVLink moves hundreds of GB/s, a layer of a 70B model is milliseconds of matmul per GPU, "
                   "and halving the weights per GPU is what lets the model (and a bigger KV cache) fit at all.")
    else:
        lesson.say(f"TP={TP} was not slower in this run ({t2:.1f} against {t1:.1f} ms), which is unusual on a small "
                   "CPU machine: the all-reduces are barriers over loopback TCP, and they normally cost more than "
                   "the halved arithmetic saves. `python -m benchmarks.tensor_parallel` measures it with more "
                   "repetitions.")


if __name__ == "__main__":
    sys.exit(main(globals()))
