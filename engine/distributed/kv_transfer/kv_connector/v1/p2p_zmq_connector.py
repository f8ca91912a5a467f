"""P2pZmqConnector: KV blocks pulled from one instance to another over ZMQ (vLLM's ``NixlConnector``
protocol in miniature: its ``kv_transfer_params`` and its pull, with ZMQ sockets for NIXL's RDMA).

Disaggregated prefill, as ``vllm-trace proxy`` drives it:

1. The proxy sends a request to the prefill instance with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": true}``. Its prompt is computed as usual; when it finishes,
   ``request_finished`` keeps its blocks (the scheduler does not free them) and answers
   ``kv_transfer_params``: ``do_remote_prefill``, ``remote_engine_id``, ``remote_request_id``,
   ``remote_block_ids``, ``remote_host``, ``remote_port``.
2. The proxy sends the request to the decode instance with those ``kv_transfer_params``. There
   ``get_num_new_matched_tokens`` answers the prompt's tokens past its own prefix-cache hit, all but the
   last, to arrive asynchronously: the request waits as WAITING_FOR_REMOTE_KVS with its blocks allocated.
3. The decode instance's worker pulls the prompt's blocks from the prefill instance's worker (a ZMQ
   DEALER to its ROUTER at remote_host:remote_port), writes them into its own blocks and reports the
   request received (``get_finished``); its first step computes only the prompt's last token.
4. The prefill instance's worker reports the request sent once it has answered the pull; its blocks
   are freed then (or after ``abort_timeout_s`` if nobody pulls them, as NIXL's abort timeout).

A pull that fails (the prefill instance is gone, or too slow: ``timeout_s``) reports its blocks
invalid: the decode instance computes those tokens itself, and the output is unchanged.

The wire: a pull is one msgpack message {request_id, block_ids}; the answer a header {ok, dtype, shape,
error} then one frame per layer holding that layer's K then V of those blocks, in block order.

kv_connector_extra_config: ``kv_host`` (the address other instances reach this one at, and bind to;
default 127.0.0.1), ``kv_port`` (default 14579; a producer listens there), ``timeout_s`` (a pull's;
default 30), ``abort_timeout_s`` (how long a finished request's blocks wait for their pull; default 120).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from engine.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from engine.request import RequestStatus
from engine.trace_names import KV_RECV, KV_SEND


@dataclass
class RecvMeta:
    """One request's blocks to pull: where from, which of theirs into which of ours."""
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: list[int]
    local_block_ids: list[int]


@dataclass
class P2pZmqConnectorMetadata(KVConnectorMetadata):
    reqs_to_recv: dict[str, RecvMeta] = field(default_factory=dict)
    reqs_to_send: dict[str, float] = field(default_factory=dict)  # request id -> when to give up waiting (monotonic)


class P2pZmqConnector(KVConnectorBase_V1):
    def __init__(self, config, role: KVConnectorRole):
        super().__init__(config, role)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.engine_id = self._kv_transfer_config.engine_id
        self.host, self.port = str(extra.get("kv_host", "127.0.0.1")), int(extra.get("kv_port", 14579))
        self.timeout_s = float(extra.get("timeout_s", 30.0))
        self.abort_timeout_s = float(extra.get("abort_timeout_s", 120.0))
        # scheduler side
        self._local_hits: dict[str, int] = {}  # request id -> its prefix-cache hit (tokens), while it asks
        self._reqs_to_recv: dict[str, RecvMeta] = {}
        self._reqs_to_send: dict[str, float] = {}
        # worker side
        self._lock = threading.Lock()
        self._sending: dict[str, float] = {}  # finished here, blocks held for a pull: request id -> deadline
        self._sent: set[str] = set()  # pulled (or given up on) since the last get_finished
        self._recved: set[str] = set()  # pulls done since the last get_finished
        self._invalid: set[int] = set()  # local blocks whose pull failed
        self._pool: ThreadPoolExecutor | None = None
        self._server: threading.Thread | None = None
        self._ctx: zmq.Context | None = None
        self._closing = threading.Event()

    # ---- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return 0, False
        self._local_hits[request.request_id] = num_computed_tokens
        # all but the last prompt token (its logits sample the first output token: computed here)
        count = request.num_prompt_tokens - 1 - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request, block_ids: list[list[int]], num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # (V1's: pulled once, even if the request is preempted later)
        hit = self._local_hits.pop(request.request_id, 0)
        first, end = hit // self.block_size, -(-(hit + num_external_tokens) // self.block_size)
        remote = list(params["remote_block_ids"])[first:end] if num_external_tokens else []
        # with nothing to pull the prefill instance is still told: it frees the request's blocks
        self._reqs_to_recv[request.request_id] = RecvMeta(
            params["remote_request_id"], params["remote_host"], int(params["remote_port"]), remote,
            list(block_ids[0][first:first + len(remote)]))

    def build_connector_meta(self, scheduler_output) -> P2pZmqConnectorMetadata:
        meta = P2pZmqConnectorMetadata(self._reqs_to_recv, self._reqs_to_send)
        self._reqs_to_recv, self._reqs_to_send = {}, {}
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """A request that asked do_remote_decode keeps its blocks for the decode instance's pull."""
        params = request.kv_transfer_params or {}
        self._local_hits.pop(request.request_id, None)
        if not params.get("do_remote_decode") or request.status is not RequestStatus.FINISHED_LENGTH or not block_ids:
            return False, None
        self._reqs_to_send[request.request_id] = time.monotonic() + self.abort_timeout_s
        return True, dict(do_remote_prefill=True, do_remote_decode=False, remote_engine_id=self.engine_id,
                          remote_request_id=request.request_id, remote_block_ids=list(block_ids),
                          remote_host=self.host, remote_port=self.port)

    # ---- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        self._ctx = zmq.Context()
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kv-pull")
        if self._kv_transfer_config.is_kv_producer:
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.bind(f"tcp://{self.host}:{self.port}")
            except zmq.ZMQError as e:
                sock.close()
                raise RuntimeError(f"P2pZmqConnector cannot listen on {self.host}:{self.port} ({e}): set "
                                   f'"kv_port" in kv_connector_extra_config to a free port') from None
            self._server = threading.Thread(target=self._serve, args=(sock,), name="kv-send", daemon=True)
            self._server.start()

    def start_load_kv(self, **kwargs) -> None:
        meta: P2pZmqConnectorMetadata = self._get_connector_metadata()
        with self._lock:
            self._sending.update(meta.reqs_to_send)
        for rid, r in meta.reqs_to_recv.items():
            self._pool.submit(self._pull, rid, r)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        now = time.monotonic()
        with self._lock:
            expired = {rid for rid, deadline in self._sending.items() if deadline < now}
            for rid in expired:  # nobody pulled them: free them (NIXL's abort timeout)
                del self._sending[rid]
            sent, self._sent = self._sent | expired, set()
            recved, self._recved = self._recved, set()
        return sent or None, recved or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            invalid, self._invalid = self._invalid, set()
        return invalid

    def shutdown(self) -> None:
        self._closing.set()
        if self._server is not None:
            self._server.join(timeout=5)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    # ---- the wire -----------------------------------------------------------------------------
    def _serve(self, sock: zmq.Socket) -> None:
        """The producer's ROUTER: answers each pull with the blocks asked for, then reports the
        request sent (its blocks are freed after the next step)."""
        try:
            while not self._closing.is_set():
                if not sock.poll(100):
                    continue
                ident, *_, payload = sock.recv_multipart()
                t0 = time.perf_counter()
                try:
                    pull = msgspec.msgpack.decode(payload)
                    rid, blocks = str(pull["request_id"]), [int(b) for b in pull["block_ids"]]
                    header, frames = self._read_blocks(blocks)
                except Exception as e:  # a malformed pull: the puller hears why
                    sock.send_multipart([ident, msgspec.msgpack.encode({"ok": False, "error": str(e)})])
                    continue
                sock.send_multipart([ident, msgspec.msgpack.encode(header), *frames])
                with self._lock:
                    self._sending.pop(rid, None)
                    self._sent.add(rid)
                if self.hooks.active:
                    self.record(KV_SEND, rid, blocks, sum(len(f) for f in frames), t0)
        finally:
            sock.close(0)

    def _read_blocks(self, blocks: list[int]) -> tuple[dict, list[bytes]]:
        """The header and one frame per layer (its K then V of those blocks) of a pull's answer."""
        key_cache, _ = next(iter(self.kv_caches.values()))
        if any(not 0 < b < key_cache.shape[0] for b in blocks):
            raise ValueError(f"block ids must be in [1, {key_cache.shape[0] - 1}], got {blocks}")
        frames = [torch.stack([k[blocks], v[blocks]]).cpu().contiguous().view(torch.uint8).numpy().tobytes()
                  for k, v in self.kv_caches.values()] if blocks else []
        header = dict(ok=True, dtype=str(key_cache.dtype), shape=[2, len(blocks), *key_cache.shape[1:]],
                      num_layers=len(self.kv_caches))
        return header, frames

    def _pull(self, rid: str, r: RecvMeta) -> None:
        """The consumer's pull of one request's blocks (on a pool thread): into its own blocks, or, if it
        fails, those blocks reported invalid (the scheduler has their tokens computed instead)."""
        t0 = time.perf_counter()
        try:
            num_bytes = self._fetch(r)
        except Exception as e:
            import logging
            logging.getLogger(__name__).warning("KV pull of %s from %s:%s failed (%s): its prompt is computed here",
                                                rid, r.remote_host, r.remote_port, e)
            with self._lock:
                self._invalid.update(r.local_block_ids)
                self._recved.add(rid)
            return
        if self.hooks.active:
            self.record(KV_RECV, rid, r.local_block_ids, num_bytes, t0)
        with self._lock:
            self._recved.add(rid)

    def _fetch(self, r: RecvMeta) -> int:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{r.remote_host}:{r.remote_port}")
        try:
            sock.send(msgspec.msgpack.encode({"request_id": r.remote_request_id, "block_ids": r.remote_block_ids}))
            if not sock.poll(int(self.timeout_s * 1000)):
                raise TimeoutError(f"no answer in {self.timeout_s:g} s")
            header, *frames = sock.recv_multipart()
        finally:
            sock.close(0)
        h = msgspec.msgpack.decode(header)
        if not h["ok"]:
            raise RuntimeError(h["error"])
        key_cache, _ = next(iter(self.kv_caches.values()))
        shape = [2, len(r.local_block_ids), *key_cache.shape[1:]]
        if h["dtype"] != str(key_cache.dtype) or h["shape"] != shape or len(frames) != len(self.kv_caches) * bool(
                r.local_block_ids):
            raise RuntimeError(f"the remote KV ({h['dtype']}, {h['shape']}) does not fit this model's "
                               f"({key_cache.dtype}, {shape}): both instances must serve the same model")
        for (k, v), frame in zip(self.kv_caches.values(), frames):
            kv = torch.frombuffer(bytearray(frame), dtype=torch.uint8).view(key_cache.dtype).view(shape)
            k[r.local_block_ids] = kv[0].to(k.device)
            v[r.local_block_ids] = kv[1].to(v.device)
        return sum(len(f) for f in frames)
