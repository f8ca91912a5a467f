"""The input-building kernels (kernels/input_batch.py, block_table.py) against their PyTorch
references on random small batches: requests with nothing computed yet, chunked prefills stopped
mid-prompt, decodes verifying drafts, padding rows; and every launch is traced with its grid."""
import pytest
import torch

import kernels
from kernels import instrument

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled there, interpreted here
BLOCK = 4  # KV-cache block size: positions cross blocks within a few tokens


def random_state(seed: int, max_num_reqs: int = 8, width: int = 40, max_blocks: int = 12):
    """Per-slot buffers as the worker keeps them, and a batch over some of the slots: for each
    row a kind (fresh prefill, chunk mid-prompt, decode, decode with drafts) and its query length."""
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    all_token_ids = torch.randint(1, 1000, (max_num_reqs, width), generator=g)
    num_tokens = torch.zeros(max_num_reqs, dtype=torch.int32)
    num_computed = torch.zeros(max_num_reqs, dtype=torch.int32)
    block_tables = torch.randint(1, 500, (max_num_reqs, max_blocks), generator=g, dtype=torch.int32)
    num_blocks = torch.zeros(max_num_reqs, dtype=torch.int32)
    slots = torch.randperm(max_num_reqs, generator=g)[:r(1, max_num_reqs + 1)]
    query_lens, drafts = [], []
    for i, s in enumerate(slots.tolist()):
        kind = ("fresh", "chunk", "decode", "drafts")[(seed + i) % 4]
        held = r(3, width - 8)
        d = r(1, 4) if kind == "drafts" else 0
        if kind == "fresh":
            computed, q = 0, held  # nothing computed yet: the whole prompt
        elif kind == "chunk":
            computed = r(1, held - 1)
            q = r(1, held - computed)  # stops before the prompt's end
        else:
            computed, q = held - 1, 1 + d  # the last sampled token, then the drafts
        num_tokens[s], num_computed[s] = held, computed
        num_blocks[s] = -(-(computed + q) // BLOCK)
        query_lens.append(q)
        drafts.append(torch.randint(1, 1000, (d,), generator=g).tolist())
    qsl = torch.zeros(len(slots) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    draft_tokens = torch.zeros(len(slots), max(1, max(map(len, drafts))), dtype=torch.int64)
    for i, d in enumerate(drafts):
        draft_tokens[i, :len(d)] = torch.tensor(d, dtype=torch.int64)
    return dict(all_token_ids=all_token_ids, num_tokens=num_tokens, num_computed=num_computed,
                block_tables=block_tables, num_blocks=num_blocks, idx_mapping=slots, query_start_loc=qsl,
                draft_tokens=draft_tokens, drafts=drafts)


def both(triton_fn, ref_fn, outputs: dict, **inputs):
    """Run the kernel and the reference on copies of the same outputs; return both results (on the CPU)."""
    got = {k: v.clone().to(DEVICE) for k, v in outputs.items()}
    want = {k: v.clone() for k, v in outputs.items()}
    triton_fn(**{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}, **got)
    ref_fn(**inputs, **want)
    return {k: v.cpu() for k, v in got.items()}, want


@pytest.mark.parametrize("seed", range(4))
def test_input_ids_positions_and_seq_lens_agree(seed):
    st = random_state(seed)
    n = int(st["query_start_loc"][-1])
    got, want = both(kernels.prepare_prefill_inputs, kernels.prepare_prefill_inputs_ref,
                     dict(input_ids=torch.full((n + 3,), -7)), idx_mapping=st["idx_mapping"],
                     query_start_loc=st["query_start_loc"], all_token_ids=st["all_token_ids"],
                     prefill_len=st["num_tokens"], num_computed_tokens=st["num_computed"],
                     draft_tokens=st["draft_tokens"])
    assert torch.equal(got["input_ids"], want["input_ids"])
    # by hand: each row's tokens from its slot's buffer, then its drafts
    expected = []
    for i, s in enumerate(st["idx_mapping"].tolist()):
        q = int(st["query_start_loc"][i + 1] - st["query_start_loc"][i])
        start, held = int(st["num_computed"][s]), int(st["num_tokens"][s])
        from_buffer = st["all_token_ids"][s, start:min(start + q, held)].tolist()
        expected += from_buffer + st["drafts"][i][:q - len(from_buffer)]
    assert want["input_ids"][:n].tolist() == expected and want["input_ids"][n:].tolist() == [-7] * 3

    got, want = both(kernels.prepare_pos_seq_lens, kernels.prepare_pos_seq_lens_ref,
                     dict(pos=torch.full((n,), -1, dtype=torch.int64),
                          seq_lens=torch.full((len(st["idx_mapping"]) + 2,), 99, dtype=torch.int32)),
                     idx_mapping=st["idx_mapping"], query_start_loc=st["query_start_loc"],
                     num_computed_tokens=st["num_computed"])
    assert torch.equal(got["pos"], want["pos"]) and torch.equal(got["seq_lens"], want["seq_lens"])
    starts = st["num_computed"][st["idx_mapping"]]
    lens = st["query_start_loc"][1:] - st["query_start_loc"][:-1]
    assert want["seq_lens"].tolist() == (starts + lens).tolist() + [0, 0]  # the padding rows get 0
    assert want["pos"].tolist() == [p for s, q in zip(starts.tolist(), lens.tolist()) for p in range(s, s + q)]


@pytest.mark.parametrize("seed", range(4))
def test_block_tables_and_slot_mappings_agree(seed):
    st = random_state(seed)
    idx, qsl = st["idx_mapping"], st["query_start_loc"]
    width = int(st["num_blocks"][idx].max())
    got, want = both(kernels.gather_block_tables, kernels.gather_block_tables_ref,
                     dict(out=torch.full((len(idx) + 2, width), -5, dtype=torch.int32)),
                     idx_mapping=idx, block_tables=st["block_tables"], num_blocks=st["num_blocks"])
    assert torch.equal(got["out"], want["out"])
    for i, s in enumerate(idx.tolist()):
        k = int(st["num_blocks"][s])
        assert want["out"][i].tolist() == st["block_tables"][s, :k].tolist() + [0] * (width - k)
    assert not want["out"][len(idx):].any()  # padding rows: the null block

    n = int(qsl[-1])
    pos = torch.cat([torch.arange(int(st["num_computed"][s]), int(st["num_computed"][s]) + int(qsl[i + 1] - qsl[i]))
                     for i, s in enumerate(idx.tolist())])
    got, want = both(kernels.compute_slot_mappings, kernels.compute_slot_mappings_ref,
                     dict(slot_mapping=torch.full((n + 5,), 12345, dtype=torch.int64)),
                     idx_mapping=idx, query_start_loc=qsl, positions=pos, block_tables=st["block_tables"],
                     block_size=BLOCK)
    assert torch.equal(got["slot_mapping"], want["slot_mapping"])
    rows = torch.repeat_interleave(idx, qsl[1:] - qsl[:-1])
    by_hand = [int(st["block_tables"][s, p // BLOCK]) * BLOCK + p % BLOCK for s, p in zip(rows.tolist(), pos.tolist())]
    assert want["slot_mapping"].tolist() == by_hand + [kernels.PAD_SLOT_ID] * 5


def test_padding_rows():
    """Rows past num_reqs (a batch padded to a fixed size) get seq_len 0 and the null block; a
    negative slot (a dummy request) and the tokens past the batch's get PAD slots."""
    st = random_state(1)
    idx = torch.cat([st["idx_mapping"][:1], torch.tensor([-1])])
    qsl = torch.tensor([0, int(st["query_start_loc"][1]), int(st["query_start_loc"][1]) + 3], dtype=torch.int32)
    n = int(qsl[-1])
    got, want = both(kernels.prepare_pos_seq_lens, kernels.prepare_pos_seq_lens_ref,
                     dict(pos=torch.zeros(n, dtype=torch.int64), seq_lens=torch.full((4,), 7, dtype=torch.int32)),
                     idx_mapping=idx[:1], query_start_loc=qsl[:2], num_computed_tokens=st["num_computed"])
    assert torch.equal(got["seq_lens"], want["seq_lens"]) and want["seq_lens"][1:].tolist() == [0, 0, 0]
    assert torch.equal(got["pos"], want["pos"])
    got, want = both(kernels.gather_block_tables, kernels.gather_block_tables_ref,
                     dict(out=torch.full((3, 3), -5, dtype=torch.int32)),
                     idx_mapping=idx[:1], block_tables=st["block_tables"], num_blocks=st["num_blocks"])
    assert torch.equal(got["out"], want["out"]) and not want["out"][1:].any()
    pos = torch.cat([want_pos(st, idx[:1], qsl[:2]), torch.arange(3)])
    got, want = both(kernels.compute_slot_mappings, kernels.compute_slot_mappings_ref,
                     dict(slot_mapping=torch.zeros(n + 2, dtype=torch.int64)), idx_mapping=idx, query_start_loc=qsl,
                     positions=pos, block_tables=st["block_tables"], block_size=BLOCK)
    assert torch.equal(got["slot_mapping"], want["slot_mapping"])
    assert want["slot_mapping"][-5:].tolist() == [kernels.PAD_SLOT_ID] * 5 and (want["slot_mapping"][:-5] >= 0).all()


def want_pos(st, idx, qsl) -> torch.Tensor:
    pos = torch.zeros(int(qsl[-1]), dtype=torch.int64)
    kernels.prepare_pos_seq_lens_ref(idx, qsl, st["num_computed"], pos, torch.zeros(len(idx), dtype=torch.int32))
    return pos


@pytest.mark.parametrize("seed", range(3))
def test_post_update_agrees(seed):
    """Sampled tokens (a chunk mid-prompt samples none, a verification keeps some of its drafts)
    are appended to the slot's buffer; num_computed_tokens advances by the tokens kept."""
    st = random_state(seed)
    idx, qsl = st["idx_mapping"], st["query_start_loc"]
    g = torch.Generator().manual_seed(seed)
    num_reqs = len(idx)
    sampled = torch.randint(1, 1000, (num_reqs, 4), generator=g)
    num_sampled = torch.randint(0, 5, (num_reqs,), generator=g, dtype=torch.int32)
    num_rejected = torch.randint(0, 2, (num_reqs,), generator=g, dtype=torch.int32)
    idx = torch.cat([idx, torch.tensor([-1])])  # a padding row: nothing changes
    qsl = torch.cat([qsl, qsl[-1:] + 1])
    sampled = torch.cat([sampled, sampled[:1]])
    num_sampled = torch.cat([num_sampled, torch.tensor([2], dtype=torch.int32)])
    num_rejected = torch.cat([num_rejected, torch.tensor([0], dtype=torch.int32)])
    state = dict(num_computed_tokens=st["num_computed"], all_token_ids=st["all_token_ids"], total_len=st["num_tokens"])
    got, want = both(kernels.post_update, kernels.post_update_ref, state, idx_mapping=idx, sampled_tokens=sampled,
                     num_sampled=num_sampled, num_rejected=num_rejected, query_start_loc=qsl)
    for k in state:
        assert torch.equal(got[k], want[k]), k
    for i, s in enumerate(idx[:-1].tolist()):
        k, end = int(num_sampled[i]), int(st["num_tokens"][s])
        assert int(want["total_len"][s]) == end + k
        assert want["all_token_ids"][s, end:end + k].tolist() == sampled[i, :k].tolist()
        assert int(want["num_computed_tokens"][s]) == int(st["num_computed"][s]) + int(qsl[i + 1] - qsl[i]) - int(
            num_rejected[i])


def test_each_launch_is_traced_with_its_grid():
    st = random_state(2)
    idx, qsl = st["idx_mapping"].to(DEVICE), st["query_start_loc"].to(DEVICE)
    n, num_reqs = int(qsl[-1]), len(idx)
    pos = torch.zeros(n, dtype=torch.int64, device=DEVICE)
    records = []
    with instrument.observe(records.append, step=3):
        kernels.prepare_pos_seq_lens(idx, qsl, st["num_computed"].to(DEVICE), pos,
                                     torch.zeros(num_reqs, dtype=torch.int32, device=DEVICE))
        kernels.compute_slot_mappings(idx, qsl, pos, st["block_tables"].to(DEVICE), BLOCK,
                                      torch.zeros(n, dtype=torch.int64, device=DEVICE))
        kernels.gather_block_tables(idx, st["block_tables"].to(DEVICE), st["num_blocks"].to(DEVICE),
                                    torch.zeros(num_reqs, 4, dtype=torch.int32, device=DEVICE))
        kernels.prepare_prefill_inputs(torch.zeros(n, dtype=torch.int64, device=DEVICE), idx, qsl,
                                       st["all_token_ids"].to(DEVICE), st["num_tokens"].to(DEVICE),
                                       st["num_computed"].to(DEVICE), st["draft_tokens"].to(DEVICE))
    assert [(r.name, r.grid) for r in records] == [
        ("prepare_pos_seq_lens", (num_reqs + 1,)), ("compute_slot_mappings", (num_reqs + 1,)),
        ("gather_block_tables", (num_reqs,)), ("prepare_prefill_inputs", (num_reqs,))]
    assert all(r.tags == {"step": 3} and r.reason and "BLOCK_SIZE" in r.meta for r in records)
    slots = next(r for r in records if r.name == "compute_slot_mappings")
    assert slots.meta["KV_BLOCK_SIZE"] == BLOCK and slots.args["slot_mapping"] == ((n,), "int64")
