"""The cost model (kernels/op_cost.py) against hand-computed FLOPs and bytes for one shape per op,
and profiled ops (instrument.op / instrument.Op): recorded only inside observe(profile=True),
with their shapes and the launches made inside them subtracted from their duration."""
from __future__ import annotations

import time

import torch

from kernels import instrument, op_cost
from kernels.op_cost import launch_cost

F32, I64 = "float32", "int64"


def test_matmul_layer_norm_rms_norm_embedding():
    # x [4, 128] · W [128, 384] + b: 2·4·128·384 + 4·384 FLOPs; (512 + 49152 + 384 + 1536) floats moved
    args = {"x": ((4, 128), F32), "weight": ((128, 384), F32), "bias": ((384,), F32)}
    assert op_cost.matmul(args, {}) == (394_752, 206_336)
    # the same product with nn.Linear's [out, in] weight and no bias: 2·4·128·384; (512 + 49152 + 1536) · 4
    assert op_cost.matmul({"x": ((4, 128), F32), "weight": ((384, 128), F32)}, {}) == (393_216, 204_800)
    # bfloat16: half the bytes, the same FLOPs
    assert op_cost.matmul({k: (s, "bfloat16") for k, (s, _) in args.items()}, {}) == (394_752, 103_168)
    ln = {"x": ((4, 128), F32), "weight": ((128,), F32), "bias": ((128,), F32)}
    assert op_cost.layer_norm(ln, {}) == (7 * 512, 2 * 2048 + 512 + 512)
    assert op_cost.rms_norm({"x": ((4, 64), F32), "weight": ((64,), F32)}, {}) == (4 * 256, 2 * 1024 + 256)
    # 4 ids; 4 rows of 128 floats read and written (not the 4096-row table)
    assert op_cost.embedding({"x": ((4,), I64), "weight": ((4096, 128), F32)}, {}) == (0, 32 + 2 * 4 * 512)


def test_elementwise_rotary_and_cache_write():
    assert op_cost.gelu_new({"x": ((4, 512), F32)}, {}) == (8 * 2048, 2 * 8192)
    assert op_cost.silu_and_mul({"x": ((4, 320), F32)}, {}) == (5 * 640, 5120 + 2560)  # y is [4, 160]
    rope = {"positions": ((4,), I64), "query": ((4, 8, 16), F32), "key": ((4, 2, 16), F32)}
    # 3 FLOPs per rotated element; q and k read and written, 4 positions, 4 rows of cos|sin (16 floats)
    assert op_cost.rotary_embedding(rope, {}) == (3 * (512 + 128), 2 * (2048 + 512) + 32 + 4 * 16 * 4)
    kv = {"key": ((4, 2, 16), F32), "value": ((4, 2, 16), F32), "slot_mapping": ((4,), I64),
          "key_cache": ((10, 16, 2, 16), F32), "value_cache": ((10, 16, 2, 16), F32)}
    assert op_cost.cache_write(kv, {}) == (0, 2 * (512 + 512) + 32)


def test_attention_counts_causal_pairs_from_the_batch():
    # a 4-token prefill (positions 0..3: 1+2+3+4 = 10 pairs) and a decode at position 9 of 10 (10 pairs)
    assert op_cost.attention_keys([4, 1], [4, 10]) == 20
    args = {"query": ((5, 4, 32), F32), "key_cache": ((10, 16, 4, 32), F32), "value_cache": ((10, 16, 4, 32), F32)}
    flops, nbytes = op_cost.attention(args, {}, [4, 1], [4, 10])
    assert flops == 4 * 32 * 4 * 20  # 4·D per (query head, key) pair
    assert nbytes == 2 * (5 * 4 * 32 * 4) + 2 * 14 * 4 * 32 * 4  # q read, o written; 14 keys and values read
    assert launch_cost("unified_attention_ref", None, args, {}, [4, 1], [4, 10]) == ("attention", flops, nbytes)
    assert launch_cost("unified_attention", None, args, {}, [4, 1], [4, 10])[0] == "attention"


def test_collectives_and_sampler_steps():
    meta = {"world_size": 2}
    assert op_cost.all_reduce({"tensor": ((4, 128), F32)}, meta) == (256, 2048)  # ring: (N-1)/N adds, 2(N-1)/N bytes
    assert op_cost.all_gather({"tensor": ((4, 2048), F32)}, meta) == (0, 2 * 32768)
    logits = {"logits": ((3, 4096), F32)}
    assert op_cost.argmax(logits, {}) == (12_288, 49_152 + 3 * 8)
    assert op_cost.log_softmax(logits, {}) == (5 * 12_288, 2 * 49_152)
    assert op_cost.sample({"logits": ((4096,), F32)}, {}) == (4096, 2 * 16_384)  # temperature; the row in and out


def test_launch_cost_dispatch():
    args = {"x": ((1, 128), F32), "weight": ((128, 384), F32), "bias": ((384,), F32)}
    assert launch_cost("c_attn", "matmul", args, {"cost": "matmul"}) == ("matmul", *op_cost.matmul(args, {}))
    kv = {"key": ((1, 4, 32), F32), "value": ((1, 4, 32), F32), "slot_mapping": ((1,), I64)}
    assert launch_cost("reshape_and_cache", None, kv, {}) == ("cache_write", *op_cost.cache_write(kv, {}))
    assert launch_cost("mystery", None, {"a": ((2, 3), F32)}, {}) == ("other", 0, 24)


def test_an_op_is_a_launch_only_while_profiling():
    x = torch.randn(3, 8)
    w = torch.randn(8, 5)
    op = instrument.Op("proj", "matmul", lambda x: x @ w, ("x",), {"weight": w}, {"cost": "matmul"})
    seen = []
    assert torch.equal(op(x), x @ w)  # nobody observes
    with instrument.observe(seen.append, step=1):
        op(x)  # observed, not profiled: not a launch
        assert instrument.op("f", "elementwise", torch.neg, {"x": x}).equal(-x) and not seen
        with instrument.observe(lambda r: None, profile=True):
            instrument.set_tags(layer=2)
            y = op(x)
            instrument.op("neg", "elementwise", torch.neg, {"x": x})
    assert torch.equal(y, x @ w)
    assert [r.name for r in seen] == ["proj", "neg"]
    rec = seen[0]
    assert rec.op == "matmul" and rec.tags == {"step": 1, "layer": 2} and rec.grid == ()
    assert rec.args == {"x": ((3, 8), "float32"), "out": ((3, 5), "float32"), "weight": ((8, 5), "float32")}
    assert launch_cost(rec.name, rec.op, rec.args, rec.meta)[1:] == (2 * 3 * 8 * 5, (24 + 15 + 40) * 4)


def test_a_launch_inside_an_op_is_not_counted_twice():
    def outer(x):
        time.sleep(0.02)
        instrument.call("all_reduce", lambda tensor: time.sleep(0.05) or tensor, {"tensor": x})
        return x

    seen, gates = [], []
    with instrument.observe(seen.append, lambda name, grid, meta: gates.append(name), profile=True):
        instrument.Op("c_proj", "matmul", outer, ("x",))(torch.zeros(2))
    inner, op = seen
    assert (inner.name, op.name) == ("all_reduce", "c_proj") and gates == ["c_proj", "all_reduce"]
    assert inner.duration_ns >= 50e6 and 20e6 <= op.duration_ns < 50e6  # its own 20 ms, not the all-reduce's


def test_fused_moe_counts_the_experts_used():
    # 2 tokens, top-2 of 8 experts, hidden 64, expert width 32: 4 pairs, 3 experts chosen
    args = {"hidden_states": ((2, 64), F32), "w13": ((8, 64, 64), F32), "w2": ((8, 64, 32), F32),
            "topk_weights": ((2, 2), F32), "topk_ids": ((2, 2), I64)}
    per_pair = 4 * 64 * 32 + 5 * 32 + 2 * 32 * 64 + 64  # gate and up, silu·mul, down, the routing weight
    weights = 3 * (64 * 64 + 64 * 32) * 4  # 3 experts' w13 and w2, not 8
    assert op_cost.fused_moe(args, {"top_k": 2, "experts_used": 3}) == (
        4 * per_pair + 2 * 64, 2 * 2 * 64 * 4 + weights + 2 * 2 * 8 + 2 * 2 * 4)
    assert launch_cost("fused_moe_ref", None, args, {"experts_used": 3})[0] == "matmul"
    # the Triton kernel's two GEMMs: w13 with silu·mul into [4, 32], w2 with the routing weight into [4, 64]
    w13 = {"a": ((2, 64), F32), "b": ((8, 64, 64), F32), "c": ((4, 32), F32)}
    assert op_cost.fused_moe_gemm(w13, {"SILU_AND_MUL": True, "experts_used": 3}) == (
        4 * (2 * 64 * 64 + 5 * 32), 2 * 64 * 4 + 4 * 32 * 4 + 3 * 64 * 64 * 4)
    w2 = {"a": ((4, 32), F32), "b": ((8, 64, 32), F32), "c": ((4, 64), F32)}
    assert op_cost.fused_moe_gemm(w2, {"SILU_AND_MUL": False})[0] == 4 * (2 * 32 * 64 + 64)  # 4 experts at most
    # expert parallelism's combine over 2 ranks: half the elements added, half the bytes sent
    assert op_cost.reduce_scatter({"tensor": ((4, 64), F32)}, {"world_size": 2}) == (128, 512)
