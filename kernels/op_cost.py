"""What each op of a forward pass costs: floating-point operations and bytes moved, from shapes.

Pure functions of tensor shapes and dtypes (and, for attention, the batch's query and sequence
lengths): no tensor is touched, so a profiled step pays for none of this while it runs; the
costs are computed when its launches are published. ``bytes`` counts the data an op must read
and write at least once (its inputs read, its outputs written), the quantity a roofline divides
the FLOPs by; caches can make real traffic lower and re-reads make it higher. A multiply-add
counts as 2 FLOPs. Each function's docstring gives its formula.

``launch_cost(name, op, args, meta, query_lens, seq_lens)`` dispatches: a profiled module op
carries its formula's name in ``meta["cost"]``; a kernel launch is known by its name
(``KERNELS``). ``args`` is a launch record's: argument -> (shape, dtype name).
"""
from __future__ import annotations

import math
from typing import Callable

Shape = tuple[int, ...]
Args = dict[str, tuple[Shape, str]]

ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint8": 1, "bool": 1}

# op kinds (a record's ``op``)
MATMUL, NORM, ELEMENTWISE, EMBEDDING = "matmul", "norm", "elementwise", "embedding"
ATTENTION, CACHE_WRITE, COLLECTIVE, SAMPLER, OTHER = "attention", "cache_write", "collective", "sampler", "other"


def numel(shape: Shape) -> int:
    return math.prod(shape)


def nbytes(arg: tuple[Shape, str] | None) -> int:
    """Bytes of one described tensor (0 for an absent one)."""
    if arg is None:
        return 0
    shape, dtype = arg
    return numel(shape) * ITEMSIZE.get(dtype, 4)


# ---- module ops ------------------------------------------------------------------------------
def matmul(args: Args, meta: dict) -> tuple[int, int]:
    """y[M, N] = x[M, K] · W (+ b): 2·M·K·N FLOPs, plus M·N for the bias; bytes: x, W and b read,
    y written. M·K is x's size (every leading dimension is a row), K its last dimension, and
    N = W's size / K, whatever W's layout ([K, N] for GPT-2's Conv1D, [N, K] for nn.Linear)."""
    x, w = args["x"], args["weight"]
    k = x[0][-1]
    m, n = numel(x[0]) // k, numel(w[0]) // k
    bias = args.get("bias")
    flops = 2 * m * k * n + (m * n if bias is not None else 0)
    out = ((m, n), x[1])
    return flops, nbytes(x) + nbytes(w) + nbytes(bias) + nbytes(out)


def layer_norm(args: Args, meta: dict) -> tuple[int, int]:
    """LayerNorm over the last dimension: per element the mean's add, the subtraction, the square,
    the variance's add, the normalising multiply, the scale and the shift: 7 FLOPs per element (a
    row's square root ignored); bytes: x, weight and bias read, y (x's shape) written."""
    x = args["x"]
    return 7 * numel(x[0]), 2 * nbytes(x) + nbytes(args.get("weight")) + nbytes(args.get("bias"))


def rms_norm(args: Args, meta: dict) -> tuple[int, int]:
    """RMSNorm: per element the square, the mean's add, the multiply by 1/rms and by the weight:
    4 FLOPs per element; bytes: x and weight read, y written (the float32 upcast is not counted)."""
    x = args["x"]
    return 4 * numel(x[0]), 2 * nbytes(x) + nbytes(args.get("weight"))


def embedding(args: Args, meta: dict) -> tuple[int, int]:
    """A table lookup: no FLOPs; bytes: the T ids, the T rows gathered (T · dim · itemsize, not the
    whole table) and the [T, dim] output written."""
    ids, w = args["x"], args["weight"]
    t, dim = numel(ids[0]), w[0][-1]
    row = dim * ITEMSIZE.get(w[1], 4)
    return 0, nbytes(ids) + 2 * t * row


def gelu_new(args: Args, meta: dict) -> tuple[int, int]:
    """GELU, tanh approximation: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) is 8 FLOPs per element
    (tanh counted as one); bytes: x read, y written."""
    x = args["x"]
    return 8 * numel(x[0]), 2 * nbytes(x)


def silu_and_mul(args: Args, meta: dict) -> tuple[int, int]:
    """SwiGLU's gate: x = [gate | up] of 2·F features, y = silu(gate) · up of F: silu is
    gate / (1 + exp(-gate)), 4 FLOPs (exp counted as one), then the multiply: 5 FLOPs per output
    element; bytes: x read, y (half of x) written."""
    x = args["x"]
    return 5 * numel(x[0]) // 2, nbytes(x) + nbytes(x) // 2


# ---- kernels and functions already traced as launches ----------------------------------------
def rotary_embedding(args: Args, meta: dict) -> tuple[int, int]:
    """RoPE on q [T, Hq, D] and k [T, Hk, D]: each output element is x1·cos − x2·sin (or
    x2·cos + x1·sin), 3 FLOPs; bytes: q and k read and written, T positions and the T rows of
    cos and sin (D float32 values each) read."""
    q, k, pos = args["query"], args["key"], args["positions"]
    t, d = numel(pos[0]), q[0][-1]
    return 3 * (numel(q[0]) + numel(k[0])), 2 * (nbytes(q) + nbytes(k)) + nbytes(pos) + t * d * 4


def cache_write(args: Args, meta: dict) -> tuple[int, int]:
    """reshape_and_cache: the step's k and v [T, Hkv, D] copied into their cache slots: no FLOPs;
    bytes: k and v read, the same written into the caches, the T slots read."""
    k, v = args["key"], args["value"]
    return 0, 2 * (nbytes(k) + nbytes(v)) + nbytes(args.get("slot_mapping"))


def attention_keys(query_lens: list[int], seq_lens: list[int]) -> int:
    """(query token, key) pairs of causal attention over a batch: a request with q new tokens and
    s tokens in all has its new tokens at positions s−q .. s−1, each attending to every key up
    to itself: q·(s−q) + q·(q+1)/2 pairs."""
    return sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(query_lens, seq_lens))


def attention(args: Args, meta: dict, query_lens: list[int] | None, seq_lens: list[int] | None) -> tuple[int, int]:
    """Paged attention, q [T, Hq, D] against each request's cached keys and values: per (query
    head, key) pair one dot product (2·D) for the score and one multiply-add over D for the
    output, 4·D FLOPs (softmax's few FLOPs per score ignored). Bytes: q read, o (q's shape)
    written, and each request's keys and values read once: Σ seq_len · Hkv · D for each of K and
    V (the cache's dtype; block tables and lengths ignored). Without the batch's lengths (a
    launch outside the engine), every token is counted as a one-token query over max_seq_len. A
    launch that attends some of the batch's requests only (the cpu backend splits a batch between
    its C kernel and the reference) says which in meta["requests"]."""
    q, kc = args["query"], args["key_cache"]
    t, hq, d = q[0][0], q[0][1], q[0][-1]
    hkv = kc[0][2] if len(kc[0]) == 4 else kc[0][1]
    if meta.get("requests") is not None and query_lens is not None and seq_lens is not None:
        query_lens, seq_lens = [query_lens[i] for i in meta["requests"]], [seq_lens[i] for i in meta["requests"]]
    if query_lens is None or seq_lens is None:
        s = int(meta.get("max_seq_len") or 1)
        query_lens, seq_lens = [1] * t, [s] * t
    pairs = attention_keys(query_lens, seq_lens)
    kv_bytes = 2 * sum(seq_lens) * hkv * d * ITEMSIZE.get(kc[1], 4)
    return 4 * d * hq * pairs, 2 * nbytes(q) + kv_bytes


def all_reduce(args: Args, meta: dict) -> tuple[int, int]:
    """Sum over N ranks (a ring, as NCCL and gloo run it): each rank adds (N−1)/N of the tensor's
    elements and sends and receives 2·(N−1)/N of its bytes; ``bytes`` is that traffic."""
    x, n = args["tensor"], int(meta.get("world_size") or 1)
    return numel(x[0]) * (n - 1) // n, 2 * nbytes(x) * (n - 1) // n


def all_gather(args: Args, meta: dict) -> tuple[int, int]:
    """Every rank's slice to every rank: no FLOPs; each rank sends its slice and receives the N−1
    others, so ``bytes`` is that traffic: N · the slice's bytes."""
    x, n = args["tensor"], int(meta.get("world_size") or 1)
    return 0, n * nbytes(x)


def reduce_scatter(args: Args, meta: dict) -> tuple[int, int]:
    """Sum over N ranks, each keeping 1/N of the result (a ring): each rank adds (N−1)/N of the
    tensor's elements and sends (N−1)/N of its bytes; ``bytes`` is that traffic."""
    x, n = args["tensor"], int(meta.get("world_size") or 1)
    return numel(x[0]) * (n - 1) // n, nbytes(x) * (n - 1) // n


def token_bitmask(args: Args, meta: dict) -> tuple[int, int]:
    """Structured outputs' mask: one select per logit of the masked rows (counted over the whole
    logits); bytes: logits read and written, the bitmask read."""
    lg = args["logits"]
    return numel(lg[0]), 2 * nbytes(lg) + nbytes(args.get("bitmask"))


# ---- the sampler's steps ----------------------------------------------------------------------
def argmax(args: Args, meta: dict) -> tuple[int, int]:
    """Greedy: one comparison per logit of [R, V]; bytes: the logits read, R token ids written."""
    lg = args["logits"]
    return numel(lg[0]), nbytes(lg) + 8 * numel(lg[0][:-1])


def log_softmax(args: Args, meta: dict) -> tuple[int, int]:
    """log_softmax over [R, V]: the max, the subtraction, exp, the sum and the final subtraction:
    5 FLOPs per logit; bytes: logits read, log-probabilities written."""
    lg = args["logits"]
    return 5 * numel(lg[0]), 2 * nbytes(lg)


def logits_processor(args: Args, meta: dict) -> tuple[int, int]:
    """A logits processor over [R, V] (allowed tokens, bad words, min_tokens, logit bias,
    penalties): it copies the logits and changes some of them; counted as one FLOP per logit and
    the logits read and written once (an upper bound for a processor touching a few tokens)."""
    lg = args["logits"]
    return numel(lg[0]), 2 * nbytes(lg)


def sample(args: Args, meta: dict) -> tuple[int, int]:
    """The logits a request draws from, made from its row of V logits (MRv2's apply_sampling_params):
    the temperature's division, 1 FLOP a logit (min-p, top-k and top-p, when asked, add a softmax and
    a sort that are not counted); bytes: the row read and written, 2 rows."""
    row = args["logits"]
    return numel(row[0]), 2 * nbytes(row)


def gumbel(args: Args, meta: dict) -> tuple[int, int]:
    """Gumbel-max over [R, V]: per logit the noise (two logs, two additions), its addition and the
    max: 6 FLOPs (Philox's integer rounds not counted); bytes: the logits read, R tokens written."""
    lg = args["logits"]
    return 6 * numel(lg[0]), nbytes(lg) + 8 * numel(lg[0][:-1])


def _experts_used(meta: dict, num_experts: int, num_pairs: int) -> int:
    """The experts some token chose (the launch's meta says; else at most one per pair)."""
    return int(meta.get("experts_used") or min(num_experts, num_pairs))


def fused_moe(args: Args, meta: dict) -> tuple[int, int]:
    """A mixture of experts' SwiGLU MLP, hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], top_k
    experts a token: per (token, expert) pair 2·H·2I FLOPs for gate and up, 5·I for silu·mul,
    2·I·H for down and H for the routing weight; the top_k outputs' sum, (top_k − 1)·H a token.
    Bytes: the hidden states read and the output written, and the weights of the experts used
    only (``meta["experts_used"]``, every expert some token chose): an idle expert's weights are
    never read, which is why decode, reading U·3·H·I weights for a few tokens, is memory-bound."""
    x, w13, w2 = args["hidden_states"], args["w13"], args["w2"]
    t, h = x[0]
    e, i2, _ = w13[0]
    k = int(meta.get("top_k") or args["topk_ids"][0][-1])
    pairs, i = t * k, i2 // 2
    used = _experts_used(meta, e, pairs)
    flops = pairs * (4 * h * i + 5 * i + 2 * i * h + h) + t * (k - 1) * h
    weights = used * (nbytes(w13) + nbytes(w2)) // max(e, 1)
    return flops, 2 * nbytes(x) + weights + nbytes(args.get("topk_ids")) + nbytes(args.get("topk_weights"))


def fused_moe_gemm(args: Args, meta: dict) -> tuple[int, int]:
    """One of the Triton kernel's two grouped GEMMs, c [pairs, N] from a's rows and b [E, N', K]:
    2·K·N FLOPs a pair (w13: N' = 2N, gate and up, plus 5·N for silu·mul; w2: N for the routing
    weight); bytes: a read, c written, and the weights of the experts used only."""
    a, b, c = args["a"], args["b"], args["c"]
    e, n_b, k = b[0]
    pairs, n = c[0]
    used = _experts_used(meta, e, pairs)
    flops = pairs * (2 * k * n_b + (5 * n if meta.get("SILU_AND_MUL") else n))
    return flops, nbytes(a) + nbytes(c) + used * nbytes(b) // max(e, 1)


COSTS: dict[str, Callable[[Args, dict], tuple[int, int]]] = {
    "matmul": matmul, "layer_norm": layer_norm, "rms_norm": rms_norm, "embedding": embedding,
    "gelu_new": gelu_new, "silu_and_mul": silu_and_mul, "argmax": argmax, "log_softmax": log_softmax,
    "logits_processor": logits_processor, "sample": sample,
}

# launches made by kernels and by engine code through instrument.launch / call: name -> (op, cost)
KERNELS: dict[str, tuple[str, Callable[[Args, dict], tuple[int, int]] | None]] = {
    "reshape_and_cache": (CACHE_WRITE, cache_write), "reshape_and_cache_ref": (CACHE_WRITE, cache_write),
    "unified_attention": (ATTENTION, None), "unified_attention_split_kv": (ATTENTION, None),
    "unified_attention_ref": (ATTENTION, None), "cpu_attention_with_kv_cache": (ATTENTION, None),
    "rotary_embedding": (ELEMENTWISE, rotary_embedding),
    "all_reduce": (COLLECTIVE, all_reduce), "all_gather": (COLLECTIVE, all_gather),
    "reduce_scatter": (COLLECTIVE, reduce_scatter),
    "apply_token_bitmask": (SAMPLER, token_bitmask), "apply_token_bitmask_ref": (SAMPLER, token_bitmask),
    "gumbel_sample": (SAMPLER, gumbel), "gumbel_sample_ref": (SAMPLER, gumbel), "gumbel_sample_cpu": (SAMPLER, gumbel),
    "fused_moe_ref": (MATMUL, fused_moe), "fused_moe_w13": (MATMUL, fused_moe_gemm),
    "fused_moe_w2": (MATMUL, fused_moe_gemm),
}


def launch_cost(name: str, op: str | None, args: Args, meta: dict, query_lens: list[int] | None = None,
                seq_lens: list[int] | None = None) -> tuple[str, int, int]:
    """(op kind, FLOPs, bytes) of one launch. A launch this module has no formula for is op
    "other" with 0 FLOPs and the bytes of its tensor arguments."""
    formula = meta.get("cost") if op is not None else None
    if formula in COSTS:
        return (op, *COSTS[formula](args, meta))
    kind, fn = KERNELS.get(name, (op or OTHER, None))
    if kind == ATTENTION:
        return (kind, *attention(args, meta, query_lens, seq_lens))
    if fn is not None:
        return (kind, *fn(args, meta))
    return kind, 0, sum(nbytes(a) for a in args.values())
