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


# ---- subcommands from other packages: the vllm_trace.commands entry points ----------------------
def _entry_points(monkeypatch, *values: str):
    import importlib.metadata

    from tracer import cli

    eps = [importlib.metadata.EntryPoint(name=f"ep{i}", value=v, group=cli.ENTRY_POINT_GROUP)
           for i, v in enumerate(values)]
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None: [ep for ep in eps if ep.group == group])


def _subcommands() -> dict:
    from tracer.cli import build_parser

    return build_parser()._subparsers._group_actions[0].choices


def test_lesson_and_exercise_come_from_the_lessons_entry_point(monkeypatch):
    _entry_points(monkeypatch, "lessons.cli:register")
    cmds = _subcommands()
    assert list(cmds)[-2:] == ["lesson", "exercise"]  # after the tracer's own, as `--help` lists them
    assert "lesson number (5) or name (paged_kv_cache)" in cmds["lesson"].format_help()
    assert "--tui" in cmds["lesson"].format_help() and "--solution" in cmds["exercise"].format_help()


def test_without_the_entry_point_the_tracer_has_only_its_own_commands(monkeypatch):
    _entry_points(monkeypatch)
    assert list(_subcommands()) == ["generate", "serve", "attach", "replay", "send", "bench", "export", "roofline",
                                    "proxy"]


def test_a_broken_entry_point_is_one_line_and_the_rest_still_work(monkeypatch, capsys):
    _entry_points(monkeypatch, "no_such_package.cli:register", "lessons.cli:register")
    assert "serve" in _subcommands() and "lesson" in _subcommands()
    assert "no_such_package.cli:register (vllm_trace.commands) did not load" in capsys.readouterr().err


def test_pyproject_declares_the_lessons_entry_point():
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    section = text.split('[project.entry-points."vllm_trace.commands"]', 1)[1].split("\n[", 1)[0]
    assert re.search(r'^lessons = "lessons\.cli:register"$', section, re.M)


def test_imports_point_one_way():
    """Nothing in kernels/, engine/ or tracer/ imports the lessons (not even by a module string),
    and no TUI widget imports a command module."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).parents[1]
    bad = []
    for pkg in ("kernels", "engine", "tracer"):
        for path in (root / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names = [node.value] if node.value.split(".")[0] == "lessons" and " " not in node.value else []
                bad += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] == "lessons"]
                if "tui/widgets" in path.as_posix():
                    bad += [f"{path.relative_to(root)}: {n}" for n in names if n.startswith("tracer.commands")]
    # and no circle between the lesson framework and the lesson TUI (which builds on it)
    for node in ast.walk(ast.parse((root / "lessons" / "framework.py").read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("lessons.tui", "lessons.cli")):
            bad.append(f"lessons/framework.py: {node.module}")
    assert bad == []


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


def test_version_and_help_name_every_built_in_model_and_describe_every_sampling_option(capsys):
    import importlib.metadata

    import pytest

    from engine.builtin_model import NAMES

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"vllm-trace {importlib.metadata.version('vllm-trace')}"
    for command in ("serve", "generate"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = "".join(capsys.readouterr().out.split())  # argparse wraps lines, also at a name's hyphens
        assert all(name in text for name in NAMES), (command, text)
    generate = _subcommands()["generate"]
    sampling = next(g for g in generate._action_groups if g.title == "sampling")
    undescribed = [a.option_strings[0] for a in sampling._group_actions if not a.help]
    assert undescribed == [] and {"--top-p", "--min-p"} <= {a.option_strings[0] for a in sampling._group_actions}


def test_the_lesson_list_fills_a_wide_terminal_and_wraps_a_narrow_one_without_cutting():
    import lessons
    from lessons.cli import listing

    rows = [(i.number, i.name, i.title, i.summary) for i in lessons.discover()]
    for width in (160, 80):
        text = listing(rows, width)
        assert all(len(line) <= width for line in text.splitlines())
        flat = " ".join(text.split())
        assert all(" ".join(f"{title}: {summary}".split()) in flat for _, _, title, summary in rows)
    wide, narrow = listing(rows, 160).splitlines(), listing(rows, 80).splitlines()
    assert len(wide) < len(narrow) and max(map(len, wide)) > 100  # the width is used, not a fixed 80


def test_the_tui_imports_no_torch_so_serve_draws_before_the_engine_loads():
    """serve starts the TUI before the engine: torch (seconds to import) belongs to the engine core's
    process, and the TUI's import of it (through the Kernels panel) kept the terminal blank."""
    code = ("import sys; import tracer.session, tracer.tui.serve; "
            "print(sorted(m for m in ('torch', 'triton', 'kernels') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr[-2000:]


def test_ctrl_c_while_the_commands_load_is_one_line_and_status_130(monkeypatch, capsys):
    """Loading the commands' modules takes a second on a busy machine: a Ctrl-C then is the same one line
    as later (CI saw a traceback and a shell killed by the re-raised SIGINT)."""
    import tracer.cli

    def interrupted():
        raise KeyboardInterrupt
    monkeypatch.setattr(tracer.cli, "build_parser", interrupted)
    assert main(["serve", "tiny-gpt2"]) == 130
    assert capsys.readouterr().err == "vllm-trace serve: interrupted\n"
