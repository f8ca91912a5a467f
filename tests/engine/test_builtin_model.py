"""The trained built-in tiny-gpt2: its BPE tokenizer round-trips any text, its files are checked
against their checksums, its greedy text is stable, and what it writes is mostly English words."""
import fnmatch
import json
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import tomllib
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.builtin_model import (
    DRAFT_NAME,
    LLAMA_NAME,
    MOE_NAME,
    NAME,
    PACKAGED,
    PACKAGED_MODELS,
    RANDOM_NAME,
    builtin_path,
)
from engine.model_executor.model_loader import CHECKSUM_FILE, ChecksumMismatchError, resolve, verify_checksums
from engine.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
EOT = "<|endoftext|>"
GREEDY_PROMPT = "The first argument is"
GREEDY_EXPECTED = (" the function is used to the function.\n\n"
                   "The function is a function is a function is used to the function.")
WORD_PROMPTS = ["The default value is", "Return a new list", "This module provides", "If the file does not exist,",
                "The function returns", "An object that"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(builtin_path())


@pytest.fixture(scope="module")
def llm():
    return LLM(NAME, num_kv_blocks=128)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_text_round_trips(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert all(0 <= i < len(tok) for i in ids)


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", min_codepoint=0x80), min_size=1, max_size=8))
def test_rare_characters_fall_back_to_bytes(tok, text):
    # never more tokens than UTF-8 bytes; a single character never splits into anything but bytes
    assert len(tok.encode(text)) <= len(text.encode("utf-8"))


def test_bpe_vocabulary(tok):
    assert 2048 <= len(tok) <= 8192
    assert tok.convert_tokens_to_ids(EOT) == tok.eos_token_id
    assert tok.encode("Hi " + EOT)[-1] == tok.eos_token_id  # the special token is parsed in text
    assert tok.convert_ids_to_tokens(tok.encode(" the")) == ["Ġthe"]  # a merge with its leading space
    assert sum(t.startswith("Ġ") for t in tok.get_vocab()) > 500
    for emoji in "👋🐍🎉":  # no merge covers them: one token per UTF-8 byte
        ids = tok.encode(emoji)
        assert len(ids) == len(emoji.encode("utf-8")) and all(len(t) == 1 for t in tok.convert_ids_to_tokens(ids))


@pytest.mark.parametrize("name", [NAME, DRAFT_NAME, LLAMA_NAME, MOE_NAME])
def test_builtin_is_the_packaged_checkpoint_with_checksums(name):
    assert resolve(name) == PACKAGED_MODELS[name]
    assert verify_checksums(PACKAGED_MODELS[name]) == 4  # config, weights, tokenizer and its config
    assert sum(f.stat().st_size for f in PACKAGED_MODELS[name].iterdir()) < 16 * 2**20


def test_package_data_includes_the_artifacts():
    """pyproject's package data covers every file of the artifact directories, so a wheel has them."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = conf["tool"]["setuptools"]["package-data"]["engine"]
    files = [str(f.relative_to(ROOT / "engine")) for d in PACKAGED_MODELS.values() for f in d.iterdir()]
    assert files and all(any(fnmatch.fnmatch(f, g) for g in globs) for f in files)


@pytest.mark.parametrize("name", [LLAMA_NAME, DRAFT_NAME, MOE_NAME])
def test_tiny_llama_and_the_draft_share_tiny_gpt2s_tokenizer(name):
    """Trained on the same corpus with the same tokenizer: the same text is the same ids."""
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (PACKAGED_MODELS[name] / f).read_bytes() == (PACKAGED / f).read_bytes()


@pytest.fixture
def copy(tmp_path):
    dst = tmp_path / "tiny"
    shutil.copytree(PACKAGED, dst)
    return dst


def test_a_corrupted_file_is_a_clear_error(copy, capsys):
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-100] ^= 0xFF  # one flipped byte inside a weight
    (copy / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match=r"model\.safetensors is corrupted"):
        LLM(str(copy), num_kv_blocks=8)
    from tracer.cli import main
    assert main(["generate", str(copy), "Hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "corrupted" in err and "Traceback" not in err


def test_a_missing_file_is_a_clear_error(copy):
    (copy / "tokenizer.json").unlink()
    with pytest.raises(ChecksumMismatchError, match=r"tokenizer\.json is missing"):
        verify_checksums(copy)


def test_no_checksum_file_means_nothing_to_check(copy):
    (copy / CHECKSUM_FILE).unlink()
    assert verify_checksums(copy) == 0
    assert LLM(str(copy), num_kv_blocks=8).generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)


def test_random_model_is_still_byte_level():
    t = load_tokenizer(builtin_path(RANDOM_NAME))
    assert t.encode("AB") == [65, 66] and len(t) == 257


def test_greedy_continuation_is_stable(llm):
    out = llm.generate(GREEDY_PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    print(repr(out.outputs[0].text))
    assert out.outputs[0].text == GREEDY_EXPECTED


def _dictionary():
    from english_words import get_english_words_set
    return get_english_words_set(["web2", "gcide"], lower=True)


def _is_word(w: str, words: set[str]) -> bool:
    """In the word list, or an inflection of a word in it (the lists hold lemmas: 'return', not 'returns')."""
    if w in words:
        return True
    for suffix, repl in (("ies", "y"), ("es", ""), ("s", ""), ("ed", ""), ("ed", "e"), ("ing", ""), ("ing", "e"),
                         ("ly", ""), ("er", ""), ("est", "")):
        if w.endswith(suffix) and len(w) > len(suffix) + 2 and w[:-len(suffix)] + repl in words:
            return True
    return False


def test_most_generated_words_are_english(llm):
    words = _dictionary()
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=64)
    outs = llm.generate(WORD_PROMPTS, params, use_tqdm=False)
    text = " ".join(o.outputs[0].text for o in outs)
    found = [w.lower() for w in re.findall(r"[A-Za-z]+", text)]
    found = [w for w in found if len(w) > 1 or w in ("a", "i")]
    share = sum(_is_word(w, words) for w in found) / len(found)
    print(f"\n{share:.1%} of {len(found)} generated words are dictionary words (english-words web2+gcide, "
          f"with inflections), sampled at temperature 0.8, top-p 0.95")
    assert len(found) > 100 and share >= 0.9  # measured 98.2 % of 281 words (the 500-step model: 99.6 % of 285)


def test_training_says_when_an_installed_package_would_change_the_corpus():
    from engine.builtin.tiny_corpus import Source
    from engine.builtin.train_data import version_drift

    trained = json.loads((PACKAGED / "train_config.json").read_text())["sources"]
    same = [Source(s["name"], s["licence"], []) for s in trained]
    assert version_drift(same) == []
    name, version = trained[2]["name"].rsplit(" ", 1)
    [line] = version_drift(same[:2] + [Source(f"{name} {version}.post1", "MIT", [])])
    assert f"{name} {version}.post1 is installed" in line and trained[2]["name"] in line


def test_the_draft_starts_from_tiny_gpt2s_lower_layers():
    """train tiny-gpt2-draft: 2 of tiny-gpt2's 4 blocks, its embeddings and final norm to start
    from, and its tokenizer; an init from a checkpoint of another width is refused."""
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    from engine.builtin.train_configs import MODELS, TinyGpt2
    from engine.builtin.train_data import init_weights

    cfg = MODELS[DRAFT_NAME]
    assert cfg.n_layer == 2 and cfg.tokenizer_from == cfg.init_from == NAME
    model = GPT2LMHeadModel(cfg.hf_config(cfg.vocab_size, eot=0))
    init_weights(model, PACKAGED)
    target = load_file(str(PACKAGED / "model.safetensors"))
    own = model.state_dict()
    for k in ("transformer.wte.weight", "transformer.wpe.weight", "transformer.h.1.mlp.c_fc.weight",
              "transformer.ln_f.bias"):
        assert own[k].equal(target[k]), k
    assert own["lm_head.weight"].data_ptr() == own["transformer.wte.weight"].data_ptr()  # still tied
    narrow = GPT2LMHeadModel(TinyGpt2(n_layer=2, n_embd=64, n_head=2).hf_config(4096, eot=0))
    with pytest.raises(SystemExit, match="another width"):
        init_weights(narrow, PACKAGED)


@pytest.mark.parametrize("name", [NAME, DRAFT_NAME, LLAMA_NAME, MOE_NAME])
def test_the_training_program_reproduces_each_shipped_model(name):
    """`python -m engine.builtin.train NAME`'s settings are the ones the shipped model records, and
    the config.json it writes (from those settings) is the shipped one."""
    from types import SimpleNamespace

    from engine.builtin.train_configs import MODELS

    cfg, path = MODELS[name], PACKAGED_MODELS[name]
    recorded = json.loads((path / "train_config.json").read_text())
    settings = asdict(cfg)
    assert {k: settings.get(k) for k in recorded["config"]} == recorded["config"]
    # tiny-gpt2's record predates the settings that reuse another model's tokenizer or weights: both off
    assert all(not settings[k] for k in settings.keys() - recorded["config"].keys())
    shipped = json.loads((path / "config.json").read_text())
    written = cfg.config_json(SimpleNamespace(config=cfg.hf_config(shipped["vocab_size"], shipped["eos_token_id"])))
    assert written == shipped
