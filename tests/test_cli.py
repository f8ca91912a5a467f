import subprocess
import sys

from tracer.cli import main


def test_generate_prints_completion(capsys):
    assert main(["generate", "tiny-gpt2", "Hello", "--max-tokens", "5", "--num-kv-blocks", "32"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Hello") and len(out.strip()) > len("Hello")
    assert "finish_reason=length" in err


def test_bad_input_is_one_line_without_traceback():
    r = subprocess.run([sys.executable, "-m", "tracer.cli", "generate", "tiny-gpt2", "hi", "--top-p", "2"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "top_p must be in (0, 1]" in r.stderr and "Traceback" not in r.stderr


def test_help_lists_commands(capsys):
    assert main([]) == 2
    assert "generate" in capsys.readouterr().out


def test_help_says_each_default_once_and_never_a_key_from_the_environment(capsys, monkeypatch):
    """send --help printed "(default: the first one the server lists) (default: None)", and attach
    --help the value of $VLLM_TRACE_API_KEY."""
    import re

    import pytest

    monkeypatch.setenv("VLLM_TRACE_API_KEY", "sekrit-from-env")
    for command in ("send", "attach", "generate", "export"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
        assert "(default: None)" not in text and "sekrit" not in text, (command, text)
        assert not re.search(r"default[^()]*\) \(default", text), (command, text)  # "(default 64) (default: 64)"
