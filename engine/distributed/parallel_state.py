"""The tensor-parallel group: which rank this process is, and the two collectives the sharded
model needs (vLLM's ``parallel_state`` and ``communication_op``).

``TPGroup(rank=0, world_size=1)`` is the group of an unsharded model: its collectives return
their input. A real group comes from ``init_distributed``: gloo on the CPU, NCCL on CUDA,
meeting at ``init_method`` (default a loopback port; for several machines pass
``tcp://HOST:PORT`` or ``env://`` with MASTER_ADDR / MASTER_PORT set: that path exists but is not
tested here).

Nothing listens beyond the rendezvous host. torch's own ``tcp://`` rendezvous starts rank 0's
TCPStore (an unauthenticated key-value server every rank reads and writes) on *every*
interface, whatever host the URL names; so for ``tcp://`` rank 0 binds the listening socket
itself, to that host, and hands it to the store (``master_listen_fd``). On a loopback host the
backends' own connections stay on loopback too: gloo would otherwise listen on the address the
machine's hostname resolves to, and NCCL's bootstrap on its first non-loopback interface.

Two process groups over the same ranks, because a step controller may stop time. Between
steps the workers wait on a socket, not in a collective, but a kernel-level stop holds rank 0
*inside* the forward pass while the other ranks sit in their next all-reduce. Ungated steps use
the ``fast`` group, whose timeout is seconds (``distributed_timeout_s``): a stuck rank fails
the step quickly instead of after torch's default 30 minutes. A step that starts while a
controller may hold the engine runs on the ``stepping`` group, whose timeout is a day, and a
dead rank is then noticed by the executor's process monitor instead.

Both collectives are traced as kernel launches (layer ``kernel``, names ``all_reduce`` and
``all_gather``) through ``kernels.instrument.call``, with the bytes each rank sends.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import torch

from engine.trace_names import ALL_GATHER, ALL_REDUCE
from kernels import instrument

STEPPING_TIMEOUT = datetime.timedelta(days=1)


@dataclass
class TPGroup:
    """This process's place in the tensor-parallel group (explicit: the model holds one)."""
    rank: int = 0
    world_size: int = 1
    groups: dict = field(default_factory=dict)  # "fast" / "stepping" -> torch.distributed ProcessGroup
    active: str = "fast"  # which of them this step's collectives use (the executor says, per step)
    enable_expert_parallel: bool = False  # a mixture of experts: E/N whole experts a rank (fused_moe/layer.py)

    @property
    def is_driver(self) -> bool:
        """Rank 0: it adds the row-parallel biases, and its step output is the one the executor keeps."""
        return self.rank == 0

    def shard(self, n: int) -> tuple[int, int]:
        """[start, end) of this rank's equal share of n (n must divide evenly)."""
        per = n // self.world_size
        return self.rank * per, (self.rank + 1) * per

    def all_reduce(self, x: torch.Tensor, site: str) -> torch.Tensor:
        """Sum x over the ranks, in place; every rank gets the sum."""
        if self.world_size == 1:
            return x
        meta = dict(op="sum", world_size=self.world_size, bytes=x.numel() * x.element_size(), site=site,
                    group=self.active)
        instrument.call(ALL_REDUCE, self._all_reduce, dict(tensor=x), meta=meta,
                        reason=f"row-parallel {site}: each rank holds a partial sum; the sum, everywhere")
        return x

    def all_gather(self, x: torch.Tensor, site: str) -> torch.Tensor:
        """Concatenate every rank's x along the last dimension, in rank order; every rank gets it."""
        if self.world_size == 1:
            return x
        meta = dict(op="all_gather", world_size=self.world_size, bytes=x.numel() * x.element_size(), site=site,
                    group=self.active)
        return instrument.call(ALL_GATHER, self._all_gather, dict(tensor=x), meta=meta,
                               reason=f"{site}: each rank's slice of the vocabulary, to every rank (each samples)")

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist
        dist.all_reduce(tensor, group=self.groups[self.active])

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.groups[self.active])
        return torch.cat(parts, dim=-1)


def init_distributed(rank: int, world_size: int, init_method: str, device: torch.device,
                     timeout_s: float) -> TPGroup:
    """Join the group (blocks until every rank has joined, or timeout_s passes)."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    store = rendezvous_store(init_method, rank, world_size, timeout)
    if store is None:  # env:// and the like: torch's rendezvous, as configured by its environment
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    ranks = list(range(world_size))
    # new_group is collective: every rank creates the same groups in the same order
    stepping = dist.new_group(ranks, timeout=STEPPING_TIMEOUT, backend=backend)
    return TPGroup(rank, world_size, {"fast": dist.group.WORLD, "stepping": stepping})


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def rendezvous_store(init_method: str, rank: int, world_size: int, timeout: datetime.timedelta):
    """For ``tcp://HOST:PORT``, the ranks' TCPStore with rank 0's server listening on HOST only
    (see the module docstring); None for any other init method."""
    import torch.distributed as dist

    url = urlsplit(init_method)
    if url.scheme != "tcp":
        return None
    host, port = url.hostname, url.port
    if not host or port is None:
        raise ValueError(f"distributed init method {init_method!r}: expected tcp://HOST:PORT")
    if _is_loopback(host):
        # the backends' own sockets: on loopback, unless the user chose an interface
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(max(world_size, 16))
    except OSError:
        sock.close()
        raise
    fd = sock.detach()  # the store owns the socket from here on: Python must not close it under the store
    try:
        return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def destroy_distributed() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
