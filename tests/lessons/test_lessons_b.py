"""Lessons 08-14: a lesson fails when the behaviour it teaches is broken on purpose."""
import importlib

import lessons
from lessons.cli import main


class OldestFirst(list):
    """A running queue whose pop() takes the oldest request instead of the newest."""

    def pop(self, index=0):
        return super().pop(index)


def test_preemption_lesson_fails_if_the_oldest_request_is_preempted(monkeypatch, capsys):
    from engine.core.sched.scheduler import Scheduler
    original = Scheduler.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.running = OldestFirst()

    monkeypatch.setattr(Scheduler, "__init__", init)
    module = importlib.import_module(lessons.find("preemption").module)
    assert main(vars(module), ["--no-pause"]) == 1
    out = capsys.readouterr().out
    assert "the engine disagrees" in out and "claims: step 3 preempted" in out
