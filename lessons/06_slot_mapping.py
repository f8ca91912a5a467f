"""Lesson 6: slot mapping and the flattened batch of a mixed step."""
import itertools
import pathlib
import sys
from dataclasses import dataclass

from rich.markup import escape

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

import kernels
from engine.core.block_pool import NULL_BLOCK_ID
from engine.hooks import SNAPSHOT
from engine.worker.input_batch import INPUT_KERNELS
from kernels import instrument
from lessons.cli import main
from lessons.framework import events_of, greedy, queue_request, queues, table

TITLE = "Slot mapping and the flattened batch"
SUMMARY = "input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables of one mixed step."
BLOCK = 16
BUDGET = 64  # max_num_batched_tokens: small, so prompts are chunked


WRITES = {"prepare_prefill_inputs": "input_ids", "prepare_pos_seq_lens": "positions, seq_lens",
          "gather_block_tables": "block_tables", "compute_slot_mappings": "slot_mapping"}


def capture_inputs(engine) -> tuple[list, list]:
    """Keep each step's InputBatch (the real arrays the model's tensors are made of), and the
    arguments of each step's slot-mapping launch."""
    seen, slot_launches = [], []
    runner = engine.engine_core.engine_core.model_runner
    prepare, launch = runner.prepare_inputs, runner.input_kernels.compute_slot_mappings

    def kept(sched):
        inp = prepare(sched)
        seen.append((sched, inp))
        return inp

    def compute_slot_mappings(**args):
        launch(**args)
        slot_launches.append({k: v.clone() if hasattr(v, "clone") else v for k, v in args.items()})

    runner.prepare_inputs = kept
    runner.input_kernels.compute_slot_mappings = compute_slot_mappings
    return seen, slot_launches


@dataclass
class FlatBatch:
    """The mixed step's arrays as lists, and the requests they belong to."""
    ids: list[int]
    pos: list[int]
    slots: list[int]
    qsl: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    reqs: list
    scheduled: list  # (request, first position this step, tokens this step)


def run(lesson) -> None:
    lesson.intro(
        "A step's batch is not a padded matrix of requests: all scheduled tokens of all requests are "
        "**concatenated** into one flat list, and a few small arrays say where each request's tokens "
        "start, where each token sits in its sequence, and in which cache **slot** its key and value go. "
        "You will build a step that mixes a decode, the last chunk of a long prompt and the first chunk "
        "of a new one, and read every array of it.")
    llm, session = lesson.engine(block_size=BLOCK, num_kv_blocks=32, max_num_batched_tokens=BUDGET,
                                 enable_prefix_caching=False)
    engine = llm.llm_engine
    inputs, slot_launches = capture_inputs(engine)
    a, b, c = _a_decodes_while_b_is_chunked(lesson, llm, engine)
    lesson.pause()

    engine.step()  # step 2: the mixed step
    sched, inp = inputs[-1]
    ev, kinds = _one_step_mixes_decode_and_prefills(lesson, session)
    batch = _flatten(engine, sched, inp)
    _show_the_flattened_batch(lesson, batch)
    _each_array_explained(lesson, batch, kinds)
    lesson.pause()

    _predict_a_slot(lesson, batch)
    lesson.check(ev.get("input_ids") == batch.ids and ev.get("slot_mapping") == batch.slots
                 and ev.get("query_start_loc") == batch.qsl,
                 "the traced batch event shows exactly the tensors the model received")
    show_input_kernels(lesson, session, ev.step, slot_launches[-1], batch.slots, len(batch.reqs))
    _keys_went_to_the_mapped_slots(lesson, engine, inputs)
    _only_each_requests_last_row_samples(lesson, inp, batch.qsl, a, b, c)
    lesson.done(
        "One step = one flat batch. `query_start_loc` cuts it into requests, `positions` place each token "
        "in its sequence, `seq_lens` say how much context each request attends over, and `slot_mapping` = "
        "block_table[pos // block_size] × block_size + pos % block_size says where each new key and value "
        "are written. Decodes, prompt chunks and new prompts all share the same arrays.")


def _a_decodes_while_b_is_chunked(lesson, llm, engine) -> tuple:
    """Steps 0 and 1: A's prefill, then A decodes while B's prompt is chunked; C arrives."""
    a = queue_request(engine, "A", {"prompt_token_ids": list(range(1, 21))}, greedy(8))
    engine.step()  # step 0: A's 20-token prefill
    b = queue_request(engine, "B", {"prompt_token_ids": [(3 * i) % 250 for i in range(100)]}, greedy(4))
    engine.step()  # step 1: A decodes; B gets the other 63 tokens of the budget (a chunk)
    c = queue_request(engine, "C", {"prompt_token_ids": [(7 * i + 1) % 250 for i in range(40)]}, greedy(4))
    lesson.say(
        f"Token budget {BUDGET} per step, blocks of {BLOCK}. **A** (20-token prompt) is decoding. **B** "
        f"(100 tokens) got {b.num_computed_tokens} tokens last step: its prefill was chunked. **C** "
        "(40 tokens) just arrived. The scheduler serves running requests first, then admits waiting ones "
        "into what is left of the budget.")
    lesson.show(queues(llm))
    lesson.check(b.num_computed_tokens == BUDGET - 1, f"B's first chunk was {BUDGET - 1} tokens (budget − A's 1)")
    return a, b, c


def _one_step_mixes_decode_and_prefills(lesson, session) -> tuple:
    """What the scheduler put in the mixed step: the traced batch event, and (id, kind, before, tokens) each."""
    ev = [e for e in events_of(session) if e.layer == "model_runner" and e.name == "batch"][-1]
    snap = [e for e in events_of(session)
            if e.layer == "scheduler" and e.name == "schedule" and e.kind == SNAPSHOT and e.step == ev.step][-1]
    kinds = [(s["request_id"], s["kind"], s["num_computed_before"], s["num_tokens"]) for s in snap.get("scheduled")]
    lesson.show(table(["request", "kind", "computed before", "tokens this step"], kinds,
                      title=f"step {ev.step}: what the scheduler scheduled"))
    lesson.check([k[:2] for k in kinds] == [("A", "decode"), ("B", "prefill"), ("C", "prefill")],
                 "one step holds A's decode, B's prefill and C's prefill: no separate prefill and decode phases")
    lesson.check(kinds[0][3] == 1 and kinds[1][2] == BUDGET - 1 and kinds[1][2] + kinds[1][3] == 100
                 and kinds[2][2] == 0 and kinds[2][3] < 40,
                 "A: 1 token; B: its last chunk (63 → 100); C: a first chunk of its 40 tokens")
    lesson.check(sum(k[3] for k in kinds) == BUDGET, f"the three fill the budget of {BUDGET} tokens exactly")
    return ev, kinds


def _flatten(engine, sched, inp) -> FlatBatch:
    ids, pos = inp.input_ids.tolist(), inp.positions.tolist()
    slots, qsl = inp.slot_mapping.tolist(), inp.query_start_loc.tolist()
    seq_lens, tables = inp.seq_lens.tolist(), inp.block_tables.tolist()
    reqs = [engine.engine_core.engine_core.requests[rid] for rid in sched.req_ids]
    starts = sched.num_computed_before()  # the SchedulerOutput says where each request's tokens start
    scheduled = [(r, starts[r.request_id], sched.num_scheduled_tokens[r.request_id]) for r in reqs]
    return FlatBatch(ids, pos, slots, qsl, seq_lens, tables, reqs, scheduled)


def _show_the_flattened_batch(lesson, batch: FlatBatch) -> None:
    ids, pos, slots, qsl, seq_lens, tables, reqs = (batch.ids, batch.pos, batch.slots, batch.qsl, batch.seq_lens,
                                                    batch.tables, batch.reqs)
    lesson.show(table(["request", "rows (query_start_loc)", "positions", "seq_len", "block_tables row", "slots"], [
        [r.request_id, f"{qsl[i]} … {qsl[i + 1] - 1}", f"{pos[qsl[i]]} … {pos[qsl[i + 1] - 1]}", seq_lens[i],
         tables[i], f"{slots[qsl[i]]} … {slots[qsl[i + 1] - 1]}"] for i, r in enumerate(reqs)],
        title=f"the flattened batch: {len(ids)} tokens, {len(reqs)} requests"))
    picks = sorted({0, 1, 2, qsl[2] - 1, qsl[2], qsl[3] - 1})
    lesson.show(table(["row", "request", "input_id", "position", "pos // 16", "pos % 16", "slot"], [
        [i, reqs[next(r for r in range(3) if qsl[r] <= i < qsl[r + 1])].request_id, ids[i], pos[i],
         pos[i] // BLOCK, pos[i] % BLOCK, slots[i]] for i in picks], title="some rows, one per token"))


def _each_array_explained(lesson, batch: FlatBatch, kinds: list) -> None:
    """query_start_loc, positions, seq_lens, input_ids and block_tables, checked against the requests."""
    ids, pos, qsl, seq_lens, tables, reqs = batch.ids, batch.pos, batch.qsl, batch.seq_lens, batch.tables, batch.reqs
    scheduled = batch.scheduled
    lesson.check(qsl == [0] + list(itertools.accumulate(k[3] for k in kinds)),
                 f"query_start_loc {qsl} is the running sum of tokens scheduled per request")
    lesson.check(pos == [p for _, start, n in scheduled for p in range(start, start + n)],
                 "positions continue where each request left off (A at its decode position, B at 63, C at 0)")
    lesson.check(seq_lens == [start + n for _, start, n in scheduled],
                 "seq_lens = tokens already cached + tokens this step: how far each request's attention reaches")
    lesson.check(ids == [t for r, start, n in scheduled for t in r.all_token_ids[start:start + n]],
                 "input_ids are those positions' tokens (A's is the token it sampled last step)")
    width = max(len(r.block_ids) for r in reqs)
    lesson.check(all(row == r.block_ids + [NULL_BLOCK_ID] * (width - len(r.block_ids)) for row, r in zip(tables, reqs)),
                 f"block_tables is each request's block table, padded with 0 to the widest ({width} entries)")
    lesson.say(
        "The padding is block 0, the **null block**: as in vLLM V1, the block pool takes it out of the "
        "free queue at startup and never gives it to a request, so a padded entry can never be mistaken "
        "for a real block of someone's data. The kernels stop at `seq_lens` anyway; the null block makes "
        "a stray read harmless rather than a silent read of another request's keys.")
    lesson.check(all(NULL_BLOCK_ID not in r.block_ids for r in reqs),
                 "no request's real block table contains block 0: every 0 in block_tables is padding")


def _predict_a_slot(lesson, batch: FlatBatch) -> None:
    """slot = block_table[pos // 16] × 16 + pos % 16: one of B's tokens by hand, then every token."""
    pos, slots, qsl, tables, reqs = batch.pos, batch.slots, batch.qsl, batch.tables, batch.reqs
    row = qsl[1] + 17  # one of B's tokens
    p, tb = pos[row], tables[1]
    lesson.predict(escape(
        f"Row {row} of the batch is B's token at position {p}. B's block table is {tb}. "
        "In which slot of the KV cache does its key go? (slot = block_table[pos // 16] × 16 + pos % 16)"),
        f"block_table[{p} // 16] = block_table[{p // BLOCK}] = {tb[p // BLOCK]}; "
        f"{tb[p // BLOCK]} × 16 + {p % BLOCK} = {tb[p // BLOCK] * BLOCK + p % BLOCK}.")
    lesson.check(slots[row] == tb[p // BLOCK] * BLOCK + p % BLOCK, f"slot_mapping[{row}] = {slots[row]}")
    lesson.check(all(s == tables[r][q // BLOCK] * BLOCK + q % BLOCK
                     for r in range(len(reqs)) for s, q in zip(slots[qsl[r]:qsl[r + 1]], pos[qsl[r]:qsl[r + 1]])),
                 "every token's slot is block_table[pos // 16] × 16 + pos % 16 of its own request")
    lesson.check(len(set(slots)) == len(slots), "no two tokens share a slot")


def _keys_went_to_the_mapped_slots(lesson, engine, inputs: list) -> None:
    """Where did the keys really go? Layer 0's key cache has data in exactly the slots mapped so far."""
    written = {s for _, i in inputs for s in i.slot_mapping.tolist()}
    k0 = engine.engine_core.engine_core.kv_caches[0][0]
    filled = set(k0.reshape(-1, k0.shape[2] * k0.shape[3]).abs().sum(1).nonzero().flatten().tolist())
    lesson.check(filled == written,
                 f"layer 0's key cache holds data in exactly the {len(written)} slots the slot mappings named")


def _only_each_requests_last_row_samples(lesson, inp, qsl: list[int], a, b, c) -> None:
    lesson.say(
        "After the step, A and B sample a token, while C's sampled token is thrown away: C's prompt is "
        "not finished, and only a request's last prompt position predicts its next token. The model "
        "computes logits for one row per request, at query_start_loc[i+1] − 1.")
    lesson.check(inp.logits_indices.tolist() == [q - 1 for q in qsl[1:]],
                 f"logits rows {inp.logits_indices.tolist()}: each request's last row")
    lesson.check(a.num_output_tokens == 3 and b.num_output_tokens == 1 and c.num_output_tokens == 0,
                 "A has 3 output tokens, B its first, C none yet")


def show_input_kernels(lesson, session, step: int, args: dict, slots: list[int], num_reqs: int) -> None:
    """The launches that built the step's arrays, and the slot-mapping kernel on the step's own arguments."""
    lesson.say(
        "**Who builds these arrays.** The model runner keeps every request's tokens, computed-token count and "
        "block table in buffers indexed by the request's **slot**; `idx_mapping` says which slot each batch row "
        "is. Four small kernels gather the step's arrays from those buffers, as vLLM's Model Runner V2 does "
        "(`vllm/v1/worker/gpu/input_batch.py`, `block_table.py`). On the CPU the engine runs their PyTorch "
        "references (`<kernel>_ref`: no grid, PyTorch picks); with the Triton backend, the kernels.")
    launches = [e for e in events_of(session) if e.layer == "kernel" and e.step == step
                and e.attrs.get("layer_idx") is None][:4]
    names = [e.name.removesuffix("_ref") for e in launches]
    lesson.show(table(["#", "launch", "writes"], [[i, e.name, WRITES.get(n, "?")] for i, (e, n) in
                                                 enumerate(zip(launches, names))],
                      title=f"step {step}: the launches before the first layer's"))
    lesson.check(names == list(INPUT_KERNELS[:4]),
                 "the step's inputs are built by four launches, before any layer runs: input ids, positions and "
                 "seq_lens, block tables, slot mapping")
    records = []
    out = args["slot_mapping"].clone().fill_(0)
    with instrument.observe(records.append):  # the Triton kernel on the step's own arguments
        kernels.compute_slot_mappings(**{**args, "slot_mapping": out})
    rec = records[0]
    meta = ", ".join(f"{k}={v}" for k, v in rec.meta.items())
    lesson.show(table(["kernel", "grid", "meta", "why this grid"], [[rec.name, rec.grid, meta, rec.reason]],
                      title="_compute_slot_mappings_kernel on this step's idx_mapping, positions and block tables"))
    lesson.check(rec.grid == (num_reqs + 1,),
                 f"its grid is ({num_reqs + 1},): one program per request, each walking its own tokens through its "
                 "own block-table row, plus one that pads the rest of slot_mapping with -1")
    lesson.check(out.tolist() == slots, "the Triton kernel writes exactly the slots the engine's step used")


if __name__ == "__main__":
    sys.exit(main(globals()))
