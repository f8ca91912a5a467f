"""PyTorch reference implementations of the paged-attention kernels.

These define the semantics the Triton kernels must match, and they are also the engine's
``torch`` attention backend, so they are written to be reasonably fast on the CPU.

Layouts (vLLM v1):
  key, value            [num_tokens, num_kv_heads, head_size]       new K/V of this step
  key_cache, value_cache[num_blocks, block_size, num_kv_heads, head_size]
  slot_mapping          [num_tokens] int, slot = block * block_size + offset; < 0 = padding
  query                 [num_tokens, num_q_heads, head_size]        flattened new tokens
  query_start_loc       [num_seqs + 1] int32, request i owns query rows qsl[i]:qsl[i+1]
  seq_lens              [num_seqs] int32, context + new tokens of request i
  block_tables          [num_seqs, max_blocks] int32, logical -> physical block
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K and V into its slot of the paged cache (in place)."""
    num_blocks, block_size = key_cache.shape[:2]
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:  # one op when nothing is padded
        valid = slot_mapping >= 0
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    slots = slot_mapping.long()
    # A view of the cache as [num_slots, heads, head_size] makes the write one index_copy.
    key_cache.view(num_blocks * block_size, *key_cache.shape[2:]).index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.view(num_blocks * block_size, *value_cache.shape[2:]).index_copy_(0, slots, value.to(value_cache.dtype))


@dataclass
class AttentionGroup:
    """Requests attended as one padded batch: n requests of up to q query rows each, over up
    to kv keys (whole blocks). Padded query rows repeat a real row; their output is dropped."""

    n: int
    q: int
    kv: int
    blocks: torch.Tensor  # [n * kv // block_size] physical blocks, padded with block 0
    mask: torch.Tensor  # [n, 1, q, kv] additive fp32: 0 where a query row may see a key, else -inf
    span: tuple[int, int] | None  # its rows are query[s:e] exactly, n * q of them (no padding)
    src: torch.Tensor | None  # else: [n * q] query row of each padded row
    keep: torch.Tensor | None  # padded rows that are real ...
    dst: torch.Tensor | None  # ... and the query rows they are


class Workspace:
    """Scratch tensors reused from call to call. The gathered K/V of a decode batch are
    megabytes; allocated fresh for every layer of every step, each one costs page faults (the
    allocator returns large blocks to the OS on free) that took longer than the copy itself:
    3.6x as long for the gather at batch 32, measured."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            # a quarter to spare: contexts grow a block at a time
            buf = self._buffers[name] = torch.empty(numel + numel // 4, dtype=like.dtype, device=like.device)
        return buf[:numel].view(shape)


@dataclass
class AttentionPlan:
    """Host-side indexing for one batch, shared by every layer of a step (same metadata)."""

    groups: list[AttentionGroup]
    # with short_apart: the requests of at most SHORT_QUERY query rows, for a kernel that takes them a
    # row at a time (kernels/cpu); `groups` are then the longer ones only. Each part's requests, as a
    # launch's meta (kernels/op_cost.py counts their work): the short ones', the groups'.
    short: np.ndarray | None = None
    launch_meta: tuple[dict, dict] = ({}, {})


# Queries of at most this many rows (a decode verifying its speculative drafts) form one group,
# padded to the longest: on 16-20 requests verifying 1-4 drafts each, one call per layer instead
# of 2-4 groups of similar lengths measured 13-17 % less attention time (a call's fixed cost
# outweighs the padded rows' arithmetic at this size).
SHORT_QUERY = 8


def plan_attention(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                   block_size: int, sliding_window: int | None = None, short_apart: bool = False) -> AttentionPlan:
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    q_lens = [b - a for a, b in zip(qsl, qsl[1:])]
    short = None
    if short_apart:
        short = np.array([i for i, n in enumerate(q_lens) if n <= SHORT_QUERY], np.int32)
        q_lens = [n if n > SHORT_QUERY else 0 for n in q_lens]  # (a length of 0 is in no group)
    # Decodes form one group (splitting them by context length measured no faster). Prefill
    # chunks, by length, form groups as long as padding them to a common shape costs at most
    # 1.5x their real attention work: few large ops beat many small ones on the CPU, but one
    # long prompt must not pad every short one to its length.
    groups = [[i for i, n in enumerate(q_lens) if n == 1], [i for i, n in enumerate(q_lens) if 1 < n <= SHORT_QUERY],
              []]
    for i in sorted((i for i, n in enumerate(q_lens) if n > SHORT_QUERY), key=lambda i: lens[i]):
        g = groups[-1] + [i]
        if len(g) > 1 and len(g) * max(q_lens[j] for j in g) * lens[i] <= 1.5 * sum(q_lens[j] * lens[j] for j in g):
            groups[-1] = g
        else:
            groups.append([i])
    groups = [g for g in groups if g]
    tables = block_tables.cpu().numpy()
    meta = ({}, {})
    if short_apart:
        meta = ({"requests": short.tolist()}, {"requests": sorted(i for g in groups for i in g)})
    return AttentionPlan([_group(g, qsl, q_lens, lens, tables, block_size, block_tables.device, sliding_window)
                          for g in groups], short, meta)


def _group(reqs: list[int], qsl: list[int], q_lens: list[int], lens: list[int], tables: np.ndarray,
           block_size: int, device: torch.device, sliding_window: int | None = None) -> AttentionGroup:
    # Built with numpy: on these small arrays it costs a fraction of the same torch ops.
    n, q = len(reqs), max(q_lens[i] for i in reqs)
    nblk = -(-max(lens[i] for i in reqs) // block_size)
    seq, qn = np.array([lens[i] for i in reqs])[:, None], np.array([q_lens[i] for i in reqs])[:, None]
    # Entries past a request's own blocks may be stale: read block 0 there (masked off) instead.
    blocks = np.where(np.arange(nblk) < -(-seq // block_size), tables[reqs, :nblk], 0)
    # Query row i (at position ctx + i) sees keys up to there; a padded row (i >= its q_len)
    # sees all keys, so no row is fully masked.
    rows = np.arange(q)
    last = np.minimum(seq - qn + rows, seq - 1)  # [n, q]
    # Additive float mask: SDPA turns a boolean one into this on every call (every layer).
    keys = np.arange(nblk * block_size)
    visible = keys <= last[:, None, :, None]
    if sliding_window:  # and no further back than the window (blocks before it may be another request's now)
        visible &= keys > last[:, None, :, None] - sliding_window
    mask = np.where(visible, np.float32(0), np.float32(-np.inf))
    span = src = keep = dst = None
    if reqs == list(range(reqs[0], reqs[-1] + 1)) and all(q_lens[i] == q for i in reqs):
        span = (qsl[reqs[0]], qsl[reqs[-1] + 1])
    else:
        start = np.array([qsl[i] for i in reqs])[:, None]
        real = rows < qn
        src, keep, dst = (_tensor(x, device) for x in (
            (start + np.minimum(rows, qn - 1)).ravel(), real.ravel().nonzero()[0], (start + rows)[real]))
    return AttentionGroup(n, q, nblk * block_size, _tensor(blocks.ravel(), device), _tensor(mask, device),
                          span, src, keep, dst)


def _tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(a.astype(np.int64) if a.dtype.kind in "iu" else a).to(device)


def unified_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    plan: AttentionPlan | None = None,
    workspace: Workspace | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole (paged) context.

    Query row i of request r sits at absolute position ``p = context_len + i`` where
    ``context_len = seq_len - query_len``; it sees keys at positions ``<= p`` (with a sliding
    window, only those ``> p - sliding_window``: the block table may hold the null block before).
    ``sinks`` [num_q_heads] (gpt-oss): head h's softmax has one more column, of logit sinks[h]
    and no value, so its weights over the keys sum to less than 1.
    Softmax is computed in fp32. ``plan`` (from ``plan_attention``) may be passed to reuse
    the indexing across layers, and ``workspace`` to gather K/V into reused buffers.
    """
    num_tokens, num_q_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1:3]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if plan is None:
        plan = plan_attention(query_start_loc, seq_lens, block_tables, block_size, sliding_window)
    for g in plan.groups:
        q = query[g.span[0]:g.span[1]] if g.span else query.index_select(0, g.src)
        # Whole blocks are gathered (one index_select copying block_size contiguous rows per
        # index, cheaper than one per slot); the mask hides keys past each request's length.
        k, v = (_gather(cache, g.blocks, workspace, name) for cache, name in ((key_cache, "k"), (value_cache, "v")))
        k = k.view(g.n, g.kv, num_kv_heads, head_size).transpose(1, 2).float()
        v = v.view(g.n, g.kv, num_kv_heads, head_size).transpose(1, 2).float()
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        mask = g.mask
        if sinks is not None:  # the sink as one more key: k = 0 and v = 0, its logit (0 · scale + mask) the sink's
            k, v = F.pad(k, (0, 0, 0, 1)), F.pad(v, (0, 0, 0, 1))
            mask = torch.cat([mask.expand(g.n, num_q_heads, g.q, g.kv),
                              sinks.float().view(1, -1, 1, 1).expand(g.n, -1, g.q, 1)], dim=-1)
        o = F.scaled_dot_product_attention(q.view(g.n, g.q, num_q_heads, head_size).transpose(1, 2).float(),
                                           k, v, attn_mask=mask, scale=scale)  # [n, Hq, q, D]
        o = o.transpose(1, 2).to(out.dtype)
        if g.span:
            out[g.span[0]:g.span[1]].view_as(o).copy_(o)
        else:
            out.index_copy_(0, g.dst, o.reshape(g.n * g.q, num_q_heads, head_size).index_select(0, g.keep))
    return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor, workspace: Workspace | None, name: str) -> torch.Tensor:
    if workspace is None:
        return cache.index_select(0, blocks)
    return torch.index_select(cache, 0, blocks, out=workspace.get(name, (len(blocks), *cache.shape[1:]), cache))


def rejection_sample_ref(draft_token_ids: torch.Tensor, cu_num_drafts: torch.Tensor, target_argmax: torch.Tensor,
                         target_probs: torch.Tensor, draft_probs: torch.Tensor, uniform: torch.Tensor,
                         recovered_token_ids: torch.Tensor, bonus_token_ids: torch.Tensor,
                         is_greedy: torch.Tensor, max_drafts: int) -> torch.Tensor:
    """Speculative decoding's acceptance walk (see kernels/rejection_sample.py), in plain Python:
    per request, accept drafts while the target agrees (greedy: its argmax; else u * q < p), put
    the recovered token at the first rejection, or the bonus token after an all-accepted run."""
    # Python lists, read once: indexing a tensor element by element costs a microsecond each
    drafts, cu, best, greedy = (t.tolist() for t in (draft_token_ids, cu_num_drafts, target_argmax, is_greedy))
    p, q, u, recovered = (t.tolist() for t in (target_probs, draft_probs, uniform, recovered_token_ids))
    out = [[-1] * (max_drafts + 1) for _ in range(len(cu) - 1)]
    for r, row in enumerate(out):
        for j, i in enumerate(range(cu[r], cu[r + 1])):
            draft = drafts[i]
            accept = draft == best[i] if greedy[r] else u[i] * q[i] < p[i]
            row[j] = draft if accept else recovered[i]
            if not accept:
                break
        else:
            row[cu[r + 1] - cu[r]] = int(bonus_token_ids[r])
    return torch.tensor(out, dtype=torch.int64, device=draft_token_ids.device)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor) -> None:
    """Structured outputs' grammar mask (in place): row ``indices[i]`` of logits keeps token t only
    if bit t % 32 of word t // 32 of ``bitmask[i]`` is set; every other token becomes -inf.

    logits [num_seqs, vocab] float; bitmask [n, ceil(vocab / 32)] int32 (xgrammar's packing);
    indices [n] int, the logits row of each bitmask row."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, :vocab].bool()
    rows = indices.long()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


# Philox 4x32-10 as Triton's ``tl.randint4x`` computes it (triton/language/random.py), in numpy uint64
# holding uint32 values (a product of two uint32 fits 64 bits: its high word is umulhi); numpy's integer
# ops measured 4x faster than torch's here.
_MASK32 = np.uint64(0xFFFFFFFF)
_PHILOX_KEY_A, _PHILOX_KEY_B = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_PHILOX_ROUND_A, _PHILOX_ROUND_B = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_32 = np.uint64(32)


def philox_ref(seed: torch.Tensor, offset: torch.Tensor, n_rounds: int = 10) -> tuple[torch.Tensor, ...]:
    """The four uint32 words (as int64) of Triton's ``tl.randint4x(seed, offset)``, elementwise:
    seed int64 (its 64 bits are the key), offset int64 >= 0 (the counter's low and high words)."""
    seed, offset = torch.broadcast_tensors(seed.to(torch.int64).cpu(), offset.to(torch.int64).cpu())
    seed = np.ascontiguousarray(seed.numpy()).view(np.uint64)
    offset = np.ascontiguousarray(offset.numpy()).view(np.uint64)
    k0, k1 = seed & _MASK32, (seed >> _32) & _MASK32
    c0, c1 = offset & _MASK32, (offset >> _32) & _MASK32
    c2, c3 = np.zeros_like(c0), np.zeros_like(c0)
    for _ in range(n_rounds):
        prod_b, prod_a = _PHILOX_ROUND_B * c2, _PHILOX_ROUND_A * c0
        c0, c2 = (prod_b >> _32) ^ c1 ^ k0, (prod_a >> _32) ^ c3 ^ k1
        c1, c3 = prod_b & _MASK32, prod_a & _MASK32
        k0, k1 = (k0 + _PHILOX_KEY_A) & _MASK32, (k1 + _PHILOX_KEY_B) & _MASK32
    return tuple(torch.from_numpy(c.astype(np.int64)) for c in (c0, c1, c2, c3))


def uint32_to_uniform_ref(x: torch.Tensor) -> torch.Tensor:
    """Triton's ``uint_to_uniform_float`` for uint32 words: a float32 in [0, 1)."""
    x = torch.where(x >= 2 ** 31, x - 2 ** 32, x)  # bitcast to int32
    x = torch.where(x < 0, -x - 1, x)
    return x.to(torch.float32) * 4.6566127342e-10


def rand_ref(seeds: torch.Tensor, positions: torch.Tensor, stream: int = 1) -> torch.Tensor:
    """One uniform in [0, 1) per (seed, position): word ``stream`` of Philox(seed, position)
    (speculative decoding's acceptance draws use stream 1)."""
    return uint32_to_uniform_ref(philox_ref(seeds, positions)[stream])


# MurmurHash3's 32-bit mix and finaliser on numpy uint32 (arithmetic wraps mod 2**32, as Triton's uint32),
# the hash vLLM 0.33's Gumbel sampler draws its noise from (kernels/gumbel_sample.py). Measured on the
# 2-core CPU, one row of 4,096 tokens: 1.3 ms with Philox 4x32-10 in numpy, 0.1 ms with this hash.
_MM3_C1, _MM3_C2 = np.uint32(0xCC9E2D51), np.uint32(0x1B873593)
# Tokens of noise computed at once: 32 rows x 4,096 took 0.60 ms a draw at 1 << 15, 0.45 at 1 << 17 (four
# chunks a step paid each numpy op's fixed cost four times), and 2.5 ms for 64 rows at 1 << 19 (out of the cache).
_NOISE_CHUNK = 1 << 17


def _rotl32(x: np.ndarray, shift: int) -> np.ndarray:
    return (x << np.uint32(shift)) | (x >> np.uint32(32 - shift))


def _murmur3_key(key: np.ndarray) -> np.ndarray:
    """A key's own part of the mix (nothing of the hash so far in it)."""
    return _rotl32(key * _MM3_C1, 15) * _MM3_C2


def _murmur3_mix(h: np.ndarray, key: np.ndarray) -> np.ndarray:
    return _rotl32(h ^ _murmur3_key(key), 13) * np.uint32(5) + np.uint32(0xE6546B64)


def murmur3_hash32_ref(seed: np.ndarray, pos: np.ndarray, offset: np.ndarray, domain: int = 0) -> np.ndarray:
    """vLLM's ``murmur3_hash32``: uint32 of (seed int64, pos int64, offset uint32, domain), broadcast.
    The seed and position are mixed at their own shape (a row's), the offset (a token) last."""
    with np.errstate(over="ignore"):  # uint32 arithmetic wraps by design (numpy warns only for scalars)
        return _murmur3_last(_murmur3_rows(seed, pos, domain), _murmur3_key(np.asarray(offset, np.uint32)))


def _murmur3_rows(seed: np.ndarray, pos: np.ndarray, domain: int) -> np.ndarray:
    """The hash after the seed and position are mixed in (at their shape: a row's)."""
    s, p = np.asarray(seed, np.int64).view(np.uint64), np.asarray(pos, np.int64).view(np.uint64)
    h = np.full(s.shape, domain, np.uint32)
    h = _murmur3_mix(h, (s & _MASK32).astype(np.uint32))
    h = _murmur3_mix(h, (s >> _32).astype(np.uint32))
    return _murmur3_mix(h, (p & _MASK32).astype(np.uint32))


@functools.lru_cache(maxsize=4)
def _token_keys(vocab: int) -> np.ndarray:
    """_murmur3_key of every token id [1, vocab]: the same for every draw (read-only, shared)."""
    keys = _murmur3_key(np.arange(vocab, dtype=np.uint32))[None]
    keys.flags.writeable = False
    return keys


def _murmur3_last(h: np.ndarray, key: np.ndarray) -> np.ndarray:
    """The last mix (of a key's own part, from _murmur3_key) and the finaliser, broadcast: h [rows, 1]
    and keys [1, vocab] -> [rows, vocab]. In place on two arrays of that shape (written as expressions,
    each of these 14 ops allocated one more: 155 us against 121 us for 32 rows x 4,096 tokens)."""
    x = np.asarray(h ^ key)  # (an array even for scalars: the ops below write into it)
    y = np.empty_like(x)
    np.left_shift(x, np.uint32(13), out=y)
    np.right_shift(x, np.uint32(19), out=x)
    x |= y
    x *= np.uint32(5)
    x += np.uint32(0xE6546B64)
    x ^= np.uint32(16)  # the length, in bytes, of what was hashed
    for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35), (16, None)):  # fmix32
        np.right_shift(x, np.uint32(shift), out=y)
        x ^= y
        if mult is not None:
            x *= np.uint32(mult)
    return x


def murmur3_uniform32_ref(random32: np.ndarray) -> np.ndarray:
    """vLLM's ``murmur3_uniform32``: (random32 + 0.5) / 2**32 in float32, from its two 16-bit halves."""
    hi16 = (random32 >> np.uint32(16)).astype(np.float32)
    lo16 = (random32 & np.uint32(0xFFFF)).astype(np.float32)
    return hi16 * np.float32(1.52587890625e-05) + (lo16 + np.float32(0.5)) * np.float32(2.3283064365386963e-10)


def gumbel_noise_ref(u: np.ndarray) -> np.ndarray:
    """-log(-log(1 - u)) in float32 as vLLM computes it: log(1 - u) by a series below 0.25, so the
    winning tail (u -> 0) keeps its precision."""
    poly = np.float32(1.0 / 8.0)
    for c in (7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0):
        poly = np.float32(1.0 / c) + u * poly
    series = -u * poly
    direct = np.log(np.maximum(np.float32(1.0) - u, np.float32(5.960464477539063e-08)))
    return -np.log(-np.where(u < np.float32(0.25), series, direct))


def gumbel_sample_ref(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                      stream: int = 0) -> torch.Tensor:
    """One token per row of logits [num_rows, vocab]: argmax(logits + Gumbel noise), the noise of
    token t in row i hashed from (seeds[i], positions[i], t) with domain ``stream`` (see
    kernels/gumbel_sample.py), so a draw from softmax(row) that depends on nothing else.

    The kernel computes every token's noise; this reference finds the same token computing it only
    for the tokens that can win (:func:`_gumbel_argmax`)."""
    if logits.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    rows, vocab = logits.shape
    seeds = seeds.to(torch.int64).cpu().numpy().reshape(rows, 1)
    pos = positions.to(torch.int64).cpu().numpy().reshape(rows, 1)
    scores = logits.float().cpu().numpy()
    best = np.empty(rows, np.int64)
    step = max(1, _NOISE_CHUNK // vocab)
    for r in range(0, rows, step):  # rows a chunk at a time: each op's operands stay in the cache
        hashes = _murmur3_last(_murmur3_rows(seeds[r:r + step], pos[r:r + step], stream), _token_keys(vocab))
        best[r:r + step] = _gumbel_argmax(scores[r:r + step], hashes)
    return torch.from_numpy(best).to(logits.device)


# Tokens whose hash is below 2**26 have u <= 1/64, so noise >= -log(-log(1 - 1/64)) = 4.1509 (float32 rounding
# included, 4.15): the likely winners, whose logits give a first bound.
_LIKELY, _LIKELY_NOISE = np.uint32(1 << 26), np.float32(4.15)


def _gumbel_argmax(scores: np.ndarray, hashes: np.ndarray) -> np.ndarray:
    """Each row's argmax(scores + noise(hashes)), lowest token on ties, as the dense computation
    gives it, with the noise (two logs a token) computed only for the few tokens that can win:

    1. The best logit among the likely winners (u <= 1/64) plus 4.15 is a score S that some token
       reaches, so the winner reaches it too.
    2. Token t reaches S only if its noise g_t >= S - x_t, that is u_t <= 1 - exp(-exp(x_t - S))
       <= exp(x_t - S). Its hash is compared with that bound (with a margin for float32's rounding);
       the tokens within it, a handful a row, are scored exactly."""
    likely = np.max(scores, axis=-1, where=hashes < _LIKELY, initial=np.float32(-np.inf))  # (no temporary)
    reach = likely + _LIKELY_NOISE - (np.float32(1e-2) + np.float32(1e-6) * np.abs(likely))
    with np.errstate(invalid="ignore", over="ignore"):  # -inf - -inf: a row with nothing allowed, no candidates
        bound = scores - reach[:, None]  # (token 0); above 0 (bound > 2**32: inf at worst) every hash is within
        np.exp(bound, out=bound)
        bound *= np.float32(2.0 ** 32)
    flat = np.flatnonzero(hashes.astype(np.float32) <= bound)  # row-major: rows, then tokens, ascending
    return _gumbel_winners(scores, flat, hashes.ravel()[flat])


def _gumbel_winners(scores: np.ndarray, flat: np.ndarray, hashes: np.ndarray) -> np.ndarray:
    """Each row's winner among its candidates (flat indices into scores [rows, vocab], ascending, and
    their hashes), each scored exactly: its logit plus its noise. A row with none: token 0."""
    r, c = np.divmod(flat, scores.shape[1])
    total = scores.ravel()[flat] + gumbel_noise_ref(murmur3_uniform32_ref(hashes))
    top = np.full(len(scores), -np.inf, np.float32)
    np.maximum.at(top, r, total)
    winners = total == top[r]
    wr, wc = r[winners], c[winners]
    first = np.ones(len(wr), bool)  # a row's first winner is its lowest token
    first[1:] = wr[1:] != wr[:-1]
    best = np.zeros(len(scores), np.int64)  # a row of -inf logits: token 0, as the kernel's
    best[wr[first]] = wc[first]
    return best


# ---- input building (kernels/input_batch.py, kernels/block_table.py) ----------------------------
# Host-side index arithmetic, as plan_attention's: numpy on the tensors' memory (a CPU tensor's
# .numpy() is a view; a GPU tensor is copied), vectorised, no Python loop per request or token.
# Each torch op costs microseconds of dispatch whatever its size (5-45 us measured on a loaded
# 2-core CPU, numpy's 1-3 us): with torch ops the first version of these four took ~3 ms a step
# at batch-32 decode; as they are, building a step's inputs takes 250-470 us of CPU there. A batch
# of decodes (one token per row) skips the token -> row mapping; rows have at least one token
# each (a scheduled request has).

def _host(t: torch.Tensor) -> np.ndarray:
    return t.cpu().numpy() if t.is_cuda else t.numpy()


def _store(out: torch.Tensor, start: int, stop: int | None, values) -> None:
    """out[start:stop] = values (a numpy array or a scalar), in place."""
    if out.is_cuda:
        out[start:stop] = torch.as_tensor(values, device=out.device)
    else:
        out.numpy()[start:stop] = values


def _rows(query_start_loc: torch.Tensor, num_reqs: int) -> tuple[np.ndarray, int, np.ndarray | None]:
    """(the rows' query_start_loc, number of tokens, each token's batch row; None when every row
    has one token: token i is row i)."""
    qsl = _host(query_start_loc)[:num_reqs + 1]
    n = int(qsl[-1])
    return qsl, n, None if n == num_reqs else np.repeat(np.arange(num_reqs), np.diff(qsl))


def _positions(start: np.ndarray, qsl: np.ndarray, n: int, rows: np.ndarray | None) -> np.ndarray:
    """Each token's position: its row's start plus its offset in the row."""
    return start if rows is None else np.arange(n) + (start - qsl[:-1])[rows]


def prepare_prefill_inputs_ref(input_ids: torch.Tensor, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                               all_token_ids: torch.Tensor, prefill_len: torch.Tensor,
                               num_computed_tokens: torch.Tensor, draft_tokens: torch.Tensor) -> None:
    """Each token's input id, in place: row i's token j is at position p = num_computed_tokens[s] + j
    of its slot s = idx_mapping[i]; all_token_ids[s, p] below prefill_len[s] (the tokens the slot
    holds), draft_tokens[i, p - prefill_len[s]] after (the drafts it verifies)."""
    idx = _host(idx_mapping)
    qsl, n, rows = _rows(query_start_loc, len(idx))
    slots = idx if rows is None else idx[rows]
    pos = _positions(_host(num_computed_tokens)[idx], qsl, n, rows)
    past = pos - _host(prefill_len)[slots]  # >= 0: a draft's index
    buffer = _host(all_token_ids)
    ids = buffer[slots, np.minimum(pos, buffer.shape[1] - 1)]
    if n and past.max() >= 0:  # drafts to verify
        drafts = _host(draft_tokens)
        row = np.arange(n) if rows is None else rows
        ids = np.where(past < 0, ids, drafts[row, np.clip(past, 0, drafts.shape[1] - 1)])
    _store(input_ids, 0, n, ids)


def prepare_pos_seq_lens_ref(idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                             num_computed_tokens: torch.Tensor, pos: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """In place: each token's position (its slot's num_computed_tokens + its offset in the row) and
    each row's seq_len (num_computed_tokens + query length); seq_lens past num_reqs (padding) get 0."""
    idx = _host(idx_mapping)
    num_reqs = len(idx)
    qsl, n, rows = _rows(query_start_loc, num_reqs)
    start = _host(num_computed_tokens)[idx]
    _store(pos, 0, n, _positions(start, qsl, n, rows))
    _store(seq_lens, 0, num_reqs, start + np.diff(qsl))
    if seq_lens.shape[0] > num_reqs:
        _store(seq_lens, num_reqs, None, 0)


def gather_block_tables_ref(idx_mapping: torch.Tensor, block_tables: torch.Tensor, num_blocks: torch.Tensor,
                            out: torch.Tensor) -> None:
    """In place: out[i] = the first num_blocks[s] entries of block_tables[s] (s = idx_mapping[i]),
    then the null block (0) to out's width; rows past num_reqs (padding) all 0."""
    idx = _host(idx_mapping)
    width = out.shape[1]
    rows = _host(block_tables)[idx, :width]
    rows[np.arange(width) >= _host(num_blocks)[idx][:, None]] = 0
    _store(out, 0, len(idx), rows)
    if out.shape[0] > len(idx):
        _store(out, len(idx), None, 0)


def compute_slot_mappings_ref(idx_mapping: torch.Tensor, query_start_loc: torch.Tensor, positions: torch.Tensor,
                              block_tables: torch.Tensor, block_size: int, slot_mapping: torch.Tensor) -> None:
    """In place: slot_mapping[t] = block_tables[s, pos // block_size] * block_size + pos % block_size
    for each token t of row i (s = idx_mapping[i], pos = positions[t]); -1 (PAD_SLOT_ID) for a
    padding row's tokens (negative s) and for the entries past the batch's tokens."""
    idx = _host(idx_mapping)
    _, n, rows = _rows(query_start_loc, len(idx))
    slots = idx if rows is None else idx[rows]
    pos = _host(positions)[:n]
    blocks = _host(block_tables)[np.maximum(slots, 0), pos // block_size].astype(np.int64)
    _store(slot_mapping, 0, n, np.where(slots >= 0, blocks * block_size + pos % block_size, -1))
    if slot_mapping.shape[0] > n:
        _store(slot_mapping, n, None, -1)


def post_update_ref(idx_mapping: torch.Tensor, num_computed_tokens: torch.Tensor, sampled_tokens: torch.Tensor,
                    num_sampled: torch.Tensor, num_rejected: torch.Tensor, query_start_loc: torch.Tensor,
                    all_token_ids: torch.Tensor, total_len: torch.Tensor) -> None:
    """In place, per batch row i of slot s = idx_mapping[i] (negative: skipped): its first
    num_sampled[i] tokens of sampled_tokens[i] written to all_token_ids[s] after its
    total_len[s] tokens, total_len[s] += num_sampled[i], num_computed_tokens[s] += its query
    length - num_rejected[i]. On the CPU through numpy views of the buffers (torch's dozen small
    ops here took ~0.2 ms a step at batch-32 decode, numpy's ~30 us); a GPU's buffers in place with torch."""
    if all_token_ids.is_cuda:
        return _post_update_torch(idx_mapping, num_computed_tokens, sampled_tokens, num_sampled, num_rejected,
                                  query_start_loc, all_token_ids, total_len)
    slots = idx_mapping.numpy().astype(np.int64)
    real = slots >= 0
    count = num_sampled.numpy().astype(np.int64)
    tokens = sampled_tokens.numpy()
    rows, cols = np.nonzero(np.arange(tokens.shape[1])[None, :] < count[:, None])
    keep = real[rows]
    rows, cols = rows[keep], cols[keep]
    dst = slots[rows]
    total, computed = total_len.numpy(), num_computed_tokens.numpy()
    all_token_ids.numpy()[dst, total[dst] + cols] = tokens[rows, cols]
    s = slots[real]
    total[s] += count[real].astype(total.dtype)
    query = np.diff(query_start_loc.numpy()[:len(slots) + 1].astype(np.int64))
    computed[s] += (query[real] - num_rejected.numpy()[real]).astype(computed.dtype)


def _post_update_torch(idx_mapping: torch.Tensor, num_computed_tokens: torch.Tensor, sampled_tokens: torch.Tensor,
                       num_sampled: torch.Tensor, num_rejected: torch.Tensor, query_start_loc: torch.Tensor,
                       all_token_ids: torch.Tensor, total_len: torch.Tensor) -> None:
    slots = idx_mapping.long()
    real = slots >= 0
    qsl = query_start_loc.long()
    count = num_sampled.long()
    rows, cols = (torch.arange(sampled_tokens.shape[1], device=count.device)[None, :] < count[:, None]).nonzero(
        as_tuple=True)
    keep = real[rows]
    rows, cols = rows[keep], cols[keep]
    dst = slots[rows]
    all_token_ids[dst, total_len.long()[dst] + cols] = sampled_tokens[rows, cols].to(all_token_ids.dtype)
    s = slots[real]
    total_len[s] += num_sampled[real].to(total_len.dtype)
    num_computed_tokens[s] += ((qsl[1:] - qsl[:-1])[real] - num_rejected.long()[real]).to(num_computed_tokens.dtype)


def fused_moe_ref(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None,
                  block_size: int = 16, w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                  activation: str = "silu", swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> torch.Tensor:
    """Each token through its top-k SwiGLU experts, summed with its routing weights:
    hidden_states [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], topk_weights
    and topk_ids [T, top_k] -> [T, H]. The (token, k) pairs sorted into expert blocks as the
    Triton kernel sorts them (moe_align_block_size); an expert's blocks are contiguous, so
    each expert's run of rows is two matmuls, one expert after another. (Batching the blocks
    through one bmm instead copies an expert's weights once per block: 2.7-6.7x slower on a CPU,
    benchmarks/moe.py.) expert_map (expert parallelism): w13 and w2 hold this rank's experts,
    topk_ids are global; the pairs routed to another rank's experts add nothing here.
    w13_bias [E, 2I], w2_bias [E, H] and activation="swigluoai": gpt-oss's experts (biased GEMMs,
    and the SwiGLU clamped, see :func:`swigluoai_and_mul_ref`)."""
    from kernels.moe_align_block_size import moe_align_block_size

    T, H = hidden_states.shape
    top_k = topk_ids.shape[1]
    n = T * top_k
    num_experts = w13.shape[0] if expert_map is None else expert_map.shape[0]
    sorted_ids, expert_ids, post_padded = moe_align_block_size(topk_ids, block_size, num_experts, expert_map)
    total = int(post_padded[0])
    pairs = sorted_ids[:total].long()
    row_expert = expert_ids[:total // block_size].long().repeat_interleave(block_size)
    keep = (pairs < n) & (row_expert >= 0)  # not padding, not another rank's expert
    pairs, row_expert = pairs[keep], row_expert[keep]
    experts, counts = torch.unique_consecutive(row_expert, return_counts=True)
    out = hidden_states.new_zeros(n, H)
    weights = topk_weights.reshape(-1).to(hidden_states.dtype)
    for e, rows in zip(experts.tolist(), pairs.split(counts.tolist())):
        b13, b2 = (None if b is None else b[e] for b in (w13_bias, w2_bias))
        gate, up = F.linear(hidden_states[rows // top_k], w13[e], b13).chunk(2, dim=-1)
        act = F.silu(gate) * up if activation == "silu" else swigluoai_and_mul_ref(gate, up, swiglu_alpha, swiglu_limit)
        out[rows] = F.linear(act, w2[e], b2) * weights[rows, None]
    return out.view(T, top_k, H).sum(dim=1)


def swigluoai_and_mul_ref(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU (vLLM's swigluoai_and_mul): the gate clamped above at limit, up to
    [-limit, limit], then (up + 1) · gate · sigmoid(alpha · gate)."""
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
