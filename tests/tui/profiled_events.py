"""Synthetic profiled traces, as the engine emits them while profiling is on (profiler start/stop,
every op of the forward pass a kernel launch with `op`, `flops`, `bytes`, `profiled`), for the
fold's, the Kernels panel's, the roofline chart's and the export's tests.

The shapes are tiny-gpt2's (4 layers, 128 wide, 4,096-token vocabulary, float32); FLOPs and
bytes are computed from them the way the engine documents (a matmul: 2·M·K·N FLOPs; its input,
weight, bias and output read or written once). Each op's time is what a machine with ROOF's peaks
would take at half its roof: so decode's matmuls land under the memory roof and a long prefill's
under the compute roof.
"""
from __future__ import annotations

from engine.hooks import BEGIN, END
from kernels.roofline import Roofline
from tests.tui.tp_events import _Trace

N_LAYER, D, VOCAB, F32 = 4, 128, 4096, 4
ROOF = Roofline(100e9, 20e9, "cpu", "float32", {}, 0.5, 512, 128 << 20)  # ridge: 5 FLOP/byte


def matmul(m: int, k: int, n: int, bias: bool = True) -> tuple[int, int]:
    return 2 * m * k * n, F32 * (m * k + k * n + m * n + (n if bias else 0))


def step_ops(tokens: int, context: int) -> list[tuple[str, str, int | None, int, int]]:
    """(name, kind, layer, flops, bytes) of one forward pass over `tokens` query tokens."""
    act = F32 * tokens * D
    ops = [("wte", "embedding", None, 0, act * 2)]
    for layer in range(N_LAYER):
        ops += [("ln_1", "norm", layer, 8 * tokens * D, 2 * act + 2 * F32 * D),
                ("c_attn", "matmul", layer, *matmul(tokens, D, 3 * D)),
                ("reshape_and_cache", "cache_write", layer, 0, 4 * act),
                ("unified_attention", "attention", layer, 4 * tokens * context * D, 2 * act + 2 * F32 * context * D),
                ("c_proj", "matmul", layer, *matmul(tokens, D, D)),
                ("ln_2", "norm", layer, 8 * tokens * D, 2 * act + 2 * F32 * D),
                ("c_fc", "matmul", layer, *matmul(tokens, D, 4 * D)),
                ("gelu", "elementwise", layer, 8 * tokens * 4 * D, 8 * act),
                ("mlp.c_proj", "matmul", layer, *matmul(tokens, 4 * D, D))]
    ops += [("ln_f", "norm", None, 8 * tokens * D, 2 * act + 2 * F32 * D),
            ("lm_head", "matmul", None, *matmul(tokens, D, VOCAB, bias=False)),
            ("sample", "sampler", None, 0, F32 * VOCAB)]
    return ops


def op_ns(flops: int, nbytes: int) -> int:
    return max(1000, int(2 * max(flops / ROOF.peak_flops, nbytes / ROOF.peak_bw) * 1e9))


def profiled_events(prompt_tokens: int = 40, decode_steps: int = 2, profile: bool = True) -> list:
    """Startup, one request: its prefill step and `decode_steps` decode steps, profiled (or not),
    then profiling stopped and one more decode step with only the usual two launches per layer."""
    t = _Trace()
    config = {"model": {"model": "tiny-gpt2", "device": "cpu"}, "attention_backend": "torch",
              "cache": {"block_size": 16, "enable_prefix_caching": True}}
    t.add("engine", "config", config=config, model="tiny-gpt2")
    t.add("engine", "model_load", BEGIN, path="tiny-gpt2", device="cpu", attention_backend="torch")
    t.add("engine", "model_load", END, seconds=0.5, ok=True)
    if profile:
        t.add("profiler", "start", step=0, profiler_dir=None)
    t.add("engine", "QUEUED", step=0, request_id="a", num_prompt_tokens=prompt_tokens, max_tokens=8)
    for step in range(1 + decode_steps + 1):
        if step == 1 + decode_steps and profile:
            t.add("profiler", "stop", step=step, profiler_dir=None)
        tokens, context = (prompt_tokens, prompt_tokens) if step == 0 else (1, prompt_tokens + step)
        t.add("engine", "step", BEGIN, step=step)
        step_begin = t.ts
        t.add("model_runner", "batch", step=step, input_ids=list(range(tokens)), request_ids=["a"])
        if profile and step <= decode_steps:
            for name, kind, layer, flops, nbytes in step_ops(tokens, context):
                t.add("kernel", name, step=step, layer_idx=layer, grid=[], meta={},
                      args={"x": [[tokens, D], "float32"]}, duration_ns=op_ns(flops, nbytes), timing="wall_clock",
                      reason=f"profiled {kind}", rank=0, op=kind, flops=flops, bytes=nbytes, profiled=True)
                t.ts += op_ns(flops, nbytes)
        else:
            for layer in range(N_LAYER):
                for name in ("reshape_and_cache_ref", "unified_attention_ref"):
                    t.add("kernel", name, step=step, layer_idx=layer, grid=[], meta={},
                          args={"query": [[tokens, 4, 32], "float32"]}, duration_ns=50_000, timing="wall_clock",
                          reason="reference", rank=0)
        t.ts += 10_000
        t.add("engine", "step", END, step=step, stats={"num_free_blocks": 60, "num_total_blocks": 64})
        assert t.ts > step_begin
    return t.events
