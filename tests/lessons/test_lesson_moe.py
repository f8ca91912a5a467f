"""Lesson 27 (mixture of experts) fails when the behaviour it teaches is broken on purpose."""
import importlib

import lessons
from lessons.cli import main


def test_moe_lesson_fails_if_the_router_does_not_renormalise(monkeypatch, capsys):
    """Break the router: tiny-moe's norm_topk_prob is ignored, a token's two weights no longer sum to 1."""
    import engine.model_executor.layers.fused_moe.layer as layer

    original = layer.fused_topk
    monkeypatch.setattr(layer, "fused_topk", lambda logits, top_k, renormalize: original(logits, top_k, False))
    module = importlib.import_module(lessons.find("mixture_of_experts").module)
    assert main(vars(module), ["--no-pause"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "the engine disagrees" in out and "claims: every token's experts and weights are the top-2" in out, out
