"""How a documented command is run: as a reader runs it, with what a test must add.

- Every command runs in one working folder per document (`.venv` and `lessons/` link to this
  checkout), in document order, so a file one command writes is there for the next.
- `serve` starts a server on a free port (a `--web-port` gets one too) and leaves it up until the
  block ends, as terminal 1 would; the block's later commands reach it where they say port 8000
  (or, for a `serve --port N`, where they say port N). `proxy` is started and stopped as a server.
  A recording server (`--trace-file`) first serves one profiled request, as the user guide's
  profiling does, and is stopped (Ctrl-C, or `q` in its TUI) before a command reads its file.
  Blocks without a `serve` reach one shared `serve tiny-gpt2 --no-tui` (`send` and `bench`
  are pointed at it with `--url`).
- A TUI (`serve` without `--no-tui`, `attach`, `replay`, `lesson --tui`) runs in tmux; once it has
  drawn its screen, `q` quits it and it must exit 0.
- `lesson N` gets an Enter for each checkpoint; `exercise N --check FILE` of an untouched stub
  is run after filling the function in (with `exercise N --solution`, as a reader would with theirs).
- Loads are cut to keep the suite short: `bench --duration` 3 s, `--output-len` 8:16,
  `--num-requests` 8; `--max-tokens` at most 8. `curl` fails on an HTTP error; `curl -N`
  (a stream that never ends: curl's exit status 28) is read for 3 seconds.
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.docs.markdown import ROOT, Command

BIN = ROOT / ".venv" / "bin"
TIMEOUT = 600  # s: a hung command fails instead of hanging the suite
TUIS = ("attach", "replay")


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
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


class Tmux:
    """One tmux server for a document's TUIs; each TUI a session of its own."""

    def __init__(self, workdir: Path, env: dict):
        self.socket, self.workdir, self.env, self.count = f"doc-test-{os.getpid()}-{workdir.name}", workdir, env, 0

    def __call__(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], check=True, capture_output=True, text=True).stdout

    def start(self, code: str) -> tuple[str, Path]:
        self.count += 1
        name, rc = f"tui{self.count}", self.workdir / f".doc-test-rc-{self.count}"
        keep = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items() if k in ("VLLM_TRACE_CACHE", "PATH",
                                                                                     "TRITON_INTERPRET"))
        # COLUMNS/LINES (set under pytest) would override the terminal size Textual reads
        script = f"cd {shlex.quote(str(self.workdir))} && env -u COLUMNS -u LINES {keep} TERM=xterm-256color {code}"
        self("new-session", "-d", "-s", name, "-x", "160", "-y", "48", f"{script}; echo $? > {rc}; sleep 600")
        self("set-option", "-t", name, "window-size", "manual")
        self("resize-window", "-t", f"{name}:0", "-x", "160", "-y", "48")
        return name, rc

    def screen(self, name: str) -> str:
        return self("capture-pane", "-p", "-t", f"{name}:0")

    def quit(self, name: str, rc: Path, command: str) -> None:
        """Wait for the TUI's screen, press q, and expect exit status 0."""
        def status() -> str:  # the exit status, once the shell has written it
            return rc.read_text().strip() if rc.exists() else ""

        wait_for(lambda: status() or len(self.screen(name).split()) > 20, 120, f"{command} to draw")
        assert not status(), f"{command} exited at once:\n{self.screen(name)}"
        for _ in range(12):  # q again every 5 s: one pressed while the app was still starting can be lost
            self("send-keys", "-t", f"{name}:0", "q")
            with contextlib.suppress(AssertionError):
                wait_for(status, 5, "")
                break
        assert status() == "0", f"{command} did not quit on q with status 0 ({status()!r}):\n{self.screen(name)}"

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


@dataclass
class Server:
    """A `serve` the document started: its URL, and how to stop it."""
    command: Command
    url: str
    proc: subprocess.Popen | None = None  # --no-tui
    tui: tuple[str, Path] | None = None
    trace_file: str | None = None


@dataclass
class Runner:
    """Runs one document's blocks, in order, in its working folder."""
    workdir: Path
    shared_url: callable  # () -> the shared server's URL, started on first use
    env: dict = field(default_factory=lambda: dict(os.environ))
    servers: list[Server] = field(default_factory=list)
    background: list[tuple[str, subprocess.Popen]] = field(default_factory=list)  # `cmd &`
    tmux: Tmux | None = None
    ports: dict[str, int] = field(default_factory=dict)  # a server's --port in the document -> its real one

    def __post_init__(self):
        for link in (".venv", "lessons"):
            if not (self.workdir / link).exists():
                (self.workdir / link).symlink_to(ROOT / link)
        self.tmux = Tmux(self.workdir, self.env)

    # ---- one block ----------------------------------------------------------------------------
    def run_bash(self, commands: list[Command]) -> None:
        assignments = []
        try:
            for cmd in commands:
                if cmd.is_assignment:
                    assignments.append(cmd.code)
                    continue
                for server in [s for s in self.servers if s.trace_file and s.trace_file in cmd.argv]:
                    self.stop(server)  # a recording is complete after Ctrl-C
                self.run_one(cmd, assignments)
            for text, proc in self.background:
                assert proc.wait(TIMEOUT) == 0, f"`{text}` exited {proc.returncode}:\n{proc.stderr.read()[-3000:]}"
        finally:
            for _, proc in self.background:
                if proc.poll() is None:
                    proc.kill()
            self.background.clear()
            for server in list(self.servers):
                self.stop(server)

    def run_python(self, code: str) -> None:
        done = subprocess.run([str(BIN / "python"), "-"], input=code, cwd=self.workdir, env=self.env,
                              capture_output=True, text=True, timeout=TIMEOUT)
        assert done.returncode == 0, f"the Python block failed:\n{done.stderr[-3000:]}"

    def close(self) -> None:
        self.tmux.close()

    # ---- one command --------------------------------------------------------------------------
    def run_one(self, cmd: Command, assignments: list[str]) -> None:
        if cmd.program == "make":
            raise AssertionError(f"`{cmd.text}`: make runs in a checkout, not here; mark the block skip and say why")
        if cmd.subcommand in ("serve", "proxy"):
            return self.serve(cmd)
        code = self.rewrite(cmd)
        if cmd.subcommand in TUIS or (cmd.subcommand == "lesson" and "--tui" in cmd.argv):
            name, rc = self.tmux.start(code)
            return self.tmux.quit(name, rc, cmd.text)
        if cmd.subcommand == "exercise" and cmd.option("--check"):
            self.fill_in(cmd)
        stdin = "\n" * 200 if cmd.subcommand == "lesson" and "--no-pause" not in cmd.argv else ""
        script = "\n".join([*assignments, code])
        if code.endswith("&"):  # in the background: waited for at the end of the block
            self.background.append((cmd.text, subprocess.Popen(
                ["bash", "-c", script.removesuffix("&")], cwd=self.workdir, env=self.env, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)))
            return
        done = subprocess.run(["bash", "-c", script], input=stdin, cwd=self.workdir, env=self.env,
                              capture_output=True, text=True, timeout=TIMEOUT)
        streaming = cmd.program == "curl" and "-N" in cmd.argv and done.returncode == 28  # connected, then cut
        assert done.returncode == 0 or streaming, (
            f"`{cmd.text}` exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")

    def url(self) -> str:
        return self.servers[-1].url if self.servers else self.shared_url()

    def rewrite(self, cmd: Command) -> str:
        code, background = cmd.code.removesuffix("&").rstrip(), cmd.code.endswith("&")
        for doc_port, port in self.ports.items():  # a server the document started on its own port
            code = re.sub(rf"(localhost|127\.0\.0\.1):{doc_port}\b", f"127.0.0.1:{port}", code)
        if "8000" in code or cmd.subcommand in ("send", "bench"):
            url = self.url()
            code = re.sub(r"(https?://)?(localhost|127\.0\.0\.1):8000", url, code)
            if cmd.subcommand in ("send", "bench") and "--url" not in cmd.argv:
                code += f" --url {url}"
        if cmd.program == "curl":
            code = code.replace("curl ", "curl -sS --fail-with-body --max-time " +
                                ("3 " if "-N" in cmd.argv else "60 "), 1)
        for option, cut in (("--duration", "3"), ("--output-len", "8:16"), ("--num-requests", "8")):
            if cmd.subcommand == "bench" and cmd.option(option):
                code = code.replace(f"{option} {cmd.option(option)}", f"{option} {cut}")
        if cmd.option("--max-tokens") and int(cmd.option("--max-tokens")) > 8:
            code = code.replace(f"--max-tokens {cmd.option('--max-tokens')}", "--max-tokens 8")
        return code + " &" if background else code

    def fill_in(self, cmd: Command) -> None:
        """The reader fills the function in: here, with what `exercise N --solution` prints."""
        from lessons import exercises

        (self.workdir / cmd.option("--check")).write_text(exercises.find(cmd.argv[2]).solution())

    # ---- servers ------------------------------------------------------------------------------
    def serve(self, cmd: Command) -> None:
        port = free_port()
        code = (self.rewrite(cmd) if cmd.subcommand == "proxy" else cmd.code) + f" --port {port}"
        if cmd.option("--port") not in (None, "8000"):
            self.ports[cmd.option("--port")] = port
        web = cmd.option("--web-port")
        if web:
            web_port = free_port()
            code = code.replace(f"--web-port {web}", f"--web-port {web_port}")
        server = Server(cmd, f"http://127.0.0.1:{port}", trace_file=cmd.option("--trace-file"))
        if "--no-tui" in cmd.argv or cmd.subcommand == "proxy":
            server.proc = subprocess.Popen(["bash", "-c", f"exec {code}"], cwd=self.workdir, env=self.env,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        else:
            server.tui = self.tmux.start(code)
        self.servers.append(server)
        wait_for(lambda: healthy(server.url) or (server.proc and server.proc.poll() is not None), 180,
                 f"`{cmd.text}` to answer on /health")
        assert healthy(server.url), f"`{cmd.text}` exited: {server.proc.stderr.read()[-3000:]}"
        if web:
            page = httpx.get(f"http://127.0.0.1:{web_port}/", timeout=30, trust_env=False)
            assert page.status_code == 200 and "<html" in page.text.lower(), f"the browser view: {page.status_code}"
        if server.trace_file:
            self.profiled_request(server.url)

    @staticmethod
    def profiled_request(url: str) -> None:
        with httpx.Client(base_url=url, timeout=120, trust_env=False) as client:
            assert client.post("/start_profile", json={}).status_code == 200
            body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
            assert client.post("/v1/completions", json=body).status_code == 200
            assert client.post("/stop_profile", json={}).status_code == 200

    def stop(self, server: Server) -> None:
        self.servers.remove(server)
        if server.tui:
            return self.tmux.quit(*server.tui, server.command.text)
        server.proc.send_signal(signal.SIGINT)
        try:
            rc = server.proc.wait(60)
        finally:
            if server.proc.poll() is None:
                server.proc.kill()
        err = server.proc.stderr.read()
        assert rc == 0, f"`{server.command.text}` exited {rc} on Ctrl-C:\n{err[-3000:]}"


def shared_server(stack) -> callable:
    """() -> the URL of one `vllm-trace serve tiny-gpt2 --no-tui` for every document, started on first use."""
    started = {}

    def url() -> str:
        if "url" not in started:
            port = free_port()
            proc = subprocess.Popen([sys.executable, "-m", "tracer.cli", "serve", "tiny-gpt2", "--no-tui", "--port",
                                     str(port)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            stack.callback(lambda: (proc.send_signal(signal.SIGINT), proc.wait(60)))
            started["url"] = f"http://127.0.0.1:{port}"
            wait_for(lambda: healthy(started["url"]) or proc.poll() is not None, 180, "the shared server")
            assert proc.poll() is None, "the shared server exited"
        return started["url"]
    return url
