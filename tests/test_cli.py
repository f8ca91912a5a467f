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
