"""Executors: how the engine core runs a step's model work (vLLM V1's ``v1/executor``).

``UniProcExecutor``: one rank, a ``Worker`` in this process, handed the scheduler's own objects.

``MultiprocExecutor``: N ranks, one worker process each (``engine.executor.worker_proc``). Every step
the scheduler's own ``SchedulerOutput`` (already a diff: new requests whole, known ones as their
new blocks) is encoded once and sent to every rank (``execute``: the forward pass), then the
step's grammar bitmask (``sample``). Every rank samples (the logits are all-gathered), and only
``output_rank`` (0) sends its ``ModelRunnerOutput`` and drafts back, as V1's
``MultiprocExecutor`` asks for them with ``collective_rpc(..., unique_reply_rank=self.output_rank)``.
In V1 the other ranks send nothing; here every rank still replies to each message, with no
output: the reply carries that rank's trace events, and a phase ends (and the trace shows it)
when every rank has finished it.

Transport: ZMQ over ipc:// sockets, as between the front end and the engine core, not a
shared-memory ring like vLLM's ``shm_broadcast``. A step message here is a few hundred bytes to a
few KB (new requests whole, known ones as their new blocks), and a zmq ipc round trip costs tens
of microseconds against a step of milliseconds; a shared-memory ring pays off when 8 GPUs take
steps of a millisecond. One PUSH socket per worker carries the broadcast; one PULL socket
collects every rank's replies, read by a thread that routes them (step replies and kernel
gates to the engine thread, held-launch reruns to their caller).

Async scheduling: ``execute_model(..., non_block=True)`` and ``sample_tokens(..., non_block=True)``
return futures (V1's). Both executors run the calls, in order, on one thread of their own (the
``executor`` thread), so the engine core schedules the next step while the forward pass runs: with one
rank the forward pass itself runs on that thread (torch releases the GIL in its ops), with N ranks
the thread sends each message and waits for the worker processes' replies.

Faults: a worker that raises replies ``error``; a worker that exits is seen by its monitor
thread. Either way the executor is dead: ``execute_model`` raises ``WorkerDiedError`` (an
``EngineDeadError``), the other ranks are stopped, and ``on_dead(reason)`` is called once, so
the engine-core process can take the same path as its own death (clear error, 503, exit).
Workers die with their parent, so none is ever orphaned.
"""
from __future__ import annotations

import atexit
import itertools
import logging
import os
import pickle
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import replace
from typing import Callable

import msgspec
import numpy as np
import zmq

from engine.core.sched.output import GrammarOutput, SchedulerOutput
from engine.engine.exceptions import EngineDeadError
from engine.hooks import BEGIN, END, Hooks
from engine.outputs import DraftTokenIds, ModelRunnerOutput
from engine.serial_utils import encoder, send_while_alive
from engine.trace_names import EXECUTE_MODEL, MODEL_RUNNER
from engine.utils import child_pythonpath, runtime_dir
from engine.worker.input_batch import resolve_placeholder_drafts
from engine.worker.worker import ExecuteModel, SampleTokens, Worker, WorkerReply

STARTUP_TIMEOUT_S = 600.0  # loading a big model's shard on the CPU
STOP_TIMEOUT_S = 3.0
DEATH_REPLY_WAIT_S = 10.0  # how long an exited worker's error reply may take to be read (a loaded machine)


class WorkerDiedError(EngineDeadError):
    """A tensor-parallel worker died or raised: the executor, and the engine, cannot go on (an
    EngineDeadError: the serving layer answers it as it answers the engine core's death)."""


class Executor:
    """What the engine asks of its ranks. load_model(progress) -> dict (bytes, params, ...);
    determine_num_blocks() -> (n, why), the least over the ranks; initialize_kv_cache(n) ->
    dict; warm_up(max_model_len) -> dict; execute_model(scheduler_output, non_block) -> None or
    a Future of it; sample_tokens(grammar_output, non_block) -> ModelRunnerOutput (output_rank's)
    or a Future of it; take_draft_token_ids(non_block); profile(is_start) -> [each rank's answer];
    held_attention_on_triton() -> dict; shutdown()."""

    tensor_parallel_size = 1
    _thread: ExecutorThread | None = None

    hooks: Hooks

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False):
        if non_block:
            return self._submit(self._execute_traced, scheduler_output)
        return self._execute_traced(scheduler_output)

    def _execute_traced(self, scheduler_output: SchedulerOutput) -> None:
        """The forward pass, traced as a span on the thread that runs it (the executor's under async
        scheduling: the trace shows the next step scheduled while it runs)."""
        if not self.hooks.active:
            return self._execute_model(scheduler_output)
        thread = threading.current_thread().name
        self.hooks.emit(MODEL_RUNNER, EXECUTE_MODEL, BEGIN, step=scheduler_output.step, thread=thread)
        try:
            return self._execute_model(scheduler_output)
        finally:
            self.hooks.emit(MODEL_RUNNER, EXECUTE_MODEL, END, step=scheduler_output.step, thread=thread)

    def sample_tokens(self, grammar_output: GrammarOutput | None, non_block: bool = False):
        if non_block:
            return self._submit(self._sample_tokens, grammar_output)
        return self._sample_tokens(grammar_output)

    def take_draft_token_ids(self, non_block: bool = False):
        """The drafts proposed after the last sample_tokens, once (None without speculation). With
        non_block a Future, run on the executor thread after the calls submitted before it: the
        drafts of the step sampled just before, not of a later one."""
        if non_block:
            return self._submit(self._take_draft_token_ids)
        return self._take_draft_token_ids()

    def _submit(self, fn, *args) -> Future:
        """fn(*args) on the executor thread, after every call submitted before it."""
        if self._thread is None:
            self._thread = ExecutorThread()
            # an executor no one holds (an LLM dropped without shutdown()) ends its thread: the thread
            # holds nothing of it between calls, so its model and KV cache go with it
            weakref.finalize(self, self._thread.close)
        return self._thread.submit(fn, *args)

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._thread.stop()


class ExecutorThread:
    """Runs submitted calls one after another on one daemon thread (a step in flight must not keep
    the process alive at exit, as a ThreadPoolExecutor's worker would); each call's Future."""

    def __init__(self):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="executor", daemon=True)
        self._thread.start()

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        self._calls.put((fut, fn, args))
        return fut

    def close(self) -> None:
        """End the thread after the calls submitted so far, without waiting for it."""
        self._calls.put(None)

    def stop(self, timeout: float = 30.0) -> None:
        """End the thread after the calls submitted so far, and wait for it: a process that exits
        while the thread is inside a torch op is aborted ("terminate called ...")."""
        self._calls.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            fut, fn, args = call
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # the caller's result() raises it
                    fut.set_exception(e)
            # waiting for the next call, hold nothing of this one: a bound method would keep its executor,
            # model and KV cache alive (256 MiB and more per LLM dropped without shutdown())
            del call, fut, fn, args


class UniProcExecutor(Executor):
    """One rank in this process: the worker gets the scheduler's own SchedulerOutput."""

    def __init__(self, worker: Worker, async_scheduling: bool = False):
        self.worker = worker
        self.hooks = worker.hooks
        self.async_scheduling = async_scheduling  # the forward pass runs on the executor thread

    def load_model(self, progress=None) -> dict:
        return self.worker.load_model(progress)

    def determine_num_blocks(self) -> tuple[int, str]:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> dict:
        return self.worker.initialize_kv_cache(num_blocks)

    def warm_up(self, max_model_len: int) -> dict:
        return self.worker.warm_up(max_model_len)

    def _execute_model(self, scheduler_output: SchedulerOutput) -> None:
        return self.worker.execute_model(scheduler_output)

    def _sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput | None:
        return self.worker.sample_tokens(grammar_output)

    def _take_draft_token_ids(self) -> DraftTokenIds | None:
        return self.worker.take_draft_token_ids()

    def profile(self, is_start: bool) -> list[dict]:
        if self.async_scheduling:  # torch.profiler records the thread that starts it: the forward pass's
            return [self._submit(self.worker.profile, is_start).result()]
        return [self.worker.profile(is_start)]

    def held_attention_on_triton(self) -> dict:
        return self.worker.model_runner.held_attention_on_triton()

    def shutdown(self) -> None:
        self._stop_thread()
        self.worker.shutdown()


def _how(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit code {code}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]




class MultiprocExecutor(Executor):
    """N worker processes (see the module docstring). Built by the engine on its own thread;
    execute_model, warm_up and the startup calls run on that thread (the engine thread), which
    is also where forwarded kernel gates are consulted (``hooks.gate``), so a step controller
    holds the engine there exactly as it does with one rank."""

    def __init__(self, config, model_path, model_config, device, dtype, attention_backend: str, hooks: Hooks,
                 on_dead: Callable[[str], None] | None = None):
        pc = config.parallel
        self.tensor_parallel_size = n = pc.tensor_parallel_size
        self.output_rank = 0  # whose sampled tokens come back (V1's _get_output_rank: TP rank 0)
        self.hooks, self.on_dead = hooks, on_dead
        self.dead: str | None = None
        self._closing = False
        self._replies: queue.Queue = queue.Queue()  # step / gate / startup replies, and death notices
        self._said_why = [threading.Event() for _ in range(n)]  # a rank's error reply has been read
        self._why: dict[int, str] = {}  # ... and what it said
        self._reruns: dict[int, Future] = {}
        self._rerun_ids = itertools.count(1)
        self._send_lock = threading.Lock()  # zmq sockets are not thread-safe
        self._draft_token_ids: DraftTokenIds | None = None  # output_rank's, from the last sample_tokens
        self._last_drafts: dict[str, list[int]] = {}  # ... kept: they fill placeholder drafts (async scheduling)
        self._dir = tempfile.mkdtemp(prefix="vllm-trace-workers-", dir=runtime_dir())
        self.ctx = zmq.Context()
        self.results = self.ctx.socket(zmq.PULL)
        out_addr = f"ipc://{self._dir}/results"
        self.results.bind(out_addr)
        self.inputs = []
        if device.type == "cuda":
            import torch
            if torch.cuda.device_count() < n:
                raise ValueError(f"tensor_parallel_size={n} needs {n} CUDA devices; "
                                 f"this machine has {torch.cuda.device_count()}")
        init_method = pc.distributed_init_method or f"tcp://127.0.0.1:{_free_port()}"
        self.procs: list[subprocess.Popen] = []
        for rank in range(n):
            sock = self.ctx.socket(zmq.PUSH)
            addr = f"ipc://{self._dir}/rank{rank}"
            sock.bind(addr)
            self.inputs.append(sock)
            args = dict(rank=rank, world_size=n, input_addr=addr, output_addr=out_addr, init_method=init_method,
                        timeout_s=pc.distributed_timeout_s, config=config, model_path=model_path,
                        model_config=model_config, dtype=dtype, attention_backend=attention_backend,
                        device=f"cuda:{rank}" if device.type == "cuda" else "cpu", parent_pid=os.getpid(),
                        trace=hooks.active)
            proc = subprocess.Popen([sys.executable, "-m", "engine.executor.worker_proc"], stdin=subprocess.PIPE,
                                    env=os.environ | {"PYTHONPATH": child_pythonpath()}, process_group=0)
            proc.stdin.write(pickle.dumps(args))
            proc.stdin.close()
            self.procs.append(proc)
        self._reader = threading.Thread(target=self._read, name="executor-results", daemon=True)
        self._reader.start()
        for rank, proc in enumerate(self.procs):
            threading.Thread(target=self._monitor, args=(rank, proc), name=f"worker-{rank}-monitor",
                             daemon=True).start()
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().shutdown())
        self.ranks: list[dict] = [{} for _ in range(n)]  # what each rank reported at startup

    # ---- startup -------------------------------------------------------------------------------
    def load_model(self, progress=None) -> dict:
        replies = self._all("load", None, "ready", STARTUP_TIMEOUT_S)
        for r in replies:
            self.ranks[r.rank] = dict(r.data)
        return dict(bytes=sum(r.data["bytes"] for r in replies), params=replies[0].data["model_params"],
                    tensor_parallel_size=self.tensor_parallel_size)

    def determine_num_blocks(self) -> tuple[int, str]:
        rank = min(range(self.tensor_parallel_size), key=lambda r: self.ranks[r]["num_blocks"])
        n = self.ranks[rank]["num_blocks"]
        return n, f"{self.ranks[rank]['reason']} (the least of {self.tensor_parallel_size} ranks: rank {rank})"

    def initialize_kv_cache(self, num_blocks: int) -> dict:
        replies = self._all("kv", num_blocks, "kv", STARTUP_TIMEOUT_S)
        ranks = [dict(rank=r.rank, heads=r.data["heads"], kv_heads=r.data["kv_heads"], bytes=r.data["bytes"],
                      bytes_per_block=r.data["bytes_per_block"]) for r in replies]
        first = replies[0].data
        return dict(num_blocks=num_blocks, block_size=first["block_size"], bytes=sum(r["bytes"] for r in ranks),
                    bytes_per_block=sum(r["bytes_per_block"] for r in ranks),
                    tensor_parallel_size=self.tensor_parallel_size, ranks=ranks,
                    **{k: first[k] for k in ("num_heads", "num_kv_heads", "head_size", "num_layers", "kv_cache_groups")
                       if k in first})

    def warm_up(self, max_model_len: int) -> dict:
        replies = self._all("warm", max_model_len, "warm", STARTUP_TIMEOUT_S)
        return replies[0].data

    def profile(self, is_start: bool) -> list[dict]:
        """Every rank starts or stops profiling (V1's ``collective_rpc("profile")``), between steps:
        under async scheduling on the executor thread, after the step still in flight (whose replies
        that thread is reading)."""
        def call() -> list[dict]:
            return [dict(r.data) for r in self._all("profile", is_start, "profile", STARTUP_TIMEOUT_S)]

        return self._submit(call).result() if self._thread is not None else call()

    # ---- steps ---------------------------------------------------------------------------------
    def _execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Broadcast the scheduler output (encoded once, the same bytes to every rank), consult
        forwarded kernel gates (on this, the engine thread), wait for every rank's forward pass.
        Raises WorkerDiedError if a rank fails."""
        self._check()
        spec = scheduler_output.scheduled_spec_decode_tokens
        if spec:  # async scheduling: placeholder drafts become output_rank's proposals, the same on every rank
            scheduler_output = replace(scheduler_output, scheduled_spec_decode_tokens=resolve_placeholder_drafts(
                spec, self._last_drafts))
        msg = ExecuteModel(scheduler_output, self.output_rank, gated=self.hooks.gated, trace=self.hooks.active)
        self._round(b"execute", encoder().encode(msg), "execute")

    def _sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput | None:
        """Every rank samples (the same tokens); output_rank's ModelRunnerOutput, and its drafts
        for take_draft_token_ids."""
        self._check()
        msg = SampleTokens(output_rank=self.output_rank, trace=self.hooks.active)
        if grammar_output is not None:
            msg.structured_output_request_ids = grammar_output.structured_output_request_ids
            msg.grammar_bitmask = np.ascontiguousarray(grammar_output.grammar_bitmask, np.int32).tobytes()
            msg.num_rows = len(grammar_output.grammar_bitmask)
            msg.num_acceptable_drafts = grammar_output.num_acceptable_drafts
        data = self._round(b"sample", encoder().encode(msg), "sample")
        if data is None:
            return None
        output, drafts = data
        self._draft_token_ids = msgspec.convert(drafts, DraftTokenIds) if drafts is not None else None
        d = self._draft_token_ids
        self._last_drafts = dict(zip(d.req_ids, d.draft_token_ids)) if d is not None else {}
        return msgspec.convert(output, ModelRunnerOutput) if output is not None else None

    def _take_draft_token_ids(self) -> DraftTokenIds | None:
        drafts, self._draft_token_ids = self._draft_token_ids, None
        return drafts

    def _round(self, kind: bytes, payload: bytes, reply_kind: str):
        """Send one step message to every rank; forward kernel gates until every rank replied;
        output_rank's data."""
        self._broadcast(kind, payload)
        pending, result, events = set(range(self.tensor_parallel_size)), None, []
        while pending:
            reply = self._next(None)
            if reply.kind == "gate":
                self._emit(reply.events)
                info = dict(reply.data)
                self.hooks.gate(info.pop("point"), **info)
                self._send(0, b"go", b"")
                continue
            if reply.kind != reply_kind:
                self._fail(f"worker rank {reply.rank} sent {reply.kind!r} during a step")
            events += reply.events
            pending.discard(reply.rank)
            if reply.rank == self.output_rank:
                result = reply.data
        events.sort(key=lambda e: e[6])  # the ranks' launches, interleaved in time (one clock on Linux)
        self._emit(events)
        return result

    def held_attention_on_triton(self) -> dict:
        """Rank 0's held attention launch, rerun on Triton there (called from another thread
        while a forwarded gate holds the engine)."""
        self._check()
        call_id = next(self._rerun_ids)
        fut = self._reruns[call_id] = Future()
        self._send(0, b"rerun", msgspec.msgpack.encode(call_id))
        try:
            ok, result = fut.result(timeout=120)
        finally:
            self._reruns.pop(call_id, None)
        if not ok:
            raise ValueError(result.split(": ", 1)[-1])
        return result

    # ---- plumbing ------------------------------------------------------------------------------
    def _all(self, kind: str, payload, reply_kind: str, timeout: float) -> list[WorkerReply]:
        self._broadcast(kind.encode(), msgspec.msgpack.encode(payload))
        replies = {}
        deadline = time.monotonic() + timeout
        while len(replies) < self.tensor_parallel_size:
            reply = self._next(max(0.0, deadline - time.monotonic()))
            self._emit(reply.events)
            if reply.kind != reply_kind:
                self._fail(f"worker rank {reply.rank} sent {reply.kind!r}, expected {reply_kind!r}")
            replies[reply.rank] = reply
        return [replies[r] for r in sorted(replies)]

    def _next(self, timeout: float | None) -> WorkerReply:
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            self._fail(f"the workers did not answer within {timeout:.0f} s")
        if isinstance(reply, str):  # a death notice
            self._fail(reply)
        if reply.kind == "error":
            self._emit(reply.events)
            self._fail(self._root_cause(reply.rank, reply.data))
        return reply

    def _root_cause(self, rank: int, error: str) -> str:
        """A rank that died makes its peers' collectives fail ("connection reset"): name the death."""
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            for other, proc in enumerate(self.procs):
                code = proc.poll()
                if other != rank and code is not None and code < 0:  # killed: a rank that raised exits 1
                    return f"worker rank {other} died ({_how(code)})"
            time.sleep(0.02)
        return error

    def _emit(self, events: list) -> None:
        if events and self.hooks.active:
            self.hooks.emit_many([tuple(e[:6]) for e in events], [e[6] for e in events])

    def _broadcast(self, kind: bytes, payload: bytes) -> None:
        self._send_to(range(self.tensor_parallel_size), kind, payload)

    def _send(self, rank: int, kind: bytes, payload: bytes) -> None:
        self._send_to([rank], kind, payload)

    def _send_to(self, ranks, kind: bytes, payload: bytes) -> None:
        """Raises WorkerDiedError if a rank is gone (a plain send to it would block for ever,
        holding the lock _mark_dead needs)."""
        died = None
        with self._send_lock:
            for rank in ranks:
                code = send_while_alive(self.inputs[rank], [kind, payload], self.procs[rank])
                if code is not None:
                    died = f"worker rank {rank} died ({_how(code)})"
                    break
        if died is not None:
            self._fail(died)

    def _read(self) -> None:
        decode = msgspec.msgpack.Decoder(WorkerReply).decode
        poller = zmq.Poller()
        poller.register(self.results, zmq.POLLIN)
        while not self._closing:
            try:
                if not poller.poll(100):
                    continue
                frame = self.results.recv()
            except zmq.ZMQError:
                return
            try:  # a frame that is not a rank's (any process of this user can connect) must not end this thread
                reply = decode(frame)
                if reply.kind == "rerun":
                    call_id, ok, result = reply.data
            except (msgspec.DecodeError, TypeError, ValueError) as e:
                logging.getLogger(__name__).warning("ignored a %d-byte frame on the workers' result socket that is "
                                                    "not a worker's reply (%s)", len(frame), e)
                continue
            if reply.kind == "rerun":
                fut = self._reruns.get(call_id)
                if fut is not None and not fut.done():
                    fut.set_result((ok, result))
                continue
            self._replies.put(reply)
            if reply.kind == "error" and 0 <= reply.rank < len(self._said_why):
                self._why[reply.rank] = str(reply.data)
                self._said_why[reply.rank].set()

    def _monitor(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self._closing:
            return
        # A worker that raised sent an error reply, then exited 1: that reply says why, not the exit.
        # Wait for the reader to have it (not a fixed time: a loaded machine can take seconds to read it).
        if code >= 0:
            self._said_why[rank].wait(DEATH_REPLY_WAIT_S)
        reason = self._why.get(rank) or f"worker rank {rank} died ({_how(code)})"
        self._replies.put(reason)
        self._mark_dead(reason)

    def _mark_dead(self, reason: str) -> None:
        with self._send_lock:
            if self.dead is not None:
                return
            self.dead = reason
        # Its sockets' files now, not at the end of the shutdown below: the process may exit first
        # (the engine core does, at once). Connected sockets do not need their files.
        shutil.rmtree(self._dir, ignore_errors=True)
        for fut in list(self._reruns.values()):
            if not fut.done():
                fut.set_result((False, reason))
        threading.Thread(target=self.shutdown, name="executor-stop", daemon=True).start()
        if self.on_dead is not None:
            self.on_dead(reason)

    def _fail(self, reason: str):
        self._mark_dead(reason)
        raise WorkerDiedError(self.dead)

    def _check(self) -> None:
        if self.dead is not None:
            raise WorkerDiedError(self.dead)

    def shutdown(self) -> None:
        """Stop every worker (politely, then by force) and close the sockets. Safe to call twice."""
        self._stop_thread()
        with self._send_lock:
            if self._closing:
                return
            self._closing = True
        if self._thread is not None:  # a step in flight (async scheduling) fails rather than waits for ever
            self._replies.put("the executor shut down")
        with self._send_lock:
            for sock in self.inputs:
                try:
                    sock.send_multipart([b"stop", b""], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._reader.join(1)
        for sock in [*self.inputs, self.results]:
            sock.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
