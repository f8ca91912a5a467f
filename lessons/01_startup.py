"""Lesson 1: from `vllm-trace serve` to ready — the startup stages and what each costs."""
import json
import pathlib
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python lessons/NN_x.py` from a checkout

from engine.hooks import END  # noqa: E402
from engine.model_executor.models.gpt2 import GPT2Model  # noqa: E402
from lessons.cli import main  # noqa: E402
from lessons.framework import events_of, table  # noqa: E402
from tracer.tui.fmt import STAGE_LABELS  # noqa: E402

TITLE = "From `vllm-trace serve` to ready"
SUMMARY = "The startup stages (model, tokenizer, weights, KV cache, HTTP), what each does and costs."
STAGES = ["resolve_model", "tokenizer_load", "model_load", "kv_cache_alloc"]
SERVER_TIMEOUT_S = 45
STAGE_LINE = re.compile(r"^  (\S.*?)\s+([\d.]+) ms\s*(.*)$")  # "  weights   12.3 ms  details"
TRACE_NAME = {label: name for name, label in STAGE_LABELS.items()}  # serve prints words; the trace, names


def start_server(model: str) -> tuple[list[tuple[float, str]], str | None, float]:
    """Run the real server as a subprocess until it prints its ready line, ask it one
    question over HTTP, then stop it. Returns (timestamped stderr lines, /v1/models answer,
    seconds to ready)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tracer.cli", "serve", model, "--no-tui", "--port", "0"],
                            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, bufsize=1)
    lines: queue.Queue = queue.Queue()

    def reader() -> None:
        for line in proc.stderr:
            lines.put((time.perf_counter() - t0, line.rstrip("\n")))
        lines.put(None)

    threading.Thread(target=reader, daemon=True).start()
    seen, models, ready_s = [], None, float("nan")
    try:
        while True:
            item = lines.get(timeout=max(0.1, SERVER_TIMEOUT_S - (time.perf_counter() - t0)))
            if item is None:
                break  # the server exited before it was ready
            seen.append(item)
            m = re.match(r"Ready: .* at (http://\S+)", item[1])
            if m:
                ready_s = item[0]
                with urllib.request.urlopen(m.group(1) + "/v1/models", timeout=10) as r:
                    models = r.read().decode()
                break
    except queue.Empty:
        pass  # not ready in time: the checks below say so
    finally:
        proc.terminate()  # SIGTERM: uvicorn shuts down
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return seen, models, ready_s


def run(lesson) -> None:
    lesson.intro(
        "Before a server answers its first request it must find the model, load its tokenizer and "
        "weights, and carve the **KV cache** out of memory. You will start the real server, read the "
        "stages it prints as they finish, then build the same engine in-process and check what each "
        "stage produced: parameter counts, bytes, and why the cache has exactly that many blocks.")
    _the_real_server_prints_its_stages(lesson)
    engine, core, info = _the_same_stages_in_process(lesson)
    _model_files_tokenizer_and_weights(lesson, engine, core, info)
    per_block = _why_the_cache_has_that_many_blocks(lesson, engine, core, info)
    _weights_versus_cache_on_a_gpu(lesson, info)
    _block_size_8_keeps_the_slots(lesson, info, per_block)
    _what_vllm_adds_on_a_gpu(lesson, core)


def _the_real_server_prints_its_stages(lesson) -> None:
    """Start `vllm-trace serve` as a subprocess and read its startup stages up to ready."""
    lesson.say(f"Starting `vllm-trace serve {lesson.model} --no-tui --port 0` (port 0: any free port) …")
    seen, models, ready_s = start_server(lesson.model)
    lesson.show("\n".join(line for _, line in seen if line.strip()), title="the server's stderr, up to ready")
    stages = [(TRACE_NAME.get(m.group(1), m.group(1)), float(m.group(2)))
              for _, line in seen if (m := STAGE_LINE.match(line))]
    names = [n for n, _ in stages]
    lesson.check(models is not None, f"the server printed its ready line within {SERVER_TIMEOUT_S} s")
    lesson.check(names == ["args", "config", "core_process_start"] + STAGES + ["kernel_warmup", "core_handshake",
                                                                             "http_ready"],
                 "it reports args and config, starts the engine-core process, then that process's four engine "
                 "stages in order and its kernel warm-up, the handshake that says it is ready, then http_ready")
    lesson.check(lesson.model in json.loads(models)["data"][0]["id"],
                 "once ready, GET /v1/models answers with the served model")
    first_stage_at = next(t for t, line in seen if line.lstrip().startswith(STAGE_LABELS[STAGES[0]]))
    engine_ms = sum(ms for n, ms in stages if n in STAGES)
    lesson.say(
        f"The server was ready **{ready_s:.1f} s** after launch. The engine's own stages add up to only "
        f"**{engine_ms:.0f} ms**; most of the wait before *model files* ({first_stage_at:.1f} s) is "
        "Python importing torch and Triton (in the engine-core process) while the API server imports the web "
        "server and the `tokenizers` library (never torch: it does not need it). Real vLLM spends that too, "
        "and more (see below).\n\n"
        "`serve` and the TUI's Startup panel name the stages in words; the trace, and the rest of this lesson, "
        "by the engine's names: *model files* is `resolve_model`, *tokenizer* `tokenizer_load`, *weights* "
        "`model_load`, *KV cache* `kv_cache_alloc`, *kernel warm-up* `kernel_warmup`.\n\n"
        "**kernel_warmup** runs one dummy prefill and one decode through the model before any request "
        "arrives, so the attention kernels are built (compiled, for Triton on a GPU) before a user "
        "waits on them. It is not a request and not an engine step.")
    lesson.check(first_stage_at * 1000 > engine_ms,
                 "the time before the first engine stage (mostly imports) exceeds all engine stages together")
    lesson.pause()


def _the_same_stages_in_process(lesson):
    """Build the engine with the offline `LLM` and read the EngineCore's startup stages.
    Returns (the LLMEngine, its EngineCore, {stage: (seconds, details)})."""
    lesson.say("Now the same startup in this process, with the offline `LLM`, as vLLM V1 cuts it: `LLM` wraps "
               "an `LLMEngine` (the front end: tokenizing, detokenizing), which talks to an `EngineCore` "
               "through an `InprocClient`. The `EngineCore` builds everything below: the executor with its "
               "worker, model runner, model and KV cache, then the scheduler with its KV-cache manager. So the "
               "stages are the `EngineCore`'s: `llm.llm_engine.engine_core.engine_core.startup`.")
    llm, session = lesson.engine(hand_steps=False)  # startup only: no step is taken apart
    engine = llm.llm_engine
    core = engine.engine_core.engine_core  # the EngineCore behind the InprocClient
    info = {name: (sec, d) for name, sec, d in core.startup}
    lesson.show(table(["stage", "ms", "what it produced"], [
        [name, f"{sec * 1000:.1f}", ", ".join(f"{k}={v}" for k, v in d.items() if k not in ("path", "reason"))]
        for name, sec, d in core.startup], title="EngineCore.startup, measured in this process"))
    lesson.check([n for n, _, _ in core.startup] == STAGES, "the engine records the same four stages, in order")
    _async_scheduling_picks_the_scheduler(lesson, core, info)
    spans = [e for e in events_of(session) if e.layer == "engine" and e.kind == END and e.name in STAGES]
    lesson.check([e.name for e in spans] == STAGES and all(e.get("seconds") > 0 for e in spans),
                 "the tracer saw each stage as a timed span (BEGIN/END events)")
    return engine, core, info


def _async_scheduling_picks_the_scheduler(lesson, core, info) -> None:
    lesson.say("What async scheduling (vLLM's default with CUDA; lesson 25) changes here: the scheduler built "
               "is an `AsyncScheduler`, which counts the tokens of a step still in flight as placeholders, and "
               "the loop's step is `step_with_batch_queue`, which schedules the next step while the executor "
               "runs the forward pass on a thread of its own. On a CPU vLLM 0.33 turns it off (there is no "
               "device for the forward pass to overlap with), and so does this engine unless "
               "`--async-scheduling` asks for it. The startup stages are the same either way.")
    on = core.device.type == "cuda"
    lesson.check(type(core.scheduler).__name__ == ("AsyncScheduler" if on else "Scheduler")
                 and core.step_fn == (core.step_with_batch_queue if on else core.step)
                 and core.model_executor.async_scheduling == on
                 and f"async scheduling {'on' if on else 'off'}" in info["model_load"][1]["scheduling"],
                 f"this engine on {core.device.type} schedules {'a' if on else ''}synchronously: "
                 f"{'an AsyncScheduler' if on else 'a Scheduler'}, {core.step_fn.__name__} as its step, and the "
                 f"Startup panel says why ({info['model_load'][1]['scheduling']})")


def _model_files_tokenizer_and_weights(lesson, engine, core, info) -> None:
    """resolve_model, tokenizer_load and model_load: the config, the vocabulary, the parameter count."""
    mc = core.model_config
    lesson.say(
        f"**resolve_model** turns the name into a checkpoint directory (for Hugging Face names: the "
        f"local cache, else a download) and reads `config.json`: a GPT-2 with {mc.n_layer} layers, "
        f"{mc.n_embd} wide, {mc.n_head} heads, vocabulary {mc.vocab_size}. vLLM does the same and picks "
        "the model class from the config's `architectures`.\n\n"
        "**tokenizer_load** loads the Hugging Face tokenizer. In vLLM V1 the tokenizer lives in the "
        "front-end (API server) process, which tokenizes prompts and detokenizes outputs; the engine "
        "core only sees token ids.")
    lesson.check(info["tokenizer_load"][1]["vocab_size"] == len(engine.tokenizer),
                 f"the tokenizer has {len(engine.tokenizer)} tokens")

    d = mc.n_embd
    params = mc.vocab_size * d + mc.n_positions * d + mc.n_layer * (12 * d * d + 13 * d) + 2 * d
    lesson.predict(
        f"GPT-2 has token and position embeddings, {mc.n_layer} blocks of 12·d² + 13·d parameters "
        f"(attention 4·d², MLP 8·d², plus biases and layer norms) and a final layer norm; the LM head is "
        f"tied to the token embedding. With d={d}, how many parameters, and how many bytes in float32?",
        f"{mc.vocab_size}·{d} + {mc.n_positions}·{d} + {mc.n_layer}·(12·{d}² + 13·{d}) + 2·{d} = {params:,} "
        f"parameters × 4 bytes = {params * 4:,} bytes.")
    ml = info["model_load"][1]
    lesson.say("**model_load** builds the model and copies the checkpoint's weights in by name.")
    lesson.check(ml["params"] == params, f"model_load loaded {params:,} parameters, as the formula says")
    lesson.check(core.dtype.itemsize == 4 and ml["bytes"] == ml["params"] * 4,
                 "weights are float32 on the CPU: bytes = parameters × 4")
    lesson.pause()


def _why_the_cache_has_that_many_blocks(lesson, engine, core, info) -> int:
    """kv_cache_alloc: bytes per block, the number of blocks, the null block. Returns bytes per block."""
    mc = core.model_config
    ml = info["model_load"][1]
    kv = info["kv_cache_alloc"][1]
    per_block = 2 * mc.n_layer * kv["block_size"] * mc.n_head * mc.head_size * 4
    lesson.say(
        "**kv_cache_alloc** decides how many KV blocks fit and allocates them: per layer, one K and one "
        "V tensor of `[num_blocks, block_size, heads, head_size]`. One block holds, for "
        f"{kv['block_size']} tokens, K and V of every layer: 2 × {mc.n_layer} layers × "
        f"{kv['block_size']} tokens × {mc.n_head} heads × "
        f"{mc.head_size} dims × 4 bytes = **{per_block:,} bytes**.\n\n"
        f"Why {kv['num_blocks']} blocks? {kv['reason']}.")
    lesson.check(kv["bytes_per_block"] == per_block,
                 "bytes per block = 2 (K and V) × layers × block_size × heads × head_size × 4 bytes (fp32)")
    lesson.check(kv["bytes"] == kv["num_blocks"] * per_block, "KV-cache bytes = blocks × bytes per block")
    allocated = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in core.kv_caches)
    lesson.check(allocated == kv["bytes"], f"the cache tensors really occupy {allocated / 2**20:.0f} MiB")
    if engine.config.cache.num_kv_blocks is None and engine.config.cache.kv_cache_memory is None \
            and core.device.type == "cpu":
        from engine.config import DEFAULT_CPU_KV_CACHE_MEMORY as budget
        lesson.check(kv["num_blocks"] == budget // per_block, f"num_blocks = {budget:,} byte budget // {per_block:,}")
    usable = (kv["num_blocks"] - 1) * kv["block_size"]
    ratio = kv["bytes"] / ml["bytes"]
    lesson.say(f"That is room for **{usable:,} tokens** of context, shared by all requests (block 0 is "
               "the *null block*, as in vLLM V1: never given to a request, so padding in a batch's block "
               f"tables can point at it harmlessly): {usable // engine.max_model_len} requests at the full "
               f"{engine.max_model_len}-token length, or many more short ones. The cache is {ratio:.1f}× the "
               f"size of the weights ({kv['bytes'] / 2**20:.0f} MiB versus {ml['bytes'] / 2**20:.1f} MiB).")
    pool = core.kv_cache_manager.block_pool
    lesson.check(pool.num_usable_blocks == kv["num_blocks"] - 1 and 0 not in pool.free_block_queue,
                 f"{kv['num_blocks'] - 1} blocks are usable: block 0, the null block, is not in the free queue")
    return per_block


def _weights_versus_cache_on_a_gpu(lesson, info) -> None:
    """This setup's cache-to-weights ratio, against Llama-3-8B's on an H100."""
    ml = info["model_load"][1]
    kv = info["kv_cache_alloc"][1]
    ratio = kv["bytes"] / ml["bytes"]
    # A real model on a GPU, by the same arithmetic (public Llama-3-8B config: 32 layers, 8 KV heads
    # of 128 dims, bf16; 8.03e9 parameters) on an 80 GB H100 at gpu_memory_utilization 0.9.
    w8b, kv_tok = 8.03e9 * 2, 2 * 32 * 8 * 128 * 2
    left = 0.9 * 80e9 - w8b - 2e9  # ~2 GB for activations and the CUDA context (vLLM measures this)
    lesson.say(
        f"That {ratio:.0f}× is an artefact of this setup: a fixed CPU budget of {kv['bytes'] / 2**20:.0f} MiB "
        f"against a {ml['bytes'] / 2**20:.1f} MiB toy model. On a GPU with a real model, weights and KV cache "
        f"are **comparable**: Llama-3-8B in bf16 is {w8b / 1e9:.0f} GB of weights; on an 80 GB H100 at "
        f"gpu_memory_utilization 0.9 about {left / 1e9:.0f} GB is left for the cache, "
        f"{left / w8b:.1f}× the weights, at {kv_tok // 1024} KiB per token "
        f"(2 × 32 layers × 8 KV heads × 128 × 2 bytes) ≈ {left / kv_tok / 1e3:.0f}k tokens. A 70B model "
        "split over GPUs has even less cache per byte of weights.")
    lesson.check(1 < left / w8b < 5, f"the 8B example's cache is {left / w8b:.1f}× its weights, not {ratio:.0f}×")


def _block_size_8_keeps_the_slots(lesson, info, per_block: int) -> None:
    """Halving block_size under the same budget doubles the blocks and keeps the token slots."""
    kv = info["kv_cache_alloc"][1]
    capacity = kv["num_blocks"] * kv["block_size"]
    lesson.predict("With block_size 8 instead of 16 and the same budget, how many blocks fit?",
                   "Twice as many, each half the size: the number of token slots does not change.")
    llm8, _ = lesson.engine(block_size=8, hand_steps=False)
    kv8 = llm8.llm_engine.engine_core.engine_core.startup[-1][2]
    lesson.check(kv8["bytes_per_block"] * 2 == per_block and kv8["num_blocks"] * 8 == capacity,
                 f"block_size 8: {kv8['num_blocks']} blocks of {kv8['bytes_per_block']:,} bytes, "
                 f"same {capacity:,} slots")
    lesson.pause()


def _what_vllm_adds_on_a_gpu(lesson, core) -> None:
    lesson.say(
        "**What vLLM adds on a GPU** (not done here — this engine runs eager PyTorch on the CPU):\n\n"
        "- *Memory profiling*: vLLM runs a dummy forward pass at the largest batch "
        "(`max_num_batched_tokens`) to measure peak activation memory, then gives the KV cache "
        "`gpu_memory_utilization` × GPU memory minus weights, activations and other usage. That "
        "budget ÷ bytes per block is the number of blocks. Here the budget is a fixed 256 MiB "
        "(vLLM's CPU backend also takes a fixed size, `VLLM_CPU_KVCACHE_SPACE`).\n"
        "- *torch.compile*: V1 compiles the model's graph (cached on disk), which can take tens of "
        "seconds the first time.\n"
        "- *CUDA graphs*: it captures the forward pass for a list of batch sizes, so a step "
        "replays captured graphs instead of launching hundreds of kernels one by one from Python.\n"
        "- *Processes*: V1 runs the engine core in its own process, fed by the API server over ZMQ; "
        "so does `vllm-trace serve` (its `core_process_start` and `core_handshake` stages above; lesson 17), "
        "unless `--no-multiprocessing` keeps the engine in a thread of the server process.")
    lesson.check(type(core.model) is GPT2Model,
                 "this engine's model is the plain PyTorch module, run eagerly (not compiled)")
    lesson.done(
        "Startup = find the checkpoint and config → load the tokenizer → build the model and load its "
        "weights → size and allocate the KV cache from a memory budget → open the HTTP port. The cache "
        "size is arithmetic: budget ÷ (2 × layers × block_size × heads × head_size × bytes per value). "
        "On a GPU, profiling, torch.compile and CUDA-graph capture make startup much longer.")


if __name__ == "__main__":
    sys.exit(main(globals()))
