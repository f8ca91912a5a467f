"""Lessons 01-07 teach behaviour the engine really has: break it on purpose and a lesson fails."""
import importlib

import lessons
from lessons.cli import main


def test_slot_mapping_lesson_fails_if_slots_ignore_the_block_table(monkeypatch, capsys):
    """Break the model runner: every token's K/V goes to slot = position, as if each request's
    cache were contiguous from slot 0 (the block table is ignored)."""
    from engine.worker.model_runner import ModelRunner
    original = ModelRunner.prepare_inputs

    def contiguous(self, sched):
        inp = original(self, sched)
        inp.slot_mapping = inp.positions.clone()
        return inp

    monkeypatch.setattr(ModelRunner, "prepare_inputs", contiguous)
    module = importlib.import_module(lessons.find("slot_mapping").module)
    assert main(vars(module), ["--no-pause"]) == 1
    out = capsys.readouterr().out
    assert "the engine disagrees" in out and "slot_mapping[" in out
