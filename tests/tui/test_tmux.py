"""The TUI in a real terminal: `vllm-trace serve tiny-gpt2` in tmux, requests sent with curl
from a second shell (another tmux window), the pane captured as a newcomer would see it: the
first request on screen with no key pressed, the words waiting and running, the Step panel
agreeing with the header after a burst, `q` stopping the server and printing a summary. Also:
a model that cannot load is one clean line, stderr sent to a file gets no escape codes, and
`attach` shows DISCONNECTED when its server stops."""
from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
SESSION = "vllm-trace-tui"
# Each test gets its own tmux server (socket). With one shared server, killing a test's last session makes
# the server exit while the next test's new-session connects: "server exited unexpectedly" (seen in CI).
SOCKET = f"vllm-trace-tui-{os.getpid()}"
_servers = itertools.count()

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None or shutil.which("curl") is None,
                                reason="needs tmux and curl (apt-get install -y tmux curl)")


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", "-L", SOCKET, *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture(autouse=True)
def own_tmux_server():
    global SOCKET
    SOCKET = f"vllm-trace-tui-{os.getpid()}-{next(_servers)}"  # short: a socket path has a ~100-byte limit
    yield
    subprocess.run(["tmux", "-L", SOCKET, "kill-server"], capture_output=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.2)  # polling another process: there is nothing to wait on in-process
    raise AssertionError(f"timed out waiting for {what}")


def pane(window: int = 0) -> str:
    return tmux("capture-pane", "-p", "-t", f"{SESSION}:{window}")


def pane_children(window: int = 0) -> list[str]:
    """The names of the programs the pane's shell has started (read from /proc: the shell runs its
    command line without job control, so tmux's pane_current_command names the shell throughout)."""
    return [name for name, _ in _pane_children(window)]


def _pane_children(window: int = 0) -> list[tuple[str, Path]]:
    return _children(tmux("display-message", "-p", "-t", f"{SESSION}:{window}", "#{pane_pid}").strip())


def _children(parent: str) -> list[tuple[str, Path]]:
    """(name, /proc/PID) of each process whose parent is the process `parent` (a pid)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            comm, fields = stat.read_text().rsplit(")", 1)
        except OSError:  # the process has gone
            continue
        if fields.split()[1] == parent:
            found.append((comm.split("(", 1)[1], stat.parent))
    return found


def python_catches_sigint(window: int = 0) -> bool:
    """The pane's Python has its SIGINT handler: bit 2 of SigCgt in /proc/PID/status. Before the
    interpreter installs it (its start can take a second on a loaded machine) a Ctrl-C kills Python
    outright, and the shell, which took the same SIGINT, ends the command line with it."""
    for name, proc in _pane_children(window):
        if name.startswith("python"):
            try:
                caught = next(line for line in (proc / "status").read_text().splitlines() if line.startswith("SigCgt"))
            except (OSError, StopIteration):
                continue
            return bool(int(caught.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    return False


def python_runs_main(window: int = 0) -> bool:
    """The pane's Python takes SIGINT and has loaded a C extension module (lib-dynload): past the
    interpreter's start (site, runpy, tracer/cli.py's own imports load none) and inside main(), whose
    try turns a Ctrl-C into one line and status 130. A Ctrl-C before that is Python's own traceback."""
    if not python_catches_sigint(window):
        return False
    for name, proc in _pane_children(window):
        if name.startswith("python"):
            try:
                return "/lib-dynload/" in (proc / "maps").read_text()
            except OSError:
                return False
    return False


class EngineCoreHeld:
    """Keeps the pane's engine-core process stopped (SIGSTOP) from the moment it appears until
    release(): serve cannot become ready meanwhile, so a key sent then reaches a server that is still
    starting on a machine of any speed (on a fast one, serve is ready 1.3 s after main())."""

    def __init__(self, window: int = 0):
        self.window, self.pid, self.done = window, None, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.is_set() and self.pid is None:
            for name, proc in _pane_children(self.window):
                if name.startswith("python"):
                    self._stop_core_under(proc.name)
            time.sleep(0.005)

    def _stop_core_under(self, serve_pid: str) -> None:
        for _, proc in _children(serve_pid):
            try:
                if b"engine.engine.core_proc" in (proc / "cmdline").read_bytes():
                    os.kill(int(proc.name), signal.SIGSTOP)
                    self.pid = int(proc.name)
                    return
            except OSError:  # the process has gone
                continue

    def release(self) -> None:
        self.done.set()
        self.thread.join()
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def env(model_cache) -> str:
    # COLUMNS/LINES (set under pytest) would override the terminal size Textual reads
    return f"env -u COLUMNS -u LINES VLLM_TRACE_CACHE={model_cache} PYTHONPATH={ROOT} TERM=xterm-256color"


def new_session(command: str, width: int = 160, height: int = 48) -> None:
    tmux("new-session", "-d", "-s", SESSION, "-x", str(width), "-y", str(height), f"cd {ROOT} && {command}; sleep 60")
    # no client is attached: fix the size, or tmux falls back to 80x24
    tmux("set-option", "-t", SESSION, "window-size", "manual")
    tmux("resize-window", "-t", f"{SESSION}:0", "-x", str(width), "-y", str(height))


def curl(url: str, out: Path, prompt: str = "Hello, my name is", max_tokens: int = 12) -> str:
    body = json.dumps({"model": "tiny-gpt2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    return f"curl -s {url}/v1/completions -H 'Content-Type: application/json' -d '{body}' > {out}"


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.slow
def test_serve_shows_a_curl_request_in_the_terminal(model_cache, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    new_session(f"{env(model_cache)} {sys.executable} -m tracer.cli serve tiny-gpt2 --port {port} --num-kv-blocks 256")
    try:
        wait_for(lambda: healthy(url), 90, "the server")
        wait_for(lambda: "Ready." in pane(), 30, "the TUI's ready line")
        assert f"curl {url}/v1/completions" in pane()

        out = tmp_path / "response.json"
        tmux("new-window", "-d", "-t", SESSION, curl(url, out))
        response = wait_for(lambda: out.exists() and out.stat().st_size and json.loads(out.read_text()), 60,
                            "curl's answer")
        rid, text = response["id"], response["choices"][0]["text"]
        try:  # no key pressed: the TUI has opened the Overview by itself
            screen = wait_for(lambda: rid in pane() and "finished 1" in pane() and pane(), 15, "")
        except AssertionError:
            raise AssertionError(f"request {rid} is not on screen with no key pressed:\n{pane()}") from None
        assert "waiting 0 · running 0 · finished 1" in screen and "12 tokens out, length" in screen
        assert "waiting" in screen.split("\n", 3)[3] and "running" in screen.split("\n", 3)[3]  # the panel's own

        tmux("send-keys", "-t", f"{SESSION}:0", "2")  # the Requests panel; at 160 columns the detail is beside it
        try:
            screen = wait_for(lambda: all(w in pane() for w in ("why waiting", rid, text.strip()[:8])) and pane(),
                              15, "")
        except AssertionError:
            raise AssertionError(f"request {rid} and its text {text!r} are not on screen:\n{pane()}") from None
        assert "finished" in screen and "12/12" in screen

        # a burst, then the Step panel must say the step the header says
        burst = " & ".join(curl(url, tmp_path / f"burst{i}.json", f"burst {i}", 24) for i in range(8))
        tmux("new-window", "-d", "-t", SESSION, f"{burst} & wait; touch {tmp_path / 'burst.done'}")
        wait_for(lambda: (tmp_path / "burst.done").exists(), 90, "the burst")
        tmux("send-keys", "-t", f"{SESSION}:0", "4")

        def agree() -> str | None:
            screen = pane()
            head = re.search(r"step (\d+) \(done\)", screen.splitlines()[0])
            panel = re.search(r"^ *step (\d+)  batch of", screen, re.M)
            return screen if head and panel and head.group(1) == panel.group(1) and "finished 9" in screen else None
        try:
            wait_for(agree, 15, "")
        except AssertionError:
            raise AssertionError(f"the Step panel does not agree with the header:\n{pane()}") from None

        tmux("send-keys", "-t", f"{SESSION}:0", "q")
        wait_for(lambda: not healthy(url), 30, "the server to stop after q")
        summary = wait_for(lambda: "served" in pane() and pane(), 15, "the exit summary")
        assert "9 requests served" in summary and "vllm-trace replay" in summary and "Traceback" not in summary
    finally:
        subprocess.run(["tmux", "-L", SOCKET, "kill-session", "-t", SESSION], capture_output=True)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["./nonexistent-model", "no-such-org/no-such-model"])
def test_a_model_that_cannot_load_is_one_clean_line(model_cache, model):
    new_session(f"{env(model_cache)} HF_HUB_OFFLINE=1 {sys.executable} -m tracer.cli serve {model} "
                f"--port {free_port()}; echo EXIT=$?", 80, 24)
    try:
        screen = wait_for(lambda: "EXIT=" in pane() and pane(), 90, "serve to give up")
        assert "EXIT=2" in screen and "vllm-trace serve: error:" in screen, screen
        assert "Traceback" not in screen and "AttributeError" not in screen, screen
        assert "--model" not in screen  # the hint names a real command
    finally:
        subprocess.run(["tmux", "-L", SOCKET, "kill-session", "-t", SESSION], capture_output=True)


def test_stderr_to_a_file_runs_headless_without_escape_codes(model_cache, tmp_path):
    port, log = free_port(), tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    new_session(f"{env(model_cache)} {sys.executable} -m tracer.cli serve tiny-gpt2 --port {port} 2>{log}", 80, 24)
    try:
        wait_for(lambda: healthy(url), 90, "the server")
        wait_for(lambda: "Ready:" in log.read_text(), 15, "the ready line")
        tmux("send-keys", "-t", f"{SESSION}:0", "C-c")
        wait_for(lambda: not healthy(url), 30, "the server to stop")
        text = log.read_text()
        assert "running headless" in text and "\x1b" not in text, text
    finally:
        subprocess.run(["tmux", "-L", SOCKET, "kill-session", "-t", SESSION], capture_output=True)


@pytest.mark.slow
def test_attach_shows_the_disconnect(model_cache):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    new_session(f"{env(model_cache)} {sys.executable} -m tracer.cli serve tiny-gpt2 --no-tui --port {port}", 80, 24)
    try:
        wait_for(lambda: healthy(url), 90, "the server")
        tmux("new-window", "-d", "-t", SESSION, f"cd {ROOT} && {env(model_cache)} {sys.executable} -m tracer.cli "
             f"attach {url}; sleep 60")
        tmux("resize-window", "-t", f"{SESSION}:1", "-x", "80", "-y", "24")
        wait_for(lambda: "RUNNING" in pane(1), 30, "the attached TUI")
        assert "tiny-gpt2 · cpu · cpu" in pane(1)
        tmux("send-keys", "-t", f"{SESSION}:0", "C-c")
        t0 = time.monotonic()
        wait_for(lambda: "DISCONNECTED" in pane(1), 10, "DISCONNECTED")
        # seen when the event stream ends, not after the source's 10-s HTTP timeout (generous: a loaded CPU)
        assert time.monotonic() - t0 < 8
    finally:
        subprocess.run(["tmux", "-L", SOCKET, "kill-session", "-t", SESSION], capture_output=True)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["0.3 s", "0.8 s", "1.3 s", "the Startup panel"])
def test_ctrl_c_while_serve_starts_is_one_line_and_status_130(model_cache, when):
    """Ctrl-C early is SIGINT (the terminal is still the shell's); once the TUI has the terminal it is
    a key, which the TUI turns into the same signal. Before: a traceback (NoMatches: LogPanel) from
    the app told to exit before it was built, and in the TUI nothing at all. The engine core is held
    stopped until the key is sent, so the key always finds serve still starting."""
    new_session(f"{env(model_cache)} {sys.executable} -m tracer.cli serve tiny-gpt2 --port {free_port()}; "
                f"echo EXIT=$?", 100, 30)
    core = EngineCoreHeld()
    try:
        # A Ctrl-C that reaches the shell before Python has its SIGINT handler ends the whole command line (the
        # `echo EXIT=$?` too), and so does one before main() (Python's traceback, then death by SIGINT): the
        # delay counts from main(), so the key goes to the program under test.
        wait_for(python_runs_main, 30, "python to start in the pane and run vllm-trace's main()")
        if when.endswith(" s"):
            time.sleep(float(when.split()[0]))
        else:  # drawn, not ready: the TUI owns the terminal and the engine is still starting
            wait_for(lambda: "arguments" in pane(), 30, "the Startup panel")
        assert "Ready." not in pane()
        tmux("send-keys", "-t", f"{SESSION}:0", "C-c")
        core.release()
        screen = wait_for(lambda: "EXIT=" in pane() and pane(), 30, "serve to exit")
        said = [line for line in screen.splitlines()  # (serve's first line says it is opening the TUI)
                if line.strip() and "EXIT=" not in line and not line.endswith("opening the TUI…")]
        assert said == ["^Cvllm-trace serve: interrupted"] or said == ["vllm-trace serve: interrupted"], screen
        assert "EXIT=130" in screen
    finally:
        core.release()
        subprocess.run(["tmux", "-L", SOCKET, "kill-session", "-t", SESSION], capture_output=True)
