"""A tensor-parallel worker process: ``python -m engine.executor.worker_proc`` (started by MultiprocExecutor,
its arguments pickled on stdin, as the engine-core process is started).

It dies with its parent (the engine-core process, or the offline LLM's): PR_SET_PDEATHSIG and
a watcher thread, as the core does. It sets its own torch threads and cores (engine.cpu_threads:
the machine's cores shared out between the ranks, fewer while an API server shares them; 2 ranks ×
2 threads on 2 cores measured 5× slower than 1 thread each), joins the process group, then serves
the executor's messages in order:

    load    build this rank's shard; reply ready (what it holds, how many KV blocks fit)
    kv      allocate the KV-cache shard for the number of blocks all ranks agreed on
    warm    the kernel warm-up forward passes (collectives included)
    profile start or stop profiling this rank's ops (and torch.profiler, with a profiler_dir)
    execute one step's SchedulerOutput (ExecuteModel): update the request state, run the forward pass
    sample  the step's grammar bitmask (SampleTokens): every rank samples and replies, only the
            step's output_rank with its ModelRunnerOutput and drafts (the others with their trace events)
    stop    leave the process group and exit

Inside a gated step rank 0 forwards each kernel gate to the executor (a ``gate`` reply) and
waits for ``go``; meanwhile it answers ``rerun`` (run the held attention launch on Triton).
Any exception is sent back as an ``error`` reply (the executor then stops every rank).
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback

import msgspec
import numpy as np
import torch
import zmq

from engine.core.sched.output import GrammarOutput
from engine.cpu_threads import place_threads
from engine.distributed.parallel_state import destroy_distributed, init_distributed
from engine.engine.core_proc import die_with_parent
from engine.hooks import BEGIN, END, Hooks
from engine.serial_utils import EventShipper, encoder
from engine.trace_names import WORKER, WORKER_READY
from engine.worker.worker import ExecuteModel, SampleTokens, Worker, WorkerReply


class WorkerProc:
    """One rank's process: a Worker behind two sockets (see the module docstring)."""

    def __init__(self, args: dict):
        self.args = args
        self.rank, self.world_size = args["rank"], args["world_size"]
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.connect(args["input_addr"])
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.setsockopt(zmq.LINGER, 2000)
        self.output.connect(args["output_addr"])
        self.encode = encoder().encode
        self.hooks = Hooks()
        self._gated = False  # this step may be held at kernel gates (rank 0 forwards them)
        self.shipper: EventShipper | None = EventShipper(self.hooks) if args.get("trace") else None
        self.worker: Worker | None = None

    def run(self) -> int:
        try:
            self._serve()
            return 0
        except BaseException as e:  # one line back to the executor, which stops every rank
            detail = "".join(traceback.format_exception_only(type(e), e)).strip()
            logging.getLogger(__name__).debug("worker failed", exc_info=True)
            self._reply("error", f"worker rank {self.rank}: {detail}")
            return 1
        finally:
            self.input.close(linger=0)
            self.output.close()
            self.ctx.term()

    def _serve(self) -> None:
        decode = msgspec.msgpack.Decoder()
        decode_execute, decode_sample = msgspec.msgpack.Decoder(ExecuteModel), msgspec.msgpack.Decoder(SampleTokens)
        while True:
            kind, payload = self.input.recv_multipart()
            kind = kind.decode()
            if kind == "execute":
                self._execute(decode_execute.decode(payload))
            elif kind == "sample":
                self._sample(decode_sample.decode(payload))
            elif kind == "load":
                self._load()
            elif kind == "kv":
                self._kv(decode.decode(payload))
            elif kind == "warm":
                info = self.worker.warm_up(decode.decode(payload))
                self._reply("warm", info)
            elif kind == "profile":
                self._reply("profile", self.worker.profile(decode.decode(payload)))
            elif kind == "stop":
                destroy_distributed()
                return
            # "go" / "rerun" outside a gate: a stale message after a controller let go; ignore

    # ---- startup ------------------------------------------------------------------------------
    def _load(self) -> None:
        a = self.args
        threads = place_threads(a["config"].parallel, self.rank).describe() if a["device"] == "cpu" else None
        device = torch.device(a["device"])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        with self._stage("model_load") as info:
            tp = init_distributed(self.rank, self.world_size, a["init_method"], device, a["timeout_s"])
            self.worker = Worker(a["config"], a["model_path"], a["model_config"], device, a["dtype"],
                                 a["attention_backend"], tp, self.hooks)
            info |= self.worker.load_model()
            if threads is not None:
                info["threads"] = threads
        num_blocks, why = self.worker.determine_num_blocks()
        self._reply("ready", dict(info, num_blocks=num_blocks, reason=why, pid=os.getpid()))

    def _kv(self, num_blocks: int) -> None:
        with self._stage("kv_cache_alloc") as info:
            info |= self.worker.initialize_kv_cache(num_blocks)
        if self.hooks.active:
            self.hooks.emit(WORKER, WORKER_READY, rank=self.rank, world_size=self.world_size)
        self._reply("kv", info)

    def _stage(self, name: str):
        return _Stage(self, name)

    # ---- steps --------------------------------------------------------------------------------
    def _execute(self, msg: ExecuteModel) -> None:
        self._trace(msg.trace)
        self._gated = msg.gated and self.rank == 0
        self.worker.tp.active = "stepping" if msg.gated else "fast"
        self._gated_call(self.worker.execute_model, msg.scheduler_output)
        self._reply("execute")

    def _sample(self, msg: SampleTokens) -> None:
        self._trace(msg.trace)
        grammar = None
        if msg.grammar_bitmask is not None:
            bitmask = np.frombuffer(bytearray(msg.grammar_bitmask), np.int32).reshape(msg.num_rows, -1)
            grammar = GrammarOutput(msg.structured_output_request_ids, bitmask, msg.num_acceptable_drafts)
        out = self._gated_call(self.worker.sample_tokens, grammar)
        data = None
        if self.rank == msg.output_rank:  # V1's unique_reply_rank
            data = (out, self.worker.take_draft_token_ids()) if out is not None else None
        self._reply("sample", data)

    def _gated_call(self, fn, arg):
        remove = self.hooks.add_gate(self._forward_gate) if self._gated else None
        try:
            return fn(arg)
        finally:
            if remove is not None:
                remove()

    def _forward_gate(self, point: str, info: dict) -> None:
        """Rank 0 at a kernel gate: the executor consults the engine's controller; wait for go."""
        self._reply("gate", dict(point=point, **info))
        while True:
            kind, payload = self.input.recv_multipart()
            if kind == b"go":
                return
            if kind == b"rerun":
                self._reply("rerun", [msgspec.msgpack.decode(payload), *self._rerun()])
            elif kind == b"stop":
                raise SystemExit(0)

    def _rerun(self) -> tuple[bool, object]:
        """The held attention launch on Triton, on a thread of its own: this thread is inside the
        step's launch observer, whose gate would hold the rerun's own launch."""
        out: list = [False, "the rerun did not finish"]

        def run() -> None:
            try:
                out[:] = [True, self.worker.model_runner.held_attention_on_triton()]
            except Exception as e:  # the caller gets the error; the step goes on
                out[:] = [False, f"{type(e).__name__}: {e}"]

        thread = threading.Thread(target=run, name="rerun")
        thread.start()
        thread.join()
        return out[0], out[1]

    def _trace(self, on: bool) -> None:
        if on and self.shipper is None:
            self.shipper = EventShipper(self.hooks)
        elif not on and self.shipper is not None:
            self.shipper.close()
            self.shipper = None

    def _reply(self, kind: str, data=None) -> None:
        events = self.shipper.take() if self.shipper is not None else []
        self.output.send(self.encode(WorkerReply(self.rank, kind, data, events)))


class _Stage:
    """A worker startup stage, traced as a span with this rank (the engine's _Stage, per rank)."""

    def __init__(self, proc: WorkerProc, name: str):
        self.proc, self.name, self.details = proc, name, {"rank": proc.rank, "world_size": proc.world_size}

    def __enter__(self) -> dict:
        self.t0 = time.perf_counter()
        if self.proc.hooks.active:
            self.proc.hooks.emit(WORKER, self.name, BEGIN, **self.details)
        return self.details

    def __exit__(self, exc_type, exc, tb) -> None:
        self.details["seconds"] = time.perf_counter() - self.t0
        if self.proc.hooks.active:
            self.proc.hooks.emit(WORKER, self.name, END, ok=exc_type is None, **self.details)


def run_worker(args: dict) -> None:
    die_with_parent(args["parent_pid"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the front end, which stops us in order
    logging.basicConfig(level=logging.WARNING, format=f"worker rank {args['rank']} %(levelname)s: %(message)s")
    code = WorkerProc(args).run()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no atexit: torch's teardown is slow, and the executor has all it needs


if __name__ == "__main__":
    try:
        worker_args = pickle.load(sys.stdin.buffer)
    except EOFError:  # the executor stopped before it sent our arguments
        sys.exit(0)
    run_worker(worker_args)
