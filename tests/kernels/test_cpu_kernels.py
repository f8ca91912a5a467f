"""The C kernels of kernels/cpu against the PyTorch references they stand in for."""
import math

import numpy as np
import pytest
import torch

import kernels
from engine.model_executor.layers.attention import AttentionBackend, AttentionMetadata, default_backend
from kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"no C kernels here: {cpu.load()}")


def _batch(gen, q_lens, ctx_lens, num_q_heads=4, num_kv_heads=4, head_size=32, block_size=16, num_blocks=64):
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    per_req = [-(-s // block_size) for s in seq_lens]
    perm = torch.randperm(num_blocks - 1, generator=gen)[:sum(per_req)] + 1  # block 0: the null block
    tables = torch.zeros(len(q_lens), max(per_req), dtype=torch.int32)
    at = 0
    for r, n in enumerate(per_req):
        tables[r, :n] = perm[at:at + n]
        at += n
    cache = [torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=gen) for _ in range(2)]
    qkv = torch.randn(sum(q_lens), 3, num_q_heads, head_size, generator=gen)  # the query a strided view, as in a model
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    return qkv.unbind(1)[0], cache, qsl, torch.tensor(seq_lens, dtype=torch.int32), tables


@pytest.mark.parametrize("q_lens, ctx_lens, heads, window, sinks", [
    ([1] * 9, [0, 5, 15, 16, 17, 40, 63, 1, 30], (4, 4), None, False),  # decodes
    ([3, 8, 1, 20], [10, 0, 33, 5], (4, 4), None, False),  # short queries, and a chunk
    ([1, 4, 1], [50, 20, 7], (8, 2), None, False),  # grouped-query attention
    ([1, 1, 6], [60, 3, 40], (4, 4), 8, False),  # a sliding window
    ([1, 2, 1], [25, 9, 0], (4, 2), 16, True),  # attention sinks (gpt-oss), with a window
])
def test_attention_matches_reference(q_lens, ctx_lens, heads, window, sinks):
    gen = torch.Generator().manual_seed(sum(q_lens) + sum(ctx_lens))
    q, (kc, vc), qsl, lens, tables = _batch(gen, q_lens, ctx_lens, *heads)
    scale = 1 / math.sqrt(q.shape[-1])
    extra = {"sliding_window": window} if window else {}
    if sinks:
        extra["sinks"] = torch.randn(heads[0], generator=gen)
    want = kernels.unified_attention_ref(q, kc, vc, qsl, lens, tables, scale, **extra)
    out = torch.full_like(want, float("nan"))
    got = cpu.cpu_attention_with_kv_cache(q, kc, vc, qsl, lens, tables, scale, np.arange(len(q_lens)), out, **extra)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_attention_writes_only_the_requests_it_is_given():
    gen = torch.Generator().manual_seed(3)
    q, (kc, vc), qsl, lens, tables = _batch(gen, [1, 5, 1], [9, 12, 30])
    out = torch.zeros(q.shape)
    cpu.cpu_attention_with_kv_cache(q, kc, vc, qsl, lens, tables, 0.2, np.array([0, 2]), out)
    assert out[1:6].abs().sum() == 0 and out[0].abs().sum() > 0 and out[6].abs().sum() > 0


def _metadata(qsl, lens, tables, slot_mapping):
    return AttentionMetadata(slot_mapping=slot_mapping, query_start_loc=qsl, seq_lens=lens, block_tables=tables,
                             max_query_len=int((qsl[1:] - qsl[:-1]).max()), max_seq_len=int(lens.max()))


def test_backend_splits_a_mixed_batch_between_c_and_the_reference():
    """Decodes and short queries to the C kernel, a long prefill chunk to SDPA: the same output as the
    torch backend, and the cache written the same."""
    gen = torch.Generator().manual_seed(5)
    q_lens, ctx_lens = [1, 30, 1, 4], [20, 0, 47, 11]
    q, (kc, vc), qsl, lens, tables = _batch(gen, q_lens, ctx_lens)
    k, v = (torch.randn(q.shape, generator=gen) for _ in range(2))
    slots = torch.tensor([int(tables[r, p // 16]) * 16 + p % 16 for r in range(4)
                          for p in range(ctx_lens[r], ctx_lens[r] + q_lens[r])])
    outs, caches = [], []
    for name in ("torch", "cpu"):
        backend, meta, cache = AttentionBackend(name), _metadata(qsl, lens, tables, slots), (kc.clone(), vc.clone())
        backend.prepare(meta, 16)
        launches = []
        with kernels.instrument.observe(launches.append):
            outs.append(backend.forward(q, k, v, *cache, meta, 0.25))
        caches.append(cache)
        if name == "cpu":
            assert [r.name for r in launches] == ["reshape_and_cache_ref", "cpu_attention_with_kv_cache",
                                                  "unified_attention_ref"]
            assert meta.plan.short.tolist() == [0, 2, 3]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(*caches))


def _logits(gen, rows, vocab, spread):
    return torch.randn(rows, vocab, generator=gen) * spread


@pytest.mark.parametrize("seed", range(6))
def test_gumbel_draws_the_references_token(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = 1 + seed * 7, [7, 500, 4096, 4097, 50, 3000][seed]
    logits = _logits(gen, rows, vocab, [0.1, 1.0, 3.0, 10.0, 100.0, 1.0][seed])
    logits[0, : vocab // 2] = -float("inf")  # a constrained row
    if rows > 2:
        logits[1] = -float("inf")  # nothing allowed: token 0, as the kernel's
        logits[2] = 0.0  # flat: many candidates
    seeds, pos = torch.randint(0, 2 ** 62, (rows,), generator=gen), torch.randint(0, 9999, (rows,), generator=gen)
    for stream in (0, 2):
        want = kernels.gumbel_sample_ref(logits, seeds, pos, stream)
        assert torch.equal(cpu.gumbel_sample(logits, seeds, pos, stream), want)


def test_gumbel_grows_its_buffer_for_flat_rows():
    """Uniform rows have ~1/64 of their tokens within reach: more than the first buffer holds."""
    logits = torch.zeros(16, 8192)
    seeds, pos = torch.arange(16), torch.full((16,), 3)
    assert torch.equal(cpu.gumbel_sample(logits, seeds, pos), kernels.gumbel_sample_ref(logits, seeds, pos))


def test_gumbel_of_no_rows():
    assert cpu.gumbel_sample(torch.zeros(0, 10), torch.zeros(0), torch.zeros(0)).shape == (0,)


def test_default_backend_on_a_cpu():
    assert default_backend(torch.device("cpu")) == "cpu"
    assert default_backend(torch.device("cpu"), torch.bfloat16) == "torch"  # the C kernels are float32


def test_without_a_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("VLLM_TRACE_CACHE_DIR", str(tmp_path))
    cpu.load.cache_clear()
    try:
        assert not cpu.available() and "no C compiler" in cpu.load()
        assert default_backend(torch.device("cpu")) == "torch"
        with pytest.raises(RuntimeError, match="attention_backend='torch'"):
            AttentionBackend("cpu")
    finally:
        monkeypatch.undo()
        cpu.load.cache_clear()
    assert cpu.available()


def test_builds_into_its_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_TRACE_CACHE_DIR", str(tmp_path))
    cpu.load.cache_clear()
    try:
        assert cpu.available()
        assert [p.suffix for p in tmp_path.iterdir()] == [".so"]
    finally:
        monkeypatch.undo()
        cpu.load.cache_clear()


def test_the_cpu_backend_says_what_it_runs():
    from engine import LLM
    with pytest.raises(ValueError, match="attention_backend='cpu' runs float32 models on a CPU"):
        LLM("tiny-gpt2", dtype="bfloat16", attention_backend="cpu")


def test_a_read_only_cache_dir_builds_in_the_temporary_directory(monkeypatch, tmp_path):
    build = cpu._build

    def read_only_home(cc, target):
        if (tmp_path / "home") in target.parents:
            raise PermissionError(13, "Permission denied", str(target.parent))
        build(cc, target)

    monkeypatch.setenv("VLLM_TRACE_CACHE_DIR", str(tmp_path / "home"))
    monkeypatch.setattr(cpu, "_build", read_only_home)
    monkeypatch.setattr(cpu.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    cpu.load.cache_clear()
    try:
        assert cpu.available() and list((tmp_path / "tmp").glob("vllm-trace-*/cpu_kernels-*.so"))
    finally:
        monkeypatch.undo()
        cpu.load.cache_clear()


def test_a_compiler_without_openmp_builds_them_single_threaded(monkeypatch, tmp_path):
    cc = tmp_path / "cc-without-openmp"
    cc.write_text('#!/bin/sh\ncase "$*" in *-fopenmp*) echo "no OpenMP here" >&2; exit 1;; esac\nexec cc "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("VLLM_TRACE_CACHE_DIR", str(tmp_path / "cache"))
    cpu.load.cache_clear()
    try:
        assert cpu.available()
        test_attention_matches_reference([1, 4, 1], [50, 20, 7], (8, 2), None, False)
    finally:
        monkeypatch.undo()
        cpu.load.cache_clear()
