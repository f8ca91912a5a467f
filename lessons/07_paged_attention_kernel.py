"""Lesson 7: the paged-attention kernel — launch grid, one program, block tables, online softmax."""
import pathlib
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

import kernels
from kernels import instrument
from lessons.cli import main
from lessons.framework import greedy, queue_request, table

TITLE = "The paged-attention kernel"
SUMMARY = "Run the Triton unified-attention kernel on a real batch: grid, one program's work, online softmax."
BLOCK = 16
GPU_SMS = 132  # an H100, for the GPU-style launch configuration


@dataclass
class Step:
    """Layer 0's attention inputs and output in the step we study, as the engine's backend received them."""
    q: torch.Tensor
    meta: object
    scale: float
    out: torch.Tensor  # the engine's own attention output
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    qsl: list[int]
    seq_lens: list[int]
    tables: list[list[int]]

    @property
    def num_heads(self) -> int:
        return self.q.shape[1]

    @property
    def head_size(self) -> int:
        return self.q.shape[2]

    def unified_attention(self, **kwargs) -> torch.Tensor:
        """The Triton kernel on this step's inputs."""
        meta = self.meta
        return kernels.unified_attention(self.q, self.key_cache, self.value_cache, meta.query_start_loc,
                                         meta.seq_lens, meta.block_tables, self.scale,
                                         max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, **kwargs)


def run(lesson) -> None:
    lesson.intro(
        "In vLLM's Triton attention backend (and FlashAttention's varlen call), attention is one kernel, "
        "`unified_attention`, for prefill, decode and mixed batches alike. Not every backend works so: "
        "FlashInfer and the MLA backends run prefill and decode tokens through separate kernels, and in all "
        "of them writing the step's new keys and values into the cache is a kernel of its own "
        "(`reshape_and_cache`), launched before attention. "
        "Each query token attends over its request's whole context, whose keys and values "
        "sit in scattered cache blocks found through the **block table**. You will take a real step's "
        "batch and KV cache from the engine, run our Triton kernel on it ("
        + ("through Triton's interpreter: there is no GPU here" if kernels.INTERPRETED else "compiled for this GPU")
        + "), read its launch grid and what each program touches, work one row's "
        "**online softmax** by hand, and compare the kernel with the PyTorch reference.")
    core, a, st = _capture_a_mixed_step(lesson)
    _show_the_kernels_inputs(lesson, core, a, st)
    lesson.pause()

    # ---- the launch, GPU-style ----
    out_gpu, rec = _launch_gpu_style(lesson, st)
    access = _predict_the_programs(lesson, st, rec)
    lesson.pause()

    # ---- one program, step by step: the online softmax ----
    _online_softmax_by_hand(lesson, st, out_gpu, rec.meta["TILE_N"])
    lesson.pause()

    # ---- the interpreter's own launch, and the comparison ----
    _compare_with_the_reference(lesson, st, out_gpu, access)
    _two_kernels_per_layer(lesson, core.model_config.n_layer)
    lesson.say(
        "In the engine, `attention_backend='triton'` runs this kernel (the default on CUDA); on the CPU "
        "the engine uses the PyTorch reference, because the interpreter is slow. In vLLM, attention on "
        "NVIDIA GPUs usually runs FlashAttention (CUDA kernels); vLLM's Triton attention backend, "
        "whose unified kernel this one follows, sits beside it.")
    lesson.done(
        "The kernel's grid is (query blocks, KV heads[, KV segments]). Each program takes a few query "
        "tokens of one request and one KV head, walks that request's block table tile by tile, gathers "
        "keys and values from wherever the blocks are, and keeps one online softmax (running max, "
        "running sum, rescaled accumulator) over the whole context. The result equals plain softmax "
        "attention, which the reference computes directly.")


def _capture_a_mixed_step(lesson) -> tuple:
    """Three engine steps (A decodes, B decodes, C prefills in the last), keeping layer 0's attention inputs."""
    llm, _ = lesson.engine(block_size=BLOCK, num_kv_blocks=32, enable_prefix_caching=False)
    engine = llm.llm_engine
    captured = {}
    forward = engine.engine_core.engine_core.model.backend.forward
    layer0 = engine.engine_core.engine_core.kv_caches[0][0]

    def keep_layer0(q, k, v, key_cache, value_cache, meta, scale):
        out = forward(q, k, v, key_cache, value_cache, meta, scale)
        if key_cache is layer0:
            captured.update(q=q.clone(), meta=meta, scale=scale, out=out.clone())
        return out

    core = engine.engine_core.engine_core  # the EngineCore behind the InprocClient
    core.model.backend.forward = keep_layer0  # the engine's own attention (the PyTorch reference on CPU)
    a = queue_request(engine, "A", {"prompt_token_ids": list(range(47))}, greedy(8))
    engine.step()  # A's prefill: positions 0-46 in blocks 1, 2, 3 (block 0 is the null block)
    engine.add_request("B", {"prompt_token_ids": list(range(100, 120))}, greedy(8))
    engine.step()  # A decodes position 47 (its 3rd block is now full); B's prefill takes blocks 4, 5
    engine.add_request("C", {"prompt_token_ids": list(range(50, 74))}, greedy(8))
    engine.step()  # the step we study: A decodes position 48 (a new block), B decodes, C prefills
    meta = captured["meta"]
    key_cache, value_cache = core.kv_caches[0]
    st = Step(captured["q"], meta, captured["scale"], captured["out"], key_cache, value_cache,
              meta.query_start_loc.tolist(), meta.seq_lens.tolist(), meta.block_tables.tolist())
    return core, a, st


def _show_the_kernels_inputs(lesson, core, a, st: Step) -> None:
    qsl, seq_lens, tables = st.qsl, st.seq_lens, st.tables
    num_tokens, num_heads, head_size = st.q.shape
    lesson.show(table(["request", "query rows", "new tokens", "seq_len", "block table"], [
        [r, f"{qsl[i]}–{qsl[i + 1] - 1}", qsl[i + 1] - qsl[i], seq_lens[i], tables[i]]
        for i, r in enumerate("ABC")], title=f"step {core.step_count - 1}, "
        "layer 0: the kernel's inputs"))
    lesson.say(
        f"The query is `[{num_tokens} tokens, {num_heads} heads, {head_size}]`; the layer's key and value "
        f"caches are `{list(st.key_cache.shape)}` = [blocks, slots per block, heads, head_size]. A crossed into "
        f"a fourth logical block this step and got physical block {a.block_ids[3]} — its table is not "
        "contiguous. (Block 0 is the null block, never a request's.)")
    lesson.check(tables[0] == a.block_ids == [1, 2, 3, 6], "A's block table is [1, 2, 3, 6]")
    lesson.check(qsl == [0, 1, 2, 26] and seq_lens == [49, 21, 24],
                 "A and B bring one query token each, C 24; they attend over 49, 21 and 24 keys")


def _launch_gpu_style(lesson, st: Step) -> tuple:
    """The launch a GPU would get, run here; returns its output and its launch record."""
    gpu_cfg, gpu_reason = kernels.choose_config(**_launch_shape(st), target="cuda", num_sms=GPU_SMS)
    lesson.say(
        "First the launch a GPU would get (`choose_config(target='cuda')`), run here on the interpreter. "
        "Grid axis 0 = **query blocks** (up to BLOCK_Q consecutive query tokens of one request), "
        "axis 1 = **KV heads**, axis 2 = KV segments (split-KV, only for decode-only batches).")
    records = []
    with instrument.observe(records.append):
        out_gpu = st.unified_attention(config=gpu_cfg)
    rec = records[0]
    m = rec.meta
    lesson.show(table(["", ""], [["kernel", rec.name], ["grid", rec.grid],
                                 ["BLOCK_Q / TILE_N / BLOCK_SIZE",
                                  f"{m['BLOCK_Q']} / {m['TILE_N']} / {m['BLOCK_SIZE']}"],
                                 ["HEADS_PER_PROG", m["HEADS_PER_PROG"]], ["why", gpu_reason],
                                 ["interpreted launch took", f"{rec.duration_ns / 1e6:.0f} ms ({rec.timing})"]],
                      title="launch record"))
    return out_gpu, rec


def _launch_shape(st: Step) -> dict:
    meta = st.meta
    return dict(num_tokens=st.q.shape[0], num_seqs=len(st.seq_lens), num_q_heads=st.num_heads,
                num_kv_heads=st.key_cache.shape[2], head_size=st.head_size, block_size=BLOCK,
                max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len)


def _predict_the_programs(lesson, st: Step, rec) -> dict:
    """How many programs, and which blocks each reads: the launch's access map. Returns it."""
    qsl, seq_lens, tables, m = st.qsl, st.seq_lens, st.tables, rec.meta
    num_kv_heads = _launch_shape(st)["num_kv_heads"]
    qb = [-(-(qsl[i + 1] - qsl[i]) // m["BLOCK_Q"]) for i in range(len(seq_lens))]
    lesson.predict(
        f"BLOCK_Q = {m['BLOCK_Q']}, {num_kv_heads} KV heads. How many query blocks does each request "
        "need, how many programs run, and which physical blocks does the program for A, head 2 read?",
        f"A {qb[0]}, B {qb[1]}, C {qb[2]} (24 tokens → 16 + 8): {sum(qb)} query blocks × "
        f"{num_kv_heads} heads = {sum(qb) * num_kv_heads} programs. A's program walks "
        "A's block table: physical blocks 1, 2, 3, 6.")
    access = rec.access_map
    lesson.show(table(["program (x, y, z)", "request", "query rows", "KV head", "key positions", "physical blocks"], [
        [pid, "ABC"[w.request], f"{w.rows[0]}–{w.rows[1] - 1}", w.kv_heads,
         f"{w.kv_positions[0]}–{w.kv_positions[1] - 1}", w.blocks]
        for pid, works in sorted(access.items()) if pid[1] in (0, 2) for w in works],
        title="access map (heads 0 and 2 shown): what each program touches"))
    lesson.check(rec.grid == (sum(qb), num_kv_heads, 1) and len(access) == sum(qb) * num_kv_heads,
                 f"grid {rec.grid}: one program per (query block, KV head), {len(access)} programs")
    a_prog = access[(0, 2, 0)][0]
    lesson.check(a_prog.request == 0 and a_prog.blocks == (1, 2, 3, 6) and a_prog.kv_positions == (0, 49),
                 "program (0, 2, 0) handles A, head 2: keys 0–48 from physical blocks 1, 2, 3, 6")
    lesson.check(all(w.blocks == tuple(tables[w.request][:-(-w.kv_positions[1] // BLOCK)])
                     for works in access.values() for w in works),
                 "every program reads exactly its request's blocks, in block-table order")
    rows = sorted(r for pid, works in access.items() if pid[1] == 0 for w in works for r in range(*w.rows))
    lesson.check(rows == list(range(st.q.shape[0])), "for each head, the programs cover every query row once")
    return access


def _online_softmax_by_hand(lesson, st: Step, out_gpu: torch.Tensor, tile_n: int) -> None:
    """One program's loop for one query row and head, a block per tile, checked against plain softmax."""
    _what_one_program_does(lesson, tile_n)
    # Pick a query row and head whose running max grows after the first tile, so the rescaling shows.
    qsl, seq_lens, tables = st.qsl, st.seq_lens, st.tables
    row, h, req_i = max(((r, hh, i) for i in range(len(seq_lens)) for r in range(qsl[i], qsl[i + 1])
                         for hh in range(st.num_heads)),
                        key=lambda c: max_increases(*gather(c, st.q, st.key_cache, st.value_cache, qsl, seq_lens,
                                                            tables, st.scale)[:1]))
    s_all, v, phys = gather((row, h, req_i), st.q, st.key_cache, st.value_cache, qsl, seq_lens, tables, st.scale)
    m_run, l_run, acc, steps, grew = _fold_tile_by_tile(s_all, v, phys, st.head_size)
    lesson.show(table(["tile", "physical block", "keys", "tile max", "running max m", "rescale exp(m_old − m)",
                       "running sum l"], steps,
                      title=f"online softmax for request {'ABC'[req_i]}'s query row {row}, head {h}, tile by tile"))
    online = acc / l_run
    exact = torch.softmax(s_all, 0) @ v
    lesson.check(grew > 0, f"the running max grew in {grew} later tile(s): sum and accumulator were rescaled")
    lesson.check(torch.allclose(online, exact, atol=1e-5),
                 "acc / l after the last tile equals softmax(all scores) · V (to 1e-5)")
    lesson.check(abs(float(l_run) - float(torch.exp(s_all.double() - float(m_run)).sum())) < 1e-4 * float(l_run),
                 "l is the sum of exp(score − final max) over all keys: rescaling lost nothing")
    if float(s_all.max()) > 88.7:  # exp overflows float32 above ~88.7
        lesson.say(f"Scores reach {s_all.max():.1f} here (this untrained model's attention is very peaked): "
                   f"exp({s_all.max():.1f}) overflows float32. Subtracting the running max is what keeps "
                   "every exp in range.")
        lesson.check(bool(torch.isinf(torch.exp(s_all)).any()), "exp of the raw scores overflows to inf in float32")
    per_block = torch.cat([torch.softmax(s_all[t:t + BLOCK], 0) for t in range(0, len(s_all), BLOCK)])
    wrong = per_block @ v
    lesson.check(abs(float(per_block.sum()) - len(steps)) < 1e-4 and (wrong - exact).abs().max() > 1e-2,
                 f"softmaxing each block on its own is wrong: its weights sum to {per_block.sum():.0f}, not 1")
    lesson.check((out_gpu[row, h].float() - exact).abs().max() < 1e-4,
                 "the kernel's output for this row and head is the same")
    _same_with_the_launchs_tile(lesson, s_all, v, exact, tile_n, st.head_size)


def _what_one_program_does(lesson, tile_n: int) -> None:
    lesson.say(
        "**What one program does.** It loads its query rows once, then loops over the context one tile "
        "of TILE_N keys at a time. For each key position p: physical block = block_table[p // 16], slot "
        "in block = p % 16; load K and V there, score s = q·k × scale, mask keys after the query's own "
        "position (causal), and fold the scores into an **online softmax**: a running max *m*, a running "
        "sum *l* of exp(s − m), and a running weighted sum of values *acc*, rescaled by exp(m_old − m_new) "
        "whenever the max grows. At the end, out = acc / l. That is one softmax over the **whole** "
        "sequence, computed in pieces — no block is ever normalised on its own.\n\n"
        f"By hand we use tiles of {BLOCK} keys (one block), so this row's keys make several tiles and the "
        f"rescaling shows. The launch above uses TILE_N = {tile_n}: each iteration folds "
        f"{tile_n} keys ({tile_n // BLOCK} blocks) at once, so fewer rescales. The tile size "
        "changes how the work is cut, not the answer — checked below.")


def _fold_tile_by_tile(s_all: torch.Tensor, v: torch.Tensor, phys: torch.Tensor, head_size: int) -> tuple:
    """The online softmax with one block per tile: (running max, running sum, accumulator, table rows, how many
    later tiles raised the max)."""
    n_keys = len(s_all)
    m_run, l_run, acc = torch.tensor(float("-inf")), torch.tensor(0.0), torch.zeros(head_size)
    steps, grew = [], 0
    for t in range(0, n_keys, BLOCK):  # a tile of 16 keys = one block, for the example
        s = s_all[t:t + BLOCK]
        m_new = torch.maximum(m_run, s.max())
        alpha = torch.exp(m_run - m_new)
        p = torch.exp(s - m_new)
        l_run = l_run * alpha + p.sum()
        acc = acc * alpha + p @ v[t:t + BLOCK]
        grew += bool(t > 0 and m_new > m_run)
        steps.append([t // BLOCK, int(phys[t]), f"{t}–{min(t + BLOCK, n_keys) - 1}", f"{s.max():.3f}",
                      f"{m_new:.3f}", "—" if t == 0 else f"{alpha:.3g}", f"{l_run:.4f}"])
        m_run = m_new
    return m_run, l_run, acc, steps, grew


def _same_with_the_launchs_tile(lesson, s_all: torch.Tensor, v: torch.Tensor, exact: torch.Tensor, tile: int,
                                head_size: int) -> None:
    """The online softmax with the launch's TILE_N instead of one block per tile gives the same output."""
    n_keys = len(s_all)
    m2, l2, acc2 = torch.tensor(float("-inf")), torch.tensor(0.0), torch.zeros(head_size)
    for t in range(0, n_keys, tile):
        s = s_all[t:t + tile]
        m_new = torch.maximum(m2, s.max())
        alpha = torch.exp(m2 - m_new)
        p = torch.exp(s - m_new)
        l2, acc2, m2 = l2 * alpha + p.sum(), acc2 * alpha + p @ v[t:t + tile], m_new
    lesson.check(torch.allclose(acc2 / l2, exact, atol=1e-5),
                 f"with the launch's TILE_N = {tile} ({-(-n_keys // tile)} tile(s) for {n_keys} keys) the online "
                 "softmax gives the same output")


def _compare_with_the_reference(lesson, st: Step, out_gpu: torch.Tensor, access: dict) -> None:
    """The interpreter's own launch, and both launches against the PyTorch reference and the engine."""
    records = []
    with instrument.observe(records.append):
        out_cpu = st.unified_attention()
    cpu = records[0]
    lesson.say(
        f"Left to choose for itself on this machine, the kernel launches grid {cpu.grid}: {cpu.reason}. "
        "Same kernel, same semantics, a different split of the work.")
    meta = st.meta
    ref = kernels.unified_attention_ref(st.q, st.key_cache, st.value_cache, meta.query_start_loc, meta.seq_lens,
                                        meta.block_tables, st.scale)
    d_gpu, d_cpu = (out_gpu - ref).abs().max().item(), (out_cpu - ref).abs().max().item()
    d_engine = (ref - st.out).abs().max().item()
    lesson.show(table(["compared", "max |difference|"], [
        ["kernel (GPU-style grid) vs PyTorch reference", f"{d_gpu:.2e}"],
        [f"kernel (interpreter grid {cpu.grid}) vs PyTorch reference", f"{d_cpu:.2e}"],
        ["PyTorch reference vs the engine's own attention output", f"{d_engine:.2e}"]], title="outputs"))
    lesson.check(len(cpu.access_map) < len(access),
                 f"the interpreter runs {len(cpu.access_map)} fat programs instead of {len(access)}")
    lesson.check(d_gpu < 1e-3 and d_cpu < 1e-3, "both launches match the PyTorch reference (max abs diff < 1e-3)")
    lesson.check(d_engine < 1e-5, "and the reference reproduces what the engine computed in that step")


def _two_kernels_per_layer(lesson, n_layer: int) -> None:
    lesson.say(
        "**Two kernels per layer.** An engine on the Triton backend, one mixed step (a decode and a "
        "prefill): which kernels does each layer launch?")
    launches = triton_step_launches(lesson)
    lesson.show(table(["layer", "kernels launched, in order"],
                      [[layer, " → ".join(names)] for layer, names in sorted(launches.items())]))
    lesson.check(len(launches) == n_layer
                 and all(names == ["reshape_and_cache", "unified_attention"] for names in launches.values()),
                 "each layer writes the new K/V with reshape_and_cache, then runs ONE unified_attention "
                 "for the whole mixed batch")


def triton_step_launches(lesson) -> dict[int, list[str]]:
    """The kernels one mixed step (B decodes while C prefills) launches, per layer, on the Triton backend."""
    llm, _ = lesson.engine(block_size=BLOCK, num_kv_blocks=8, enable_prefix_caching=False, attention_backend="triton")
    engine = llm.llm_engine
    engine.add_request("B", list(range(1, 9)), greedy(4))
    engine.step()
    engine.add_request("C", list(range(20, 26)), greedy(4))
    records = []
    with instrument.observe(records.append):
        engine.step()  # B decodes, C prefills: one mixed batch
    out: dict[int, list[str]] = {}
    for r in records:
        if r.tags.get("layer") is not None:  # (the launches that build the step's inputs belong to no layer)
            out.setdefault(r.tags["layer"], []).append(r.name)
    return out


def gather(cand, q, key_cache, value_cache, qsl, seq_lens, tables, scale):
    """Scores and values of one query row and head over the keys it may see, gathered through its
    request's block table: (scores, values, physical block of each key)."""
    row, h, i = cand
    position = seq_lens[i] - (qsl[i + 1] - row)  # its absolute position: it sees keys 0 … position
    pos = torch.arange(position + 1)
    phys = torch.tensor(tables[i])[pos // BLOCK]
    k = key_cache[phys, pos % BLOCK, h].float()
    v = value_cache[phys, pos % BLOCK, h].float()
    return (k @ q[row, h].float()) * scale, v, phys


def max_increases(scores: torch.Tensor) -> int:
    """How many tiles after the first raise the running max."""
    tile_max = [float(scores[t:t + BLOCK].max()) for t in range(0, len(scores), BLOCK)]
    return sum(m > max(tile_max[:j]) for j, m in enumerate(tile_max) if j > 0)


if __name__ == "__main__":
    sys.exit(main(globals()))
