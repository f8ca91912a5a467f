"""Real Hugging Face checkpoints saved locally load through the same path as hub models."""
import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.builtin_model import NAME, RANDOM_NAME, _bytes_to_unicode, builtin_path
from tests.engine.hf_reference import hf_greedy


def _save_checkpoint(path, safe: bool, inverse_layer_scale: bool = False, vocab_merges: bool = False):
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    torch.manual_seed(7)
    cfg = GPT2Config(vocab_size=257, n_positions=128, n_embd=64, n_layer=2, n_head=2,
                     bos_token_id=256, eos_token_id=256, scale_attn_by_inverse_layer_idx=inverse_layer_scale)
    model = GPT2LMHeadModel(cfg)
    with torch.no_grad():  # sharper than the default init, so greedy outputs vary
        for p in model.parameters():
            p.mul_(8.0 if p.dim() == 2 else 1.0)
    model.save_pretrained(path)
    if not safe:  # the original gpt2 repo's format: pytorch_model.bin, keys without "transformer."
        from safetensors.torch import load_file
        state = load_file(str(path / "model.safetensors"))
        torch.save({k.removeprefix("transformer."): v for k, v in state.items()}, path / "pytorch_model.bin")
        (path / "model.safetensors").unlink()
    if vocab_merges:  # the classic GPT-2 format: vocab.json + merges.txt
        vocab = {c: b for b, c in _bytes_to_unicode().items()} | {"<|endoftext|>": 256}
        (path / "vocab.json").write_text(json.dumps(vocab))
        (path / "merges.txt").write_text("#version: 0.2\n")
    else:
        PreTrainedTokenizerFast.from_pretrained(builtin_path(RANDOM_NAME)).save_pretrained(path)
    return path


@pytest.mark.parametrize("safe, inverse, vocab_merges", [(True, False, False), (False, True, True)])
def test_local_checkpoint_matches_transformers(tmp_path, safe, inverse, vocab_merges):
    path = _save_checkpoint(tmp_path, safe, inverse, vocab_merges)
    assert (path / ("model.safetensors" if safe else "pytorch_model.bin")).exists()
    llm = LLM(str(path), num_kv_blocks=64, block_size=8)
    prompts = ["Hello world", "a", "The paged KV cache stores keys and values in blocks"]
    ids = [llm.get_tokenizer().encode(p) for p in prompts]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == hf_greedy(str(path), ids, 12)
    assert len({tuple(g) for g in got}) > 1


@pytest.mark.parametrize("name", [NAME, RANDOM_NAME])
def test_builtin_model_is_a_real_hf_checkpoint(name):
    from transformers import AutoTokenizer, GPT2LMHeadModel

    path = builtin_path(name)
    model = GPT2LMHeadModel.from_pretrained(path)
    assert model.config.n_layer == 4 and model.config.n_embd == 128
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.eos_token_id == model.config.eos_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    if name == RANDOM_NAME:  # byte-level without merges: id = byte
        assert tok.encode("AB") == [65, 66] and tok.eos_token_id == 256
