"""Lesson 27: mixture of experts — a router picks each token's experts, and only those run."""
import json
import pathlib
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

import torch

from benchmarks.moe import dense_comparison, dense_twin
from engine.builtin_model import LLAMA_NAME, MOE_NAME, builtin_path
from engine.model_executor.layers.fused_moe.layer import moe_layers
from engine.trace_names import ALL_GATHER, ALL_REDUCE, BATCH, KERNEL, MODEL_RUNNER, REDUCE_SCATTER, ROUTING, WORKER
from kernels import moe_align_block_size
from lessons.cli import main
from lessons.framework import events_of, greedy, queue_request, table
from tracer.tui.fmt import fmt_bytes

TITLE = "Mixture of experts"
SUMMARY = ("The built-in tiny-moe (8 experts, top-2): active against total parameters and what a token costs "
           "(measured), the router's choice for real tokens, moe_align_block_size's expert blocks and their padding, "
           "the load imbalance per layer, and expert parallelism's collectives with their bytes.")
PROMPT = "Return a new list containing all items from the iterable in ascending order."
TEXTS = ["If the file does not exist, an error is raised.", "The default value of the argument is None.",
         "This function returns the number of nodes in the graph.", "Read the data from the file and return it.",
         "A new dictionary is created for each call.", "The list is sorted in place and nothing is returned."]
FLOAT32 = 4  # bytes a value: the lesson's engines run in float32


def run(lesson) -> None:
    lesson.intro(
        "DeepSeek, Qwen3-MoE, gpt-oss and Mixtral replace each layer's MLP by a **mixture of experts**: E "
        "smaller MLPs (the experts) and a **router**, a linear layer that scores the E experts for every token. "
        "Each token goes through its **top-k** experts only, and their outputs are summed with the router's "
        "weights. So a model holds all E experts (its **total** parameters) but a token runs through k of them "
        "(its **active** parameters). vLLM runs the layer as `FusedMoE` (`vllm/model_executor/layers/fused_moe/`): "
        "`fused_topk` picks the experts, `moe_align_block_size` sorts the (token, expert) pairs into blocks of one "
        "expert each, and one grouped GEMM runs every block. You will watch all of it on the built-in `tiny-moe` "
        "(Qwen3-MoE-shaped: 4 layers, 8 experts of 192 features, top-2), then split its experts over two ranks.")
    with tempfile.TemporaryDirectory() as folder:
        llm, session = parameters(lesson, pathlib.Path(folder))
        router(lesson, llm, session)
        blocks(lesson)
        imbalance(lesson, llm, session)
        expert_parallel(lesson, llm)
    lesson.done(
        "- A mixture of experts holds E experts a layer but runs k of them a token: tiny-moe holds 3.58 M "
        "parameters and computes with 1.81 M a token, as much as the dense tiny-llama.\n"
        "- The router's softmax picks each token's top-k experts; Qwen3-MoE's `norm_topk_prob` (and Mixtral, "
        "always) renormalises their weights to 1.\n"
        "- `moe_align_block_size` sorts the (token, expert) pairs by expert and pads each expert's run to a "
        "multiple of the block size: one expert per block for the grouped GEMM, at the price of padding rows "
        "(most of the rows of a decode step).\n"
        "- A decode step reads the weights of every expert some token chose: one token's k, a batch's nearly "
        "all E, for the same FLOPs a token; few FLOPs per byte read is why MoE decode is memory-bound.\n"
        "- The load is uneven (the busiest expert's tokens over the mean, per layer); under expert parallelism "
        "the rank with the busiest experts sets the step's pace.\n"
        "- Expert parallelism holds E/N whole experts a rank and replaces the MoE layer's all-reduce by an "
        "all-gather of the tokens, a reduce-scatter of the experts' outputs and an all-gather back.")


def prompt_ids(i: int, n: int = 12) -> dict:
    return {"prompt_token_ids": [(7 * i + 3 * j) % 200 + 10 for j in range(n)]}


def profiled_decode(llm, session, batch: int, tag: str) -> list[dict]:
    """The profiled launches of one decode step of `batch` requests (their prefill runs first, unprofiled)."""
    engine = llm.llm_engine
    for i in range(batch):
        engine.add_request(f"{tag}{i}", prompt_ids(i), greedy(3))
    engine.step()
    sub = session.bus.subscribe()
    llm.start_profile()
    engine.step()
    llm.stop_profile()
    ops = [{"name": e.name, **e.attrs} for e in sub.pull().events
           if e.layer == KERNEL and e.kind != "begin" and (e.attrs or {}).get("profiled")]
    while engine.has_unfinished_requests():
        engine.step()
    return ops


def counts(model) -> dict:
    """Parameters: the whole model, a router, Qwen3's q/k norms (what a Llama layer lacks)."""
    named = dict(model.named_parameters())
    return dict(total=sum(p.numel() for p in named.values()),
                routers=sum(p.numel() for n, p in named.items() if n.endswith("mlp.gate.weight")),
                qk_norms=sum(p.numel() for n, p in named.items() if "q_norm" in n or "k_norm" in n))


def parameters(lesson, folder: pathlib.Path):
    llm, session = lesson.engine(model=MOE_NAME, num_kv_blocks=128, dtype="float32")
    model = llm.llm_engine.engine_core.engine_core.model
    layers = moe_layers(model)
    ex = layers[0][1]
    per_expert = ex.w13_weight[0].numel() + ex.w2_weight[0].numel()
    mine = counts(model)
    active = mine["total"] - sum((m.num_experts - m.top_k) * per_expert for _, m in layers)
    card = json.loads((builtin_path(MOE_NAME) / "train_config.json").read_text())
    twin = dense_twin(folder / "dense-same-total")
    engines = {"tiny-moe": (llm, session),
               "same active": lesson.engine(model=LLAMA_NAME, num_kv_blocks=128, dtype="float32"),
               "same total": lesson.engine(model=twin, num_kv_blocks=128, dtype="float32")}
    n_active, n_total = (counts(engines[k][0].llm_engine.engine_core.engine_core.model)["total"]
                         for k in ("same active", "same total"))
    extra = mine["routers"] + mine["qk_norms"]
    lesson.show(table(["model", "parameters held", "parameters a token runs through"], [
        ["tiny-moe (8 experts of 192 features, top-2)", f"{mine['total']:,}", f"{active:,}"],
        ["tiny-llama (one MLP of 384 = 2 × 192)", f"{n_active:,}", f"{n_active:,}"],
        ["dense twin (one MLP of 1,536 = 8 × 192)", f"{n_total:,}", f"{n_total:,}"]],
        title="counted in the engines' models"))
    lesson.check(mine["total"] == card["parameters"] and active == card["active_parameters"],
                 f"tiny-moe holds {mine['total']:,} parameters; a token runs through {active:,} of them (all but "
                 f"{len(layers)} layers × {ex.num_experts - ex.top_k} idle experts × {per_expert:,}), as its model "
                 "card says")
    lesson.check(active - n_active == extra == mine["total"] - n_total,
                 f"tiny-llama's {n_active:,} and the dense twin's {n_total:,} are tiny-moe's active and total counts "
                 f"less {extra:,}: the routers ({mine['routers']:,}) and Qwen3's q/k norms ({mine['qk_norms']:,})")
    lesson.pause()
    cost_per_token(lesson, engines, per_expert, ex.top_k, ex.num_experts)
    step_times(lesson, twin)
    return llm, session


def cost_per_token(lesson, engines: dict, per_expert: int, top_k: int, num_experts: int) -> None:
    """engines: name -> (LLM, its trace session)."""
    ops = {(name, b): profiled_decode(llm, s, b, f"p{b}-") for name, (llm, s) in engines.items() for b in (1, 8)}
    flops = {k: sum(o.get("flops") or 0 for o in v) / k[1] for k, v in ops.items()}
    nbytes = {k: sum(o.get("bytes") or 0 for o in v) for k, v in ops.items()}
    used = {b: [o["meta"]["experts_used"] for o in ops["tiny-moe", b] if o["name"] == "fused_moe_ref"] for b in (1, 8)}
    rows = [[name, b, f"{flops[name, b] / 1e6:.2f} M", fmt_bytes(nbytes[name, b]),
             " ".join(map(str, used[b])) if name == "tiny-moe" else "-"] for b in (1, 8) for name in engines]
    lesson.show(table(["model", "decode batch", "FLOPs a token", "bytes the step moved", "experts read per layer"],
                      rows, title="one decode step of each, profiled (FLOPs and bytes from each op's shapes)"))
    lesson.check(all(u == top_k for u in used[1]),
                 f"with one token, each MoE layer read the weights of its {top_k} experts only: "
                 f"{top_k} × {per_expert:,} values of {num_experts * per_expert:,}")
    ratio = flops["tiny-moe", 1] / flops["same active", 1]
    lesson.check(abs(ratio - 1) < 0.02 and flops["same total", 1] > 1.5 * flops["tiny-moe", 1],
                 f"a token costs tiny-moe {flops['tiny-moe', 1] / 1e6:.2f} M FLOPs, {ratio:.3f}× what it costs "
                 f"tiny-llama (same active size) and {flops['same total', 1] / flops['tiny-moe', 1]:.2f}× less than "
                 "the dense twin of the same total size")
    lesson.check(max(used[8]) > top_k and nbytes["tiny-moe", 8] > nbytes["same active", 8],
                 f"with 8 tokens the MoE layers read {'/'.join(map(str, used[8]))} experts each, and the step moved "
                 f"{nbytes['tiny-moe', 8] / nbytes['same active', 8]:.2f}× tiny-llama's bytes: memory traffic "
                 "follows the experts the batch touches, compute the active parameters")
    lesson.pause()


def step_times(lesson, twin: str) -> None:
    times, _ = dense_comparison(twin, reps=2, decode_steps=6)
    names = ("tiny-moe", "same active", "same total")
    lesson.show(table(["decode batch", *names, "tiny-moe ÷ same active", "tiny-moe ÷ same total"], [
        [b] + [f"{times[name, b]:.2f} ms" for name in names] +
        [f"{times['tiny-moe', b] / times[other, b]:.2f}" for other in names[1:]]
        for b in (1, 8)], title="decode step, median, measured just now on this machine (untraced engines taking "
                                "the same batch in turn)"))
    lesson.say("These times are this machine's, not a rule: on a CPU a model this small spends much of a step in "
               "Python and in launching ops, and the torch backend runs tiny-moe's experts one after another, so it "
               "can take longer than the dense model of its active size although it computes as much. On a GPU, "
               "decode is bound by the bytes read, which is what the profile above counts. `python -m "
               "benchmarks.moe` measures the same three with more repetitions.")
    lesson.pause()


def router(lesson, llm, session) -> None:
    core = llm.llm_engine.engine_core.engine_core
    layers = [i for i, _ in moe_layers(core.model)]
    logits: dict[int, torch.Tensor] = {}
    hooks = [core.model.model.layers[i].mlp.gate.register_forward_hook(
        lambda mod, args, out, i=i: logits.__setitem__(i, out.detach().float().clone())) for i in layers]
    sub = session.bus.subscribe()
    req = queue_request(llm.llm_engine, "R", PROMPT, greedy(1))
    try:
        llm.llm_engine.step()
    finally:
        for h in hooks:
            h.remove()
    routing = {e.attrs["layer_idx"]: e.attrs for e in sub.pull().events if (e.layer, e.name) == (MODEL_RUNNER, ROUTING)}
    tok = llm.get_tokenizer()
    ids = req.prompt_token_ids
    first, last = layers[0], layers[-1]

    def cell(layer: int, t: int) -> str:
        a = routing[layer]
        return "  ".join(f"{e} ({w:.2f})" for e, w in zip(a["topk_ids"]["R"][t], a["topk_weights"]["R"][t]))

    lesson.show(table(["token", f"layer {first}: experts (weights)", f"layer {last}: experts (weights)"],
                      [[repr(tok.decode([i])), cell(first, t), cell(last, t)] for t, i in enumerate(ids)],
                      title="request R's prefill, from the trace (model_runner/routing, one event per MoE layer)"))
    lesson.check(sorted(routing) == layers and all(len(a["topk_ids"]["R"]) == len(ids) for a in routing.values()),
                 f"the step traced one routing event per MoE layer ({len(layers)}), each with the experts of all "
                 f"{len(ids)} prompt tokens")
    agree, raw_mass = True, []
    for layer, a in routing.items():
        probs = torch.softmax(logits[layer], dim=-1)
        top, chosen = probs.topk(a["top_k"], dim=-1)
        raw_mass += top.sum(-1).tolist()
        want = top / top.sum(-1, keepdim=True)
        agree &= chosen.tolist() == a["topk_ids"]["R"] and torch.allclose(
            torch.tensor(a["topk_weights"]["R"]), want, atol=1e-4)
    lesson.check(agree, "every token's experts and weights are the top-2 of the softmax over the router's 8 logits "
                        "(captured from each layer's gate as the step ran), renormalised: the lesson recomputed them")
    rows = [w for a in routing.values() for w in a["topk_weights"]["R"]]
    lesson.check(all(abs(sum(w) - 1) < 1e-3 and w[0] >= w[1] for w in rows),
                 "each token's two weights sum to 1, best first: tiny-moe's config says norm_topk_prob, so "
                 "fused_topk renormalises")
    lesson.say(f"Before renormalising, a token's two experts held {statistics.mean(raw_mass):.0%} of the router's "
               "probability on average: without `norm_topk_prob` (Qwen3-MoE configs that leave it off) the experts' "
               "outputs would be summed with weights below 1. Mixtral always renormalises. The same token goes to "
               "different experts in different layers: an expert is not a topic, it is what the training's router "
               "made of a slice of the hidden state.")
    counted = all([sum(e == x for row in a["topk_ids"]["R"] for e in row) for x in range(a["num_experts"])]
                  == a["expert_counts"] for a in routing.values())
    lesson.check(counted, "each event's expert_counts (tokens per expert, what the TUI's heat map draws) are the "
                          "tokens' choices counted")
    lesson.pause()


def blocks(lesson) -> None:
    demo = torch.tensor([[2, 3, 0], [1, 2, 0], [1, 3, 0], [1, 2, 3]])
    sorted_ids, expert_ids, post = moe_align_block_size(demo, 4, 4)
    lesson.say("`moe_align_block_size` first, on vLLM's own example: 4 tokens, top-3 of 4 experts, blocks of 4 rows. "
               "The 12 (token, expert) pairs are numbered token × top_k + k; expert 0 has pairs 2, 5, 8 (its "
               "third choice for tokens 0, 1, 2), and so on.")
    lesson.show(table(["block", "expert", "rows (pair ids; 12 = padding)"],
                      [[b, int(expert_ids[b]), " ".join(map(str, sorted_ids[4 * b:4 * b + 4].tolist()))]
                       for b in range(int(post[0]) // 4)], title="moe_align_block_size(topk_ids, 4, 4)"))
    lesson.check(sorted_ids[:16].tolist() == [2, 5, 8, 12, 3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12]
                 and expert_ids[:4].tolist() == [0, 1, 2, 3] and int(post[0]) == 16,
                 "each expert's pairs are contiguous and padded with 12 (no pair) to a multiple of 4: 16 rows, "
                 "one expert a block, as vLLM's docstring has it")
    llm, session = lesson.engine(model=MOE_NAME, attention_backend="triton", num_kv_blocks=16, dtype="float32")
    sub = session.bus.subscribe()
    req = queue_request(llm.llm_engine, "B", PROMPT, greedy(2))
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    evs = sub.pull().events
    routing = {(e.step, e.attrs["layer_idx"]): e.attrs for e in evs if (e.layer, e.name) == (MODEL_RUNNER, ROUTING)}
    launches = [e for e in evs if (e.layer, e.name) == (KERNEL, "fused_moe_w13") and e.step is not None]
    prefill = min(e.step for e in launches)
    ok = True
    for e in launches:
        c, meta = routing[e.step, e.attrs["layer_idx"]]["expert_counts"], e.attrs["meta"]
        bm, pairs = meta["BLOCK_SIZE_M"], sum(c)
        ok &= (meta["expert_blocks"] == [-(-n // bm) for n in c] and meta["padding_rows"] ==
               sum(meta["expert_blocks"]) * bm - pairs and e.attrs["grid"][0] == -(-(pairs + len(c) * (bm - 1)) // bm))
    first = next(e for e in launches if e.step == prefill)
    c, meta = routing[prefill, first.attrs["layer_idx"]]["expert_counts"], first.attrs["meta"]
    bm = meta["BLOCK_SIZE_M"]
    lesson.show(table(["expert", "pairs routed to it", f"blocks of {bm}", "rows", "padding rows"],
                      [[x, n, b, b * bm, b * bm - n] for x, (n, b) in enumerate(zip(c, meta["expert_blocks"]))],
                      title=f"the prefill's layer {first.attrs['layer_idx']} ({req.num_prompt_tokens} tokens × 2 "
                            "pairs), from its fused_moe_w13 launch (Triton backend)"))
    lesson.check(ok, f"in every layer of every step, the launch's recorded expert blocks are ceil(pairs / {bm}) per "
                     "expert (from the routing event's counts), its padding rows are the rest of those blocks, and "
                     f"its grid has ceil((pairs + E × {bm - 1}) / {bm}) programs: the most blocks any routing could "
                     "need, sized before the routing is known; programs past the last block return at once")
    dec = [e.attrs["meta"] for e in launches if e.step != prefill]
    lesson.check(bool(dec) and all(m["padding_rows"] == 2 * bm - 2 and sum(m["expert_blocks"]) == 2 for m in dec),
                 f"a decode step's token has 2 pairs: 2 blocks of {bm} rows, {2 * bm - 2} of them padding, in every "
                 "layer")
    lesson.say(f"The grid of the prefill's launch had {first.attrs['grid'][0]} row programs for "
               f"{sum(meta['expert_blocks'])} blocks. On a GPU, vLLM picks a small BLOCK_SIZE_M when the batch is "
               "small for this reason: a decode step's rows are mostly padding. The second GEMM (`fused_moe_w2`) "
               "runs over the same blocks and multiplies each row by its routing weight; the top-k rows of a token "
               "are then summed (`moe_sum`).")
    lesson.pause()


def imbalance(lesson, llm, session) -> None:
    engine = llm.llm_engine
    sub, before = session.bus.subscribe(), engine.stats().moe_expert_tokens
    llm.generate(TEXTS, greedy(16), use_tqdm=False)
    after = engine.stats().moe_expert_tokens
    evs = sub.pull().events
    tokens = sum(len(e.attrs["input_ids"]) for e in evs if (e.layer, e.name) == (MODEL_RUNNER, BATCH))
    traced: dict[str, list[int]] = {}
    for a in (e.attrs for e in evs if (e.layer, e.name) == (MODEL_RUNNER, ROUTING)):
        row = traced.setdefault(str(a["layer_idx"]), [0] * a["num_experts"])
        traced[str(a["layer_idx"])] = [x + y for x, y in zip(row, a["expert_counts"])]
    load = {k: [a - b for a, b in zip(after[k], before.get(k, [0] * len(after[k])))] for k in after}
    card = json.loads((builtin_path(MOE_NAME) / "train_config.json").read_text())
    rows = [[k, " ".join(f"{n:3d}" for n in c), c.index(max(c)), f"{max(c) / statistics.mean(c):.2f}",
             f"{min(c) / statistics.mean(c):.2f}"] for k, c in sorted(load.items(), key=lambda kv: int(kv[0]))]
    lesson.show(table(["layer", "tokens per expert 0–7", "busiest", "max ÷ mean", "min ÷ mean"], rows,
                      title=f"{len(TEXTS)} prompts, 16 tokens each (ExpertLoadStats: the engine's per-expert load)"))
    lesson.check(load == traced and all(sum(c) == 2 * tokens for c in load.values()),
                 f"the engine's expert load (the scheduler's ExpertLoadStats, exported as metrics) is the routing "
                 f"events' counts summed: {tokens} tokens computed × 2 experts in every layer")
    worst = max(max(c) / statistics.mean(c) for c in load.values())
    lesson.say(f"The busiest expert of a layer took up to {worst:.2f}× an even share here (on its validation text "
               f"the model card measured {card['expert_load_max_over_mean']:.2f}×). Training adds a load-balancing "
               "loss (coefficient 0.01 for tiny-moe) that pushes the router towards even use, but never to exactly "
               "even. It matters most under expert parallelism: the rank holding the busiest experts does the most "
               "work, and every rank waits for it at the combine. vLLM's EPLB moves or copies hot experts between "
               "ranks from these same counts.")
    lesson.pause()


def expert_parallel(lesson, single) -> None:
    llm, session = lesson.engine(model=MOE_NAME, tensor_parallel_size=2, enable_expert_parallel=True,
                                 num_kv_blocks=64, dtype="float32")
    engine = llm.llm_engine
    loads = sorted((e.attrs for e in events_of(session) if (e.layer, e.name, e.kind) == (WORKER, "model_load", "end")),
                   key=lambda a: a["rank"])
    lesson.show(table(["rank", "experts held (of 8, every layer)", "parameters", "whole model"],
                      [[a["rank"], f"{a['experts'][0]}–{a['experts'][1] - 1}", f"{a['params']:,}",
                        f"{a['model_params']:,}"] for a in loads],
                      title="--tensor-parallel-size 2 --enable-expert-parallel (trace: worker/model_load)"))
    lesson.check([a["experts"] for a in loads] == [[0, 4], [4, 8]] and all(a["expert_parallel"] for a in loads),
                 "rank 0 holds experts 0–3 whole and rank 1 experts 4–7: E/N whole experts a rank, disjoint (without "
                 "expert parallelism each rank would hold half of every expert's 192 features)")
    sub = session.bus.subscribe()
    req = queue_request(engine, "E", PROMPT, greedy(4))
    engine.step()
    engine.step()
    evs = sub.pull().events
    n_pre, h = req.num_prompt_tokens, 128
    rows, ok = [], True
    for step, n in ((0, n_pre), (1, 1)):
        share = -(-n // 2)
        for rank in (0, 1):
            mine = [e for e in evs if e.layer == KERNEL and e.step == step and e.attrs.get("rank") == rank]
            moe = [(e.name, e.attrs["meta"]["bytes"]) for e in mine if (e.attrs.get("meta") or {}).get("site")
                   == "mlp.experts"]
            reduces = [e.attrs["meta"] for e in mine if e.name == ALL_REDUCE]
            want = [(ALL_GATHER, share * h * FLOAT32), (REDUCE_SCATTER, 2 * share * h * FLOAT32),
                    (ALL_GATHER, share * h * FLOAT32)] * 4
            ok &= moe == want and all(m["site"] != "mlp.experts" and m["bytes"] == n * h * FLOAT32 for m in reduces)
            rows.append([step, n, rank, fmt_bytes(moe[0][1]), fmt_bytes(moe[1][1]), fmt_bytes(moe[2][1]),
                         f"{len(reduces)} × {fmt_bytes(reduces[0]['bytes'])}"])
    lesson.show(table(["step", "tokens", "rank", "dispatch all_gather", "combine reduce_scatter",
                       "combine all_gather", "all-reduces"], rows,
                      title="each MoE layer's collectives (site mlp.experts), per rank, traced as launches; the "
                            "all-reduces are the embedding's and the attention's"))
    lesson.check(ok, f"in each of the 4 MoE layers each rank all-gathers its ceil(T / 2) tokens (T = {n_pre} in the "
                     f"prefill, 1 in the decode step, the batch padded to a multiple of 2) × {h} floats, "
                     "reduce-scatters the experts' outputs for all of them and all-gathers the shares back; no "
                     f"all-reduce at the experts (the embedding's and the attention's stay, T × {h} floats each)")
    lesson.say("Under tensor parallelism alone every rank already holds every token, so the dispatch gathers what "
               "each rank has: it is the exchange vLLM makes between data-parallel ranks, whose tokens differ "
               "(`AgRsAll2AllManager`, the `allgather_reducescatter` backend, vLLM's default; "
               "`engine/distributed/all2all.py`). Each rank then runs only its own experts on every token; a pair "
               "routed to the other rank's expert adds nothing there, and the reduce-scatter sums the two ranks' "
               "partial outputs.")
    routing = [e for e in evs if (e.layer, e.name) == (MODEL_RUNNER, ROUTING)]
    lesson.check(all(e.attrs["rank_counts"] == [sum(e.attrs["expert_counts"][:4]), sum(e.attrs["expert_counts"][4:])]
                     for e in routing),
                 "the routing events split each layer's pairs by the rank holding the expert: "
                 + ", ".join(f"{e.attrs['rank_counts'][0]}:{e.attrs['rank_counts'][1]}" for e in routing if e.step == 0)
                 + " in the prefill's layers (what the TUI draws as tokens per rank)")
    final = None
    while engine.has_unfinished_requests():
        final = next((o.outputs[0].token_ids for o in engine.step() if o.finished), final)
    one = single.generate([PROMPT], greedy(4), use_tqdm=False)[0].outputs[0].token_ids
    lesson.check(final == one, "the two ranks produced the same greedy tokens as one rank holding every expert")
    lesson.say("On a GPU, expert parallelism is what lets a model with hundreds of experts fit (E/N whole experts "
               "a GPU) and keeps each expert's GEMM whole; the price is the exchange above, which all2all backends "
               "such as DeepEP make cheaper. On this machine gloo's collectives are barriers between two processes "
               "on shared cores: `python -m benchmarks.moe` measures EP=2 against TP=2.")
    lesson.pause()


if __name__ == "__main__":
    sys.exit(main(globals()))
