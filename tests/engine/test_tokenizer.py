"""engine.tokenizer (the `tokenizers` library alone) gives what transformers' AutoTokenizer gives,
on every kind of tokenizer directory we load; and the API server never imports torch."""
import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.builtin_model import NAME, RANDOM_NAME, _bytes_to_unicode, builtin_path
from engine.tokenizer import TokenizerNotFoundError, load_tokenizer

TEXTS = ["Hello, my name is", " The  first\targument\n\nis", "", "héllo 🎉 <|endoftext|> after",
         "def f(x):\n    return"]
TEMPLATE = ("{% for m in messages %}{{ bos_token }}{{ m['role'] | capitalize }}: {{ m['content'] | tojson }}\n"
            "{% if loop.last %}{% break %}{% endif %}{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")


def _hf_saved(path):
    """The built-in tokenizer as transformers' save_pretrained writes it (tokenizer.json + config)."""
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast.from_pretrained(builtin_path(NAME)).save_pretrained(path)
    return path


def _vocab_merges(path):
    """The classic GPT-2 files: vocab.json and merges.txt (bytes plus a few merges), no tokenizer.json;
    the eos comes from config.json, as for the original gpt2 repo."""
    vocab = {c: b for b, c in _bytes_to_unicode().items()}
    merges = ["Ġ t", "Ġt h", "Ġth e", "h e"]
    for m in merges:
        vocab["".join(m.split())] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2", "eos_token_id": len(vocab) - 1,
                                                  "bos_token_id": len(vocab) - 1}))
    return path


@pytest.fixture(params=["builtin", "random", "hf-saved", "vocab-merges"])
def pair(request, tmp_path):
    from transformers import AutoTokenizer

    path = {"builtin": lambda: builtin_path(NAME), "random": lambda: builtin_path(RANDOM_NAME),
            "hf-saved": lambda: _hf_saved(tmp_path), "vocab-merges": lambda: _vocab_merges(tmp_path)}[request.param]()
    return load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))


def test_same_as_transformers(pair):
    ours, hf = pair
    assert (len(ours), ours.eos_token_id, ours.bos_token_id) == (len(hf), hf.eos_token_id, hf.bos_token_id)
    assert ours.eos_token_id is not None
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.batch_decode([[i] for i in range(300)]) == hf.batch_decode([[i] for i in range(300)])
    assert ours.convert_tokens_to_ids("<|endoftext|>") == hf.convert_tokens_to_ids("<|endoftext|>")


def test_chat_template_renders_as_transformers(pair):
    ours, hf = pair
    messages = [{"role": "system", "content": "Be terse, « please »."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "never shown: the loop breaks"}]
    for gen in (False, True):
        want = hf.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False,
                                        add_generation_prompt=gen) == want
    assert ours.apply_chat_template(messages[:1], chat_template=TEMPLATE) == ours.encode(
        ours.apply_chat_template(messages[:1], chat_template=TEMPLATE, tokenize=False), add_special_tokens=False)


def test_template_errors_and_the_sandbox():
    import jinja2

    tok = load_tokenizer(builtin_path(NAME))
    with pytest.raises(jinja2.TemplateError, match="no system role"):
        tok.apply_chat_template([{"role": "system", "content": "x"}], tokenize=False,
                                chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(jinja2.exceptions.SecurityError):  # a template may not reach Python's internals
        tok.apply_chat_template([], tokenize=False, chat_template="{{ ''.__class__.__mro__ }}")
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_a_directory_without_a_tokenizer_says_what_it_looked_for(tmp_path):
    with pytest.raises(TokenizerNotFoundError, match="tokenizer.json, or vocab.json and merges.txt"):
        load_tokenizer(tmp_path)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_any_text_encodes_as_transformers_does(text):
    ours, hf = _builtin_pair()
    assert ours.encode(text) == hf.encode(text)


_PAIR = []


def _builtin_pair():
    if not _PAIR:
        from transformers import AutoTokenizer
        _PAIR.append((load_tokenizer(builtin_path(NAME)), AutoTokenizer.from_pretrained(str(builtin_path(NAME)))))
    return _PAIR[0]


def test_the_api_server_never_imports_torch():
    """What serve's front end imports in two-process mode (the app, the client, the trace API, the
    config) leaves torch and transformers out: that is most of a second of startup on 2 cores."""
    code = ("import sys; import engine.entrypoints.openai, engine.engine.async_llm, engine.config; "
            "import tracer.trace_api, tracer.session; "
            "from engine.tokenizer import load_tokenizer; from engine.builtin_model import builtin_path; "
            "load_tokenizer(builtin_path()); print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
