"""kernels.rerun: an attention call's inputs through the Triton kernel, answered as plain data."""
import json

import pytest
import torch
from kernel_batches import make_batch

from kernels.rerun import attention_inputs, attention_on_triton


def test_a_mixed_batch_runs_on_triton_and_matches_the_reference():
    b = make_batch([1, 5, 3], [9, 5, 12], q_heads=4, kv_heads=2, head_size=32, block_size=4)
    got = attention_on_triton(*b.args())
    json.dumps(got)  # plain data: it may cross a process boundary
    assert got["name"] == "unified_attention" and got["max_abs_diff"] < 1e-4
    assert got["num_programs"] == got["grid"][0] * got["grid"][1] * got["grid"][2]
    # every query row and every KV head of every request is some program's work
    rows = {(r, h) for p in got["programs"] for r in range(*p["rows"]) for h in p["kv_heads"]}
    assert rows == {(r, h) for r in range(9) for h in range(2)}
    tables, lens = b.block_tables.tolist(), b.seq_lens.tolist()
    for p in got["programs"]:  # each program reads the blocks of its request's table, in order
        r = p["request"]
        assert p["blocks"] == tables[r][:len(p["blocks"])] and p["kv_positions"][1] <= lens[r]
    read = {p["request"]: set() for p in got["programs"]}
    for p in got["programs"]:
        read[p["request"]].update(p["blocks"])
    assert all(read[r] == set(tables[r][:-(-lens[r] // 4)]) for r in range(3))


def test_the_kernels_own_argument_names_work_too_and_the_inputs_are_copied():
    b = make_batch([2], [6], q_heads=2, kv_heads=2, head_size=16, block_size=4)
    args = dict(query_ptr=b.query, key_cache_ptr=b.key_cache, value_cache_ptr=b.value_cache,
                query_start_loc_ptr=b.query_start_loc, seq_lens_ptr=b.seq_lens, block_tables_ptr=b.block_tables,
                scale=b.scale, out_ptr=torch.empty_like(b.query))
    inputs = attention_inputs(args)
    assert inputs["key_cache"].data_ptr() != b.key_cache.data_ptr()
    assert torch.equal(inputs["key_cache"], b.key_cache)
    assert attention_on_triton(**inputs)["max_abs_diff"] < 1e-4


def test_not_an_attention_call_is_a_clear_error():
    with pytest.raises(ValueError, match="not an attention call: no query"):
        attention_inputs({"key": torch.zeros(1)})


def test_a_windowed_call_with_sinks_reruns_with_both():
    """A reference call's sliding_window and sinks go along: the Triton kernel attends as it did."""
    b = make_batch([1, 4], [30, 20], q_heads=4, kv_heads=2, head_size=16, block_size=4, seed=1)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=b.query.device)
    args = dict(zip(("query", "key_cache", "value_cache", "query_start_loc", "seq_lens", "block_tables", "scale"),
                    b.args()), sliding_window=8, sinks=sinks, plan=None)
    inputs = attention_inputs(args)
    assert inputs["sliding_window"] == 8 and torch.equal(inputs["sinks"], args["sinks"]) and "plan" not in inputs
    got = attention_on_triton(**inputs)
    assert got["max_abs_diff"] < 1e-4 and got["meta"]["SLIDING_WINDOW"] == 8 and got["meta"]["USE_SINKS"]
