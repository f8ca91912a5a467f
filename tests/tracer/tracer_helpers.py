"""Helpers for the tracer tests: a traced engine run, an engine loop in a thread."""
from __future__ import annotations

import threading

from engine import LLM, Hooks, SamplingParams
from tracer.session import TraceSession


PROMPTS = ["The quick brown fox jumps", "Hello there", "A shared prefix, a shared prefix! one",
           "A shared prefix, a shared prefix! two", "x"]


def traced_run(path, prompts=PROMPTS, max_tokens=10, **llm_kwargs):
    """Run prompts through a traced LLM, recording to path. Returns (outputs, session)."""
    hooks = Hooks()
    session = TraceSession(hooks, trace_file=path, control=False)
    llm_kwargs.setdefault("block_size", 4)
    llm = LLM("tiny-gpt2", hooks=hooks, **llm_kwargs)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    session.state.update()
    session.close()
    return outs, session


class EngineThread:
    """Runs engine.step() in a background thread until no request is left (or stop())."""

    def __init__(self, engine):
        self.engine = engine
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            while self.engine.has_unfinished_requests():
                self.engine.step()
        except BaseException as e:  # surfaced by join()
            self.error = e

    def start(self):
        self.thread.start()
        return self

    def join(self, timeout=60):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "engine thread did not finish"
        if self.error:
            raise self.error
