"""`?`: what every panel shows and what every key does."""
from __future__ import annotations

from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

HELP = """\
# vllm-trace

A real paged-attention engine (vLLM v1 semantics) that you can watch, pause and step.
Everything shown is something the engine really did: it is folded from the engine's own
trace events, the same ones `--trace-file` records and `vllm-trace replay` reads.

## Panels (1–7, `tab` / `shift+tab`, or click the tabs)
- **Overview** (1): the engine on one screen: the *waiting* queue (each request with the
  reason it was not admitted), the *running* batch, the newest finished requests, this step's
  batch, KV-cache use and the last step's kernel timings. The TUI opens it by itself when the
  engine goes from idle to busy (unless you chose a panel in the last few seconds).
- **Requests** (2): newest and active first (running, waiting, preempted), then finished
  requests: id, state, prompt tokens computed/total, generated tokens, lifetime (from its
  arrival until now, or until it finished), and *why* a
  waiting request was not admitted this step (token budget, max_num_seqs, no free KV blocks)
  or why it finished. The cursor follows the newest request until you move it.
  `enter` opens a request: its prompt as token pieces with their ids, the text streaming in,
  its timeline (queued → scheduled → prefill chunks → decode steps → finished), its block
  table (logical → physical block, slots used in the last block) and its prefix-cache hits.
  On a wide terminal the detail of the selected request sits beside the list.
- **KV cache** (3): every physical block as a cell coloured by its owner; ▓ marks blocks
  shared through the prefix cache, ░ free blocks whose contents are still cached, · free
  blocks. A big cache is drawn k blocks a cell (▒: some of them in use), so it always fits.
  A gauge and a sparkline of usage per step. The selected request's blocks stay lit.
- **Step** (4): the current step's batch (which requests, prefill or decode, tokens each, the
  token budget used), the scheduler's decisions (admitted, preempted and why, waiting and why)
  and the flattened model inputs of the selected request (input_ids, positions, slot_mapping,
  query_start_loc, block table).
- **Kernels** (5): each kernel launch of the step with its grid, meta-parameters (Triton) or
  argument shapes (PyTorch), duration and a sparkline of its time per step. It lists each layer's
  KV-cache write and paged attention (and the collectives with tensor parallelism, and a draft
  model's launches after the target's, named `draft:…`, with speculative decoding); the matmuls,
  layer norms, MLP, LM head and sampler run but are not traced as launches. `enter` on a
  Triton attention launch goes into its program grid (one row per KV head); the arrows pick
  a program and a head and show the physical blocks it reads (`esc`: back to the list).
  On the PyTorch backend, hold the engine before an attention launch (`k`) and press `t`:
  that very launch runs through our Triton kernel (interpreted on a CPU) and its grid, its
  programs and its largest difference from the PyTorch output are shown. With tensor
  parallelism (`--tensor-parallel-size N`) every rank's launches are listed, `all_reduce` and
  `all_gather` with their bytes and site, a line per rank sums its time and communication; `r`
  lists one rank's launches, then the next, then all. The KV cache, Startup and Step panels
  add a line per rank (its heads, its weights, its KV shard, the scheduler output it got).
  While profiling (`p`) every op of the forward pass is a launch: a profiled step is listed
  longest first with its share of the step, FLOPs, bytes, arithmetic intensity (FLOP/byte),
  achieved rate and bound (*memory* under the ridge point of this machine's roofline, *compute*
  above it), over a log-log roofline chart, one point per op kind (`vllm-trace roofline`: the
  peaks, measured once per machine).
- **Log** (6): the event stream, `[TRACE] layer name key=value`; `/` filters by layer
  (`scheduler kernel`), request (`request=ID`) or words.
- **Startup** (7): the engine's startup stages with their timings (model files, tokenizer,
  weights, KV-cache allocation with blocks × bytes), then a `curl` line to send a request.
"""

REPLAY = """\
A replay reads a recorded trace: no engine runs, so nothing can be paused, stepped or sent;
`←` / `→` move through the recorded steps and every panel shows the trace as it was then.
"""

KEYS = [  # (key, what it does, what the source must offer: control an engine, or travel a recording)
    ('`space`', 'pause / resume the engine (it stops at the next step boundary; requests still arrive)', 'control'),
    ('`n`', 'step over: run one engine step, then hold', 'control'),
    ('`s`', 'step into: run to the next phase (schedule → execute_model → grammar bitmask → sample_tokens → '
     'update_from_output)', 'control'),
    ('`k`', 'run to the next kernel launch (held *before* it)', 'control'),
    ('`b`', 'breakpoints: on arrival, finish, preemption, a layer, a kernel, a request id', 'control'),
    ('`t`', 'held before an attention launch: run it through the Triton kernel (Kernels panel)', 'control'),
    ('`r`', "tensor parallelism: the Kernels panel lists the next rank's launches (rank 0, 1, …, all)", None),
    ('`p`', 'profile every op of the forward pass (again: stop); the header shows PROFILING', 'control'),
    ('`i`', 'attached to several servers (`attach URL1 URL2`): show the next one (the header names it)', 'control'),
    ('`enter`', 'open the selected request', None),
    ('`1`–`7`, `tab` / `shift+tab`', 'show a panel (its list takes the arrows, `enter`, `home`/`end`)', None),
    ('`/`', 'filter (Requests, Log)', None),
    ('`ctrl+p`', 'command palette: every action, *send a test request*, *export trace*', 'control'),
    ('`ctrl+p`', 'command palette: every action, *export trace* (Perfetto JSON)', 'travel'),
    ('`?`', 'this help', None),
    ('`q`', 'quit (asks first if requests are in flight)', None),
    ('`ctrl+c`', 'stop, as Ctrl-C does (`serve`: starting, it exits; serving, it drains the requests in flight)', None),
    ('`←` / `→`, `home` / `end`', 'replay: step back / forward in time, jump to the first / last step', 'travel'),
]

HEADER = """\
The header shows the model, device and attention backend, the engine's state (RUNNING,
PAUSED, STEPPING, and PROFILING beside it while `p` is on; DISCONNECTED when an attached
server went away; ENGINE DEAD, with the reason on its second line, when the engine core died),
the step and phase, the
queues (`waiting 0 · running 3 · finished 1`, or `W0 R3 F1` on a narrow terminal) and the
URL to send requests to. Its second line says what a held engine is waiting for.
"""


def help_text(can_control: bool = True, can_time_travel: bool = False) -> str:
    """The help for a source: only the keys it answers (a replay cannot pause or step)."""
    offered = {None: True, "control": can_control, "travel": can_time_travel}
    rows = "".join(f"| {key} | {what} |\n" for key, what, need in KEYS if offered[need])
    replay = f"\n{REPLAY}" if can_time_travel else ""
    return f"{HELP}{replay}\n## Keys\n| key | |\n|---|---|\n{rows}\n{HEADER}"


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,q,question_mark", "app.pop_screen", "close")]

    def __init__(self, can_control: bool = True, can_time_travel: bool = False):
        super().__init__()
        self.text = help_text(can_control, can_time_travel)

    def compose(self):
        with VerticalScroll(id="help"):
            yield Markdown(self.text)
