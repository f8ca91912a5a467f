"""vLLM V1's logits processors in the sampler: logit_bias, allowed_token_ids, bad_words (offline, and
through the server as the OpenAI/vLLM request fields), traced per request."""
import pytest

from engine import LLM, Hooks, SamplingParams
from engine.sampling_params import SamplingParamsError

PROMPT = "The list of"


@pytest.fixture(scope="module")
def llm():
    hooks = Hooks()
    seen = []
    hooks.subscribe(lambda *ev: seen.append(ev) if ev[0] == "sampler" else None)
    llm = LLM("tiny-gpt2", num_kv_blocks=64, hooks=hooks)
    llm.seen = seen
    return llm


def _greedy(llm, **kw):
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **kw),
                        use_tqdm=False)[0].outputs[0]


def test_allowed_token_ids_limit_every_token(llm):
    plain = _greedy(llm)
    allowed = [plain.token_ids[0] + 1, 17, 42]
    out = _greedy(llm, allowed_token_ids=allowed)
    assert set(out.token_ids) <= set(allowed)


def test_logit_bias_forces_and_forbids(llm):
    plain = _greedy(llm)
    forced = _greedy(llm, logit_bias={1234: 100.0})
    assert forced.token_ids == [1234] * 8
    forbidden = _greedy(llm, logit_bias={plain.token_ids[0]: -100.0})
    assert forbidden.token_ids[0] != plain.token_ids[0]


def test_bad_words_are_never_generated(llm):
    plain = _greedy(llm)
    word = llm.get_tokenizer().decode(plain.token_ids[:2]).strip()
    out = _greedy(llm, bad_words=[word])
    assert word not in out.text and out.text != plain.text


def test_the_trace_says_what_the_processors_did(llm):
    llm.seen.clear()
    _greedy(llm, logit_bias={1234: 100.0}, allowed_token_ids=[1234, 5])
    done = [ev for ev in llm.seen if ev[1] == "sampled" and ev[5].get("logits_processors")]
    assert done and all(list(d[5]["logits_processors"].values())[0] == {"allowed": 2, "biased": {1234: 100.0}}
                        for d in done)


def test_bad_values_are_refused(llm):
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias={1: 500})
    with pytest.raises(SamplingParamsError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="allowed_token_ids: token ids must be in"):
        llm.generate(PROMPT, SamplingParams(allowed_token_ids=[10 ** 6]), use_tqdm=False)
