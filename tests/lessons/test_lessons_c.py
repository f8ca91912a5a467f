"""Lessons 15-16 and the null block: a lesson fails when the behaviour it teaches is broken on purpose."""
import importlib

import pytest

import lessons
from lessons.cli import main


def run_lesson(name: str) -> int:
    return main(vars(importlib.import_module(lessons.find(name).module)), ["--no-pause"])


def said(capsys) -> str:
    """The lesson's output with rich's line wrapping undone."""
    return " ".join(capsys.readouterr().out.split())


def test_paged_kv_cache_lesson_fails_if_block_0_is_handed_out(monkeypatch, capsys):
    """Break the block pool: block 0, the null block, goes back into the free queue."""
    from engine.core.block_pool import BlockPool
    original = BlockPool.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.free_block_queue[0] = None
        self.free_block_queue.move_to_end(0, last=False)

    monkeypatch.setattr(BlockPool, "__init__", init)
    assert run_lesson("paged_kv_cache") == 1
    assert "claims: block 0 is not in the free queue" in said(capsys)


@pytest.mark.slow
def test_stopping_lesson_fails_if_min_tokens_only_delays_the_stop(monkeypatch, capsys):
    """Break the sampler as it was before vLLM's rule: stop tokens are sampled below min_tokens
    (and merely not obeyed), instead of being masked out."""
    from engine.sample.sampler import Sampler
    monkeypatch.setattr(Sampler, "_block_stop_tokens", staticmethod(lambda logits, requests, rows: logits))
    assert run_lesson("when_a_request_stops") == 1
    assert "claims: with min_tokens=" in said(capsys)


def test_stopping_lesson_fails_if_streams_send_a_partial_stop_string(monkeypatch, capsys):
    from engine.entrypoints.openai.serving import StopHoldback
    monkeypatch.setattr(StopHoldback, "_held", lambda self, text: 0)
    assert run_lesson("when_a_request_stops") == 1
    assert "a prefix of the stop string: it was held back" in said(capsys)


@pytest.mark.slow
def test_latency_lesson_fails_if_the_chunk_size_is_ignored(monkeypatch, capsys):
    """Break the scheduler: every step may take a whole prompt, whatever max_num_batched_tokens says."""
    from engine.config import SchedulerConfig
    original = SchedulerConfig.__post_init__

    def post_init(self):
        original(self)
        self.max_num_batched_tokens = 4096

    monkeypatch.setattr(SchedulerConfig, "__post_init__", post_init)
    assert run_lesson("latency") == 1
    assert "the engine disagrees" in said(capsys)


@pytest.mark.slow
def test_stopping_lesson_holds_when_the_model_does_produce_eos(monkeypatch, capsys):
    """Greedy decoding of the built-in model may never produce EOS for the lesson's prompt. Make a
    token that greedy decoding does produce the EOS token, and the lesson's EOS branch must hold."""
    from engine import LLM, SamplingParams
    from engine.engine.core import EngineCore
    out = LLM("tiny-gpt2", num_kv_blocks=16).generate("Once upon a time", SamplingParams(temperature=0, max_tokens=6),
                                                      use_tqdm=False)[0].outputs[0]
    eos = out.token_ids[3]
    original = EngineCore.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.eos_token_id = eos

    monkeypatch.setattr(EngineCore, "__init__", init)
    assert run_lesson("when_a_request_stops") == 0
    text = said(capsys)
    assert "ended on EOS" in text and "runs on to max_tokens" in text


def test_where_time_goes_lesson_fails_if_matmuls_did_not_count_their_weights(monkeypatch, capsys):
    """Break the cost model: a matmul's bytes without its weight (only the activations), as if the
    weights came for free. Decode's intensity is then no lower than prefill's."""
    from kernels import op_cost

    def activations_only(args, meta):
        flops, _ = op_cost.matmul(args, meta)
        return flops, op_cost.nbytes(args["x"]) * 2

    monkeypatch.setitem(op_cost.COSTS, "matmul", activations_only)
    assert run_lesson("where_a_steps_time_goes") == 1
    assert "claims: decode's matmuls have a lower arithmetic intensity" in said(capsys)
