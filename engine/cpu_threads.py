"""Torch threads and cores for each rank on the CPU (vLLM's ``OMPProcessManager``, utils/ompmultiprocessing.py).

    cpu_placement(parallel, rank)   the rank's cores and threads: CpuPlacement(cpus, threads, bound, reason)
    place_threads(parallel, rank)   apply it in the process that runs the rank (before the weights load)

Serving (an API server shares the machine: ``api_process_count`` > 0) keeps cores for it, as vLLM's CPU
platform does: the allowed cores are split between the ranks, and ``world_size`` of them (one per rank, taken
from the last ranks' tails) are left out, unless that would leave a rank none. Offline (the ``LLM``) every core
goes to the ranks (one rank: torch's default threads). ``VLLM_CPU_NUM_OF_RESERVED_CPU`` sets the number
kept (vLLM's variable), ``--cpu-threads`` or ``OMP_NUM_THREADS`` the threads outright.

Binding (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``): ``auto`` pins each rank's process to its cores, ``0-3|4-7``
gives each rank its cores, ``nobind`` (our default) leaves the kernel to place them. vLLM binds by default, but
only its worker, which runs the forward; our engine core with one rank also runs the scheduler and two socket
threads, and pinning them all to one core made serving slower on a loaded 2-core VM (`vllm bench serve`,
concurrency 32: 229 output tok/s pinned against vLLM's 713 in the same minutes), while the fewer threads
are the lever that counts: 2 threads unbound 1,031-1,272 tok/s, 1 thread about 1,490 (idle machine; see
benchmarks/RESULTS.md). Offline, one thread is the default only if OMP_NUM_THREADS or --cpu-threads says so.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
DEFAULT_BIND = "nobind"


@dataclass(frozen=True)
class CpuPlacement:
    cpus: tuple[int, ...]  # the cores the rank may run on
    threads: int           # torch intra-op (OpenMP) threads
    bound: bool            # its process pinned to `cpus`
    reason: str            # where the numbers come from, in a few words

    def describe(self) -> str:
        """`1 torch thread; serving: 1 of 2 cores left to the API server` (`, bound to cpu 0` when pinned)."""
        where = f", bound to cpu {','.join(map(str, self.cpus))}" if self.bound else ""
        return f"{self.threads} torch thread{'s' * (self.threads != 1)}{where}; {self.reason}"


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def parse_cpu_list(text: str) -> list[int]:
    """'5,2-4' -> [2, 3, 4, 5]."""
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cpus)


def rank_cpu_lists(cpus: list[int], world_size: int, reserve: int) -> tuple[list[list[int]], list[int]]:
    """The allowed cores split into world_size contiguous lists, then `reserve` of them kept for other
    processes, taken from the last ranks first (vLLM's _get_autobind_cpu_ids). No rank is left without one."""
    per = max(1, len(cpus) // world_size)
    lists = [cpus[i * per:(i + 1) * per] or cpus[-1:] for i in range(world_size)]
    if reserve <= 0 or len(cpus) - reserve < world_size:
        return lists, []
    reserved, per_rank = [], [reserve // world_size] * world_size
    for i in range(world_size - 1, world_size - 1 - reserve % world_size, -1):
        per_rank[i] += 1
    for i, num in enumerate(per_rank):
        if num and len(lists[i]) > num:
            reserved += lists[i][-num:]
            lists[i] = lists[i][:-num]
    return lists, reserved


def cpu_placement(parallel, rank: int = 0, env: dict | None = None) -> CpuPlacement:
    """Where rank `rank` runs (see the module docstring); `parallel` is the engine's ParallelConfig."""
    env = os.environ if env is None else env
    world, cpus = parallel.tensor_parallel_size, allowed_cpus()
    bind = env.get(BIND_ENV, DEFAULT_BIND)
    serving = parallel.api_process_count > 0
    if bind not in ("auto", "nobind"):
        lists = [parse_cpu_list(s) for s in bind.split("|")]
        if len(lists) != world:
            raise ValueError(f"{BIND_ENV}={bind!r} gives {len(lists)} core lists for {world} ranks: give one per "
                             f"rank, separated by '|'")
        mine, why = lists[rank], f"{BIND_ENV}={bind}"
    else:
        reserve = int(env[RESERVED_ENV]) if RESERVED_ENV in env else (world if serving else 0)
        lists, reserved = rank_cpu_lists(cpus, world, reserve)
        mine = lists[rank]
        if serving:
            why = (f"serving: {len(reserved)} of {len(cpus)} cores left to the API server" if reserved else
                   f"serving, but {len(cpus)} cores leave none to spare for the API server")
        else:
            why = f"offline: {len(cpus)} cores" + (f" shared by {world} ranks" if world > 1 else "")
    # offline with one rank: torch's own default (every core), untouched
    threads = len(mine) if serving or world > 1 or bind not in ("auto", "nobind") else torch.get_num_threads()
    if parallel.cpu_threads is not None:
        threads, why = parallel.cpu_threads, f"--cpu-threads {parallel.cpu_threads}; {why}"
    elif env.get("OMP_NUM_THREADS", "").isdigit():
        threads, why = int(env["OMP_NUM_THREADS"]), f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}; {why}"
    bound = bind != "nobind" and (serving or bind != "auto") and len(mine) < len(cpus)
    return CpuPlacement(tuple(mine), threads, bound, why)


def place_threads(parallel, rank: int = 0) -> CpuPlacement:
    """Set this process's torch threads (and pin it to its cores where the placement says so)."""
    placement = cpu_placement(parallel, rank)
    if placement.bound and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, placement.cpus)  # this thread; the threads it starts after inherit it
    torch.set_num_threads(placement.threads)
    return placement
