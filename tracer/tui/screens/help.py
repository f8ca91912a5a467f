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

## Panels (1–6, or click the tabs)
- **Startup** (1): the engine's startup stages with their timings (model files, tokenizer,
  weights, KV-cache allocation with blocks × bytes), then a `curl` line to send a request.
- **Requests** (2): running, then waiting (and preempted), then finished requests: id, state,
  prompt tokens computed/total, generated tokens, age, and *why* a waiting request was not
  admitted this step (token budget, max_num_seqs, no free KV blocks) or why it finished.
  `enter` opens a request: its prompt as token pieces with their ids, the text streaming in,
  its timeline (queued → scheduled → prefill chunks → decode steps → finished), its block
  table (logical → physical block, slots used in the last block) and its prefix-cache hits.
  On a wide terminal the detail of the selected request sits beside the list.
- **KV cache** (3): every physical block as a cell coloured by its owner; ▓ marks blocks
  shared through the prefix cache, ░ free blocks whose contents are still cached, · free
  blocks. A gauge and a sparkline of usage per step. The selected request's blocks stay lit.
- **Step** (4): the current step's batch (which requests, prefill or decode, tokens each, the
  token budget used), the scheduler's decisions (admitted, preempted and why, waiting and why)
  and the flattened model inputs of the selected request (input_ids, positions, slot_mapping,
  query_start_loc, block table).
- **Kernels** (5): each kernel launch of the step with its grid, meta-parameters, duration and a
  sparkline of its time per step. For a Triton attention launch, the program grid (query block
  × KV head); move in it with the arrows to see the physical blocks a program reads.
- **Log** (6): the event stream, `[TRACE] layer name key=value`; `/` filters by layer
  (`scheduler kernel`), request (`request=ID`) or words.

## Keys
| key | |
|---|---|
| `space` | pause / resume the engine (it stops at the next step boundary; requests still arrive) |
| `n` | step over: run one engine step, then hold |
| `s` | step into: run to the next phase (schedule → execute → postprocess) |
| `k` | run to the next kernel launch (held *before* it) |
| `b` | breakpoints: on arrival, finish, preemption, a layer, a kernel, a request id |
| `enter` | open the selected request |
| `tab` / `shift+tab`, arrows | move between and within panels |
| `/` | filter (Requests, Log) |
| `ctrl+p` | command palette: every action, *send a test request*, *export trace* |
| `?` | this help |
| `q` | quit (asks first if requests are in flight) |
| `←` / `→`, `home` / `end` | replay: step back / forward in time, jump to the first / last step |

The header shows the model, device and attention backend, the engine's state (RUNNING,
PAUSED, STEPPING), the step and phase, the queue sizes (W waiting, R running, F finished)
and the URL to send requests to.
"""


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,q,question_mark", "app.pop_screen", "close")]

    def compose(self):
        with VerticalScroll(id="help"):
            yield Markdown(HELP)
