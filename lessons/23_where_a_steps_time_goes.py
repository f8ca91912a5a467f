"""Lesson 23: where a step's time goes — every op profiled, on this machine's roofline."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

from rich.text import Text

from engine.trace_names import KERNEL
from kernels.roofline import OpPoint
from lessons.cli import main
from lessons.framework import greedy, table
from tracer.roofline import by_kind, fmt_count, machine_roofline, profiled_ops

TITLE = "Where a step's time goes"
SUMMARY = ("Every op of a prefill and a decode step profiled: FLOPs, bytes, time, the share of attention, MLP and "
           "LM head, and which roof each sits under on this machine's measured roofline.")
PREFILL_REQUESTS, PREFILL_TOKENS = 1, 384  # one prefill step of 384 tokens, then decode steps of 1
DECODE_STEPS = 5  # profiled decode steps, each op's median time kept
BATCHES = (1, 8, 32, 64)  # decode batch sizes swept
# which part of the model an op belongs to, by its launch name (GPT-2's and Llama's)
GROUPS = {"attention": ("c_attn", "attn.c_proj", "reshape_and_cache", "unified_attention", "cpu_attention",
                        "qkv_proj", "o_proj", "rotary", "q_norm", "k_norm"),
          "MLP": ("c_fc", "mlp.c_proj", "gelu", "gate_up_proj", "down_proj", "silu"),
          "LM head": ("lm_head",)}


def group_of(name: str) -> str:
    for group, prefixes in GROUPS.items():
        if name.startswith(prefixes):
            return group
    return "other (embedding, norms, sampler)"


def profile_steps(llm, session, n: int = 1) -> list[list[dict]]:
    """Run n engine steps with profiling on; each step's profiled launches (rank 0), in order."""
    sub = session.bus.subscribe()  # from now on
    llm.start_profile()
    for _ in range(n):
        llm.llm_engine.step()
    llm.stop_profile()
    by_step: dict[int, list[dict]] = {}
    for ev in sub.pull().events:
        a = ev.attrs or {}
        if ev.layer == KERNEL and a.get("profiled") and (a.get("rank") or 0) == 0 and ev.kind != "begin":
            by_step.setdefault(ev.step, []).append({"name": ev.name, **a})
    return [by_step[s] for s in sorted(by_step)]


def median_step(steps: list[list[dict]]) -> list[dict]:
    """Steps of the same shape as one: each op with its median duration (one op of a busy CPU's step
    can take 50 times its usual time, when another process has the core)."""
    out = []
    for ops in zip(*steps):
        ns = sorted(k["duration_ns"] for k in ops)
        out.append({**ops[0], "duration_ns": ns[len(ns) // 2]})
    return out


def matmul_point(launches: list[dict], lm_head: bool = True) -> OpPoint:
    """The step's matmuls summed (without the LM head: only the layers' matmuls)."""
    return by_kind(profiled_ops([k for k in launches if lm_head or k["name"] != "lm_head"]))["matmul"]


def shares(launches: list[dict]) -> dict[str, float]:
    total = sum(k["duration_ns"] for k in launches)
    out: dict[str, float] = {}
    for k in launches:
        out[group_of(k["name"])] = out.get(group_of(k["name"]), 0.0) + k["duration_ns"] / total
    return out


def run(lesson) -> None:
    lesson.intro(
        "The first question of performance work: **where does the time go?** Profiling (vLLM's "
        "`/start_profile`; here `LLM.start_profile()`, `p` in the TUI) makes every op of the forward pass a "
        "traced launch, with the **FLOPs** it computes and the **bytes** it must move, from its shapes. Their "
        "ratio, the **arithmetic intensity** (FLOP per byte), places each op on this machine's **roofline**: "
        "below the ridge point it waits for memory, above it for arithmetic. We profile a prefill step and a "
        "decode step of the built-in model, then decode steps of growing batches.")
    llm, session = lesson.engine(num_kv_blocks=512, block_size=16, max_num_seqs=max(BATCHES))
    llm.generate(["warm up"], greedy(2), use_tqdm=False)
    engine, core = llm.llm_engine, llm.llm_engine.engine_core.engine_core
    cfg = core.model_config
    roof = _this_machines_roofline(lesson, core)

    prefill, decode = _profile_a_prefill_and_decodes(lesson, llm, session, engine)
    pre_mm, dec_mm = _decode_matmuls_have_low_intensity(lesson, prefill, decode, roof, cfg)
    lesson.pause()

    # ---- the sweep ----
    _intensity_grows_with_the_batch(lesson, llm, session, engine, roof)
    lesson.pause()

    # ---- attention, MLP, LM head ----
    _lm_head_is_large_for_a_tiny_model(lesson, prefill, decode, cfg)
    lesson.pause()

    # ---- the roofline ----
    _both_steps_on_the_roofline(lesson, core, prefill, decode, roof, pre_mm, dec_mm)
    lesson.done(
        "Profiling turns every op into a launch with FLOPs, bytes and time. Decode steps multiply one token per "
        "request by every weight, so their intensity is about 0.5 FLOP/byte per request in the batch: "
        "memory-bound, which is why batching many requests is nearly free and why the LM head of a large "
        "vocabulary weighs so much in a tiny model. Prefill reuses each weight for every prompt token: "
        "compute-bound. `vllm-trace export TRACE --roofline roofline.html` draws the same chart for a projector.")


def _this_machines_roofline(lesson, core):
    """Measure (or load) this machine's roofline and say what it is."""
    roof, path, measured = machine_roofline(core.device.type, str(core.dtype).removeprefix("torch."))
    lesson.say(f"This machine's roofline ({'measured now' if measured else 'measured before'}, cached in "
               f"`{path}`): peak **{fmt_count(roof.peak_flops, 'FLOP/s')}** (a {roof.matmul_n}² {roof.dtype} "
               f"matmul), bandwidth **{fmt_count(roof.peak_bw, 'B/s')}** (a large copy), so the ridge point is at "
               f"**{roof.ridge:.1f} FLOP/byte**. `vllm-trace roofline` prints it again.")
    return roof


def _profile_a_prefill_and_decodes(lesson, llm, session, engine) -> tuple[list[dict], list[dict]]:
    """One profiled prefill step and DECODE_STEPS decode steps; returns the prefill and the median decode step."""
    for i in range(PREFILL_REQUESTS):
        prompt = [(7 * j + i) % 250 + 5 for j in range(PREFILL_TOKENS)]
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt}, greedy(DECODE_STEPS + 1))
    prefill, *decodes = profile_steps(llm, session, 1 + DECODE_STEPS)  # their prefill, then their decode steps
    decode = median_step(decodes)
    while engine.has_unfinished_requests():
        engine.step()
    names = {k["name"] for k in decode}
    lesson.check(len(names) >= 10, f"a profiled decode step has {len(decode)} launches of {len(names)} distinct "
                                   f"ops: {', '.join(sorted(names))}")
    return prefill, decode


def _decode_matmuls_have_low_intensity(lesson, prefill, decode, roof, cfg) -> tuple[OpPoint, OpPoint]:
    """The layers' matmuls of both steps summed; returns (prefill's, decode's) matmul points."""
    pre_mm, dec_mm = matmul_point(prefill, lm_head=False), matmul_point(decode, lm_head=False)
    rows = []
    for label, mm, batch in (("prefill", pre_mm, f"{PREFILL_REQUESTS} × {PREFILL_TOKENS} tokens"),
                             ("decode", dec_mm, f"{PREFILL_REQUESTS} × 1 token")):
        rows.append([label, batch, fmt_count(mm.flops), fmt_count(mm.bytes, "B"), f"{mm.intensity:.2f}",
                     fmt_count(mm.flops_per_s, "FLOP/s"), mm.bound(roof)])
    lesson.show(table(["step", "batch", "matmul FLOPs", "matmul bytes", "FLOP/byte", "achieved", "bound"], rows,
                      title=f"the layers' matmuls summed (QKV, projections, MLP of all {cfg.n_layer} layers; decode: "
                            f"each op's median over {DECODE_STEPS} steps)"))
    lesson.check(dec_mm.intensity < pre_mm.intensity,
                 f"decode's matmuls have a lower arithmetic intensity ({dec_mm.intensity:.2f} FLOP/byte) than "
                 f"prefill's ({pre_mm.intensity:.1f}): they read the same weights for 1 token per request instead "
                 f"of {PREFILL_TOKENS}")
    lesson.say("A matmul of M tokens through a K×N weight does 2·M·K·N FLOPs and moves at least the weight "
               "(K·N values) plus M·(K + N) activations. With M = 1 that is about 2 FLOPs per weight value, i.e. "
               "0.5 FLOP/byte in float32: every byte of weight read buys one multiply-add. With "
               f"M = {PREFILL_TOKENS} each weight value read serves {PREFILL_TOKENS} tokens. (The LM head is left "
               "out here: even in a prefill step it runs only on each request's last position, the one sampled, as "
               "in vLLM.)")
    return pre_mm, dec_mm


def _intensity_grows_with_the_batch(lesson, llm, session, engine, roof) -> None:
    """Decode steps of each batch size in BATCHES, profiled: intensity, throughput and where it crosses the ridge."""
    sweep, rows = {}, []
    for b in BATCHES:
        ids = [f"b{b}-{i}" for i in range(b)]
        for i, rid in enumerate(ids):
            engine.add_request(rid, {"prompt_token_ids": [(5 * j + i) % 250 + 5 for j in range(8)]}, greedy(4))
        engine.step()  # their prefills, unprofiled
        step = median_step(profile_steps(llm, session, 2))
        mm = matmul_point(step)
        sweep[b] = mm
        per_token = sum(k["duration_ns"] for k in step) / b
        rows.append([b, f"{mm.intensity:.2f}", fmt_count(mm.flops_per_s, "FLOP/s"), f"{per_token / 1e3:.0f} µs",
                     mm.bound(roof)])
        while engine.has_unfinished_requests():
            engine.step()
    lesson.show(table(["decode batch", "matmul FLOP/byte", "achieved", "op time per request", "bound"], rows,
                      title="decode steps of growing batches, profiled"))
    growing = all(sweep[a].intensity < sweep[b].intensity for a, b in zip(BATCHES, BATCHES[1:]))
    lesson.check(growing, "decode's arithmetic intensity grows with the batch: "
                          + " < ".join(f"{sweep[b].intensity:.2f}" for b in BATCHES)
                          + f" FLOP/byte for {', '.join(map(str, BATCHES))} requests (the weights are read once "
                            "per step, whatever the batch)")
    crossed = next((b for b in BATCHES if sweep[b].intensity >= roof.ridge), None)
    lesson.say("Up to the ridge point, a bigger batch costs little more time per step: the weights are read once "
               "and the extra requests ride along, so the time per request falls. "
               + (f"From {crossed} requests on, decode's matmuls pass this machine's ridge point "
                  f"({roof.ridge:.1f} FLOP/byte) and become compute-bound: more requests now cost arithmetic, "
                  "and batching stops being free." if crossed else
                  f"Even {BATCHES[-1]} requests stay under this machine's ridge point ({roof.ridge:.1f} FLOP/byte): "
                  "decode remains memory-bound at every batch size tried."))


def _lm_head_is_large_for_a_tiny_model(lesson, prefill, decode, cfg) -> None:
    """The share of attention, MLP and LM head in both steps, and why the LM head weighs so much here."""
    share_pre, share_dec = shares(prefill), shares(decode)
    groups = [*GROUPS, "other (embedding, norms, sampler)"]
    lesson.show(table(["part of the model", "prefill", "decode"],
                      [[g, f"{share_pre.get(g, 0):.0%}", f"{share_dec.get(g, 0):.0%}"] for g in groups],
                      title=f"share of the profiled time (decode: each op's median over {DECODE_STEPS} steps)"))
    lm_bytes = sum(k["bytes"] for k in decode if k["name"] == "lm_head")
    mm_bytes = sum(k["bytes"] for k in decode if k.get("op") == "matmul")
    lm_share, d, vocab = share_dec.get("LM head", 0.0), cfg.hidden_size, cfg.vocab_size
    lesson.say(f"**Why the LM head is large for a tiny model.** It multiplies each request's last hidden state "
               f"({d} wide) by the whole vocabulary's {vocab:,} × {d} embedding matrix: {fmt_count(lm_bytes, 'B')} "
               f"moved, {lm_bytes / mm_bytes:.0%} of all the bytes the decode step's matmuls move, while each of the "
               f"{cfg.n_layer} layers' matrices is {d} × {3 * d}, {d} × {d}, {d} × {4 * d} or {4 * d} × {d} "
               f"({12 * d * d:,} weights a layer against the head's {vocab * d:,}). In a decode step, where time "
               f"follows bytes, the LM head took **{lm_share:.0%}** of the profiled time. In a 7B model the same "
               "head (32,000 × 4,096) is 2% of the weights: the vocabulary is fixed by the tokenizer while the "
               "layers grow with the model.")
    layer_mlp = share_dec.get("MLP", 0.0) / cfg.n_layer
    lesson.check(lm_share > layer_mlp and lm_bytes / mm_bytes > 0.3,
                 f"the LM head alone takes {lm_share:.0%} of a decode step's profiled time, more than a whole "
                 f"layer's MLP ({layer_mlp:.0%}), for {lm_bytes / mm_bytes:.0%} of its matmul bytes")


def _both_steps_on_the_roofline(lesson, core, prefill, decode, roof, pre_mm, dec_mm) -> None:
    """Each op kind of both steps on the chart; decode under the memory roof, prefill (on a CPU) above the ridge."""
    lesson.say("Which phase is memory-bound is easy to get backwards (notes on LLM serving sometimes swap "
               "them), so measure it: each op kind of both steps on this machine's roofline, prefill in "
               "capitals, decode in small letters (M matmul, A attention, N norm, E elementwise, S sampler).")
    lesson.show(Text.from_ansi(chart(prefill, decode, roof, min(100, lesson.console.width - 6))),
                title="this machine's roofline")
    lesson.check(dec_mm.intensity < roof.ridge,
                 f"decode is memory-bound: its matmuls' {dec_mm.intensity:.2f} FLOP/byte is below the ridge point "
                 f"({roof.ridge:.1f}); at {fmt_count(dec_mm.bytes_per_s, 'B/s')} they are limited by how fast the "
                 "weights stream in, not by arithmetic")
    if core.device.type != "cuda":
        lesson.check(pre_mm.intensity > roof.ridge,
                     f"prefill is compute-bound: its matmuls' {pre_mm.intensity:.1f} FLOP/byte is above the ridge "
                     f"point ({roof.ridge:.1f}); it achieved {fmt_count(pre_mm.flops_per_s, 'FLOP/s')} of the "
                     f"{fmt_count(roof.peak_flops, 'FLOP/s')} peak")
    else:
        lesson.say(f"On this GPU the ridge point ({roof.ridge:.0f} FLOP/byte) is beyond what a 128-wide model can "
                   f"reach: even prefill's matmuls ({pre_mm.intensity:.1f} FLOP/byte) sit under the memory roof. "
                   "A matmul of K×N weights cannot exceed K·N / (2(K+N)·bytes per value) FLOP/byte, however many "
                   "tokens; models thousands wide clear it.")


def chart(prefill: list[dict], decode: list[dict], roof, width: int) -> str:
    """The roofline with both steps' op kinds, as the Kernels panel draws it (plotext)."""
    from textual_plotext.plot import Plot

    from tracer.tui.widgets.roofline import plot_roofline
    plt = Plot()
    plot_roofline(plt, [("prefill", by_kind(profiled_ops(prefill))), ("decode", by_kind(profiled_ops(decode)))], roof,
                  legend=False)
    plt.plotsize(width, 22)  # (after the drawing: clearing the figure resets its size)
    plt.theme("clear")
    return plt.build()


if __name__ == "__main__":
    sys.exit(main(globals()))
