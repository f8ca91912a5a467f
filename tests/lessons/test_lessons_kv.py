"""Lessons 28-29 fail when the KV connector they teach is broken on purpose (test_lessons.py runs them whole)."""
import importlib

import pytest

import lessons
from lessons.cli import main


def run_lesson(name: str) -> int:
    return main(vars(importlib.import_module(lessons.find(name).module)), ["--no-pause"])


@pytest.mark.slow
def test_disaggregated_prefill_lesson_fails_if_the_decode_instance_computes_the_prompt(monkeypatch, capsys):
    """Break the P2P connector's consumer: it never offers the remote prompt, so the decode instance computes it."""
    from engine.distributed.kv_transfer.kv_connector.v1.p2p_zmq_connector import P2pZmqConnector

    monkeypatch.setattr(P2pZmqConnector, "get_num_new_matched_tokens", lambda self, request, num_computed: (0, False))
    assert run_lesson("disaggregated_prefill") == 1
    assert "claims: the decode instance allocated the prompt's blocks" in " ".join(capsys.readouterr().out.split())


def test_offloading_lesson_fails_if_host_memory_is_never_asked(monkeypatch, capsys):
    """Break the offloading connector's lookup: blocks are stored in host memory but never found there."""
    from engine.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    original = OffloadingConnector.get_num_new_matched_tokens

    def never(self, request, num_computed_tokens):
        original(self, request, num_computed_tokens)  # (its bookkeeping, as before)
        return 0, False

    monkeypatch.setattr(OffloadingConnector, "get_num_new_matched_tokens", never)
    assert run_lesson("offloading_kv") == 1
    assert "the device's cache found nothing; host memory delivered" in " ".join(capsys.readouterr().out.split())
