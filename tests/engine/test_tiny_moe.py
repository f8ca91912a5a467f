"""The built-in mixture of experts: tiny-moe (trained, Qwen3-MoE-shaped: 8 experts, top-2) and its
random twin tiny-moe-random give transformers' Qwen3MoeForCausalLM's greedy tokens, token for token;
`vllm-trace generate tiny-moe` writes English; its model card's figures are the trained ones."""
import json
import re
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.builtin_model import MOE_NAME, MOE_RANDOM_NAME, builtin_path
from tests.engine.hf_reference import assert_greedy_equal, hf_greedy
from tracer.cli import main

ROOT = Path(__file__).resolve().parents[2]
MAX_NEW = 16
TEXT = ("Return a new list containing all items from the iterable in ascending order. "
        "If the file does not exist, a FileNotFoundError is raised and nothing is written.")
COMMON_WORDS = {"the", "a", "is", "of", "to", "and", "in", "if", "be", "that", "this", "for", "an", "it", "are"}


def _greedy(model: str, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(model, num_kv_blocks=64, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_tiny_moe_greedy_equals_transformers():
    path = str(builtin_path(MOE_NAME))
    config = json.loads((builtin_path(MOE_NAME) / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts"] == 8
    ids = LLM(MOE_NAME, num_kv_blocks=16).get_tokenizer().encode(TEXT)
    prompts = [ids[:k] for k in (1, 5, 16, 17, len(ids))]
    assert _greedy(MOE_NAME, prompts) == hf_greedy(path, prompts, MAX_NEW)


@pytest.mark.slow
def test_tiny_moe_random_greedy_equals_transformers():
    prompts = [[72, 101, 108, 108, 111], [84, 104, 101, 32] * 5, [256], list(range(32, 80))]
    assert_greedy_equal(_greedy(MOE_RANDOM_NAME, prompts), str(builtin_path(MOE_RANDOM_NAME)), prompts, MAX_NEW)


def test_generate_tiny_moe_writes_english(capsys):
    assert main(["generate", MOE_NAME, "The first argument is", "--max-tokens", "32", "--num-kv-blocks", "16"]) == 0
    words = set(re.findall(r"[a-z]+", capsys.readouterr().out.lower().removeprefix("the first argument is")))
    print(sorted(words))
    assert len(words & COMMON_WORDS) >= 3


def test_the_model_card_records_loss_and_expert_load():
    """train_config.json has the card's figures, and docs/model-card.md shows them as recorded."""
    from engine.builtin.train import card_markdown

    card = json.loads((builtin_path(MOE_NAME) / "train_config.json").read_text())
    doc = (ROOT / "docs" / "model-card.md").read_text()
    assert f"<!-- card: {MOE_NAME} -->\n{card_markdown(card)}<!-- /card -->" in doc
    assert "partial" not in card
    assert card["val_loss_nats_per_token"] < card["unigram_nats_per_token"]
    assert card["active_parameters"] < card["parameters"]
    load = card["expert_load"]
    assert len(load) == card["config"]["num_hidden_layers"]
    assert all(len(row) == card["config"]["num_experts"] and sum(row) == pytest.approx(1, abs=1e-3) for row in load)
    assert [s["prompt"] for s in card["samples"]] and all(s["greedy"] for s in card["samples"])
