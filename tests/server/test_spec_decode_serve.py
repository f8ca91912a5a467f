"""serve with speculative decoding: it answers, and /metrics counts V1's spec-decode counters."""
import pytest


@pytest.mark.slow
@pytest.mark.parametrize("spec, k", [('{"method": "ngram", "num_speculative_tokens": 3}', 3),
                                     ('{"method": "draft_model", "model": "tiny-gpt2-draft", '
                                      '"num_speculative_tokens": 2}', 2)], ids=["ngram", "draft_model"])
def test_serve_with_speculative_config_answers_and_counts_drafts(spec, k):
    import httpx

    from tests.server.conftest import spawn_serve

    proc, _, url = spawn_serve("--no-tui", "--speculative-config", spec)
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            r = client.post("/v1/completions", json={"model": "tiny-gpt2", "prompt": "The list of the list of the",
                                                     "max_tokens": 32, "temperature": 0})
            assert r.status_code == 200, r.text
            metrics = client.get("/metrics").text
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("vllm:spec_decode") and "{" in line and "_created" not in line}
        drafts = values["vllm:spec_decode_num_drafts_total"]
        draft_tokens = values["vllm:spec_decode_num_draft_tokens_total"]
        assert drafts > 0 and draft_tokens <= k * drafts
        assert 0 < values["vllm:spec_decode_num_accepted_tokens_total"] <= draft_tokens
        assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in values
    finally:
        proc.terminate()
        proc.wait(30)


def test_serve_with_a_draft_of_another_tokenizer_is_one_line():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "tracer.cli", "serve", "tiny-gpt2", "--no-tui", "--port", "0",
                        "--speculative-config",
                        '{"method": "draft_model", "model": "tiny-gpt2-random"}'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "share the target's tokenizer" in r.stderr and "Traceback" not in r.stderr
