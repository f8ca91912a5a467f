"""Both servers started the same way: ``vllm serve DIR`` and ``vllm-trace serve DIR``, the same shared flags.

    with Server("vllm", vllm_bin, model_dir, port) as s: ...   up when /health answers 200; killed on exit

Shared flags mean the same on both: --port, --dtype float32 (the checkpoints' own precision), --max-model-len,
--seed, --chat-template (the built-in tokenizers have none, and transformers 5 has no default); the KV cache
is 256 MiB on both (our CPU default; vLLM's --kv-cache-memory-bytes). Each server
runs in its own process group, and leaving the block stops the group (SIGTERM, then SIGKILL after 20 s).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}Assistant:{% endif %}")
SHARED_FLAGS = ("--dtype", "float32", "--max-model-len", "512", "--seed", "0")
# Our CPU default KV cache (256 MiB), which vLLM names otherwise: its CPU default takes 92 % of the machine's
# memory (--gpu-memory-utilization), and refuses to start when other processes hold some of it.
KV_BYTES = 256 * 2**20
VLLM_FLAGS = ("--kv-cache-memory-bytes", str(KV_BYTES))
START_TIMEOUT_S = 900.0  # vLLM compiles its model with torch.compile at start: minutes on a busy 2-core machine


def chat_template_file(root: Path) -> str:
    path = root / "chat_template.jinja"
    path.write_text(CHAT_TEMPLATE)
    return str(path)


def command(kind: str, bin_dir: str, model: str, port: int, template: str, extra: tuple = ()) -> list[str]:
    exe = os.path.join(bin_dir, "vllm" if kind == "vllm" else "vllm-trace")
    cmd = [exe, "serve", model, "--port", str(port), *SHARED_FLAGS, "--chat-template", template, *extra]
    return cmd + ["--no-tui"] if kind == "ours" else cmd + list(VLLM_FLAGS)


class Server:
    """One server process (its own process group), up once /health says 200."""

    def __init__(self, kind: str, bin_dir: str, model: str, port: int, template: str, log_path: Path,
                 env: dict | None = None, extra: tuple = ()):
        self.kind, self.model, self.port = kind, model, port
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = command(kind, bin_dir, model, port, template, extra)
        self.env = dict(os.environ, **(env or {}))
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT,
                                     start_new_session=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} server exited with {self.proc.returncode}: see {self.log_path}")
            try:
                if get(self.url + "/health")[0] == 200:
                    self.start_s = time.monotonic() - t0
                    print(f"  {self.kind} server up in {self.start_s:.0f} s ({' '.join(self.cmd[1:])})",
                          file=sys.stderr, flush=True)
                    return self
            except OSError:
                pass
            time.sleep(1.0)
        self.__exit__()
        raise RuntimeError(f"{self.kind} server not up after {START_TIMEOUT_S:.0f} s: see {self.log_path}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    def pids(self) -> list[int]:
        """The server's process and its descendants (engine core, workers), whatever their process group."""
        parents = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    parents[int(entry)] = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    pass
        found, frontier = [self.proc.pid], [self.proc.pid]
        while frontier:
            frontier = [pid for pid, ppid in parents.items() if ppid in frontier]
            found += frontier
        return found


def get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def post(url: str, body, timeout: float = 120.0) -> tuple[int, str]:
    data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
