"""Threads and cores per rank on the CPU (engine.cpu_threads): serving leaves cores to the API server,
offline uses them all, OMP_NUM_THREADS, --cpu-threads and VLLM_CPU_OMP_THREADS_BIND override."""
from __future__ import annotations

import pytest
import torch

from engine import cpu_threads
from engine.arg_utils import EngineArgs
from engine.config import ConfigError, ParallelConfig
from engine.cpu_threads import cpu_placement, parse_cpu_list, rank_cpu_lists


@pytest.fixture
def four_cores(monkeypatch):
    monkeypatch.setattr(cpu_threads, "allowed_cpus", lambda: [0, 1, 2, 3])


def test_rank_cpu_lists_keep_cores_from_the_last_ranks_first():
    assert rank_cpu_lists([0, 1], 1, 1) == ([[0]], [1])
    assert rank_cpu_lists([0, 1, 2, 3], 2, 2) == ([[0], [2]], [1, 3])
    assert rank_cpu_lists([0, 1, 2, 3], 2, 1) == ([[0, 1], [2]], [3])
    assert rank_cpu_lists([0, 1], 2, 2) == ([[0], [1]], [])  # none to spare: every rank keeps its core
    assert rank_cpu_lists([0], 1, 1) == ([[0]], [])
    assert parse_cpu_list("5,2-4") == [2, 3, 4, 5]


def test_serving_leaves_a_core_per_rank_to_the_api_server(four_cores):
    p = cpu_placement(ParallelConfig(api_process_count=1), env={})
    assert (p.cpus, p.threads, p.bound) == ((0, 1, 2), 3, False)
    assert p.describe() == "3 torch threads; serving: 1 of 4 cores left to the API server"
    r1 = cpu_placement(ParallelConfig(tensor_parallel_size=2, api_process_count=1), rank=1, env={})
    assert (r1.cpus, r1.threads, r1.bound) == ((2,), 1, False)
    bound = cpu_placement(ParallelConfig(api_process_count=1), env={"VLLM_CPU_OMP_THREADS_BIND": "auto"})
    assert bound.bound and "bound to cpu 0,1,2" in bound.describe()


def test_offline_uses_every_core_unbound(four_cores):
    p = cpu_placement(ParallelConfig(), env={})
    assert (p.cpus, p.threads, p.bound) == ((0, 1, 2, 3), torch.get_num_threads(), False)
    tp = cpu_placement(ParallelConfig(tensor_parallel_size=2), rank=1, env={})
    assert (tp.cpus, tp.threads) == ((2, 3), 2)


def test_overrides(four_cores):
    serving = ParallelConfig(api_process_count=1)
    assert cpu_placement(serving, env={"OMP_NUM_THREADS": "2"}).threads == 2
    flag = cpu_placement(ParallelConfig(api_process_count=1, cpu_threads=1), env={"OMP_NUM_THREADS": "2"})
    assert flag.threads == 1 and "--cpu-threads 1" in flag.describe()
    assert not cpu_placement(serving, env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}).bound
    assert not cpu_placement(ParallelConfig(), env={"VLLM_CPU_OMP_THREADS_BIND": "auto"}).bound  # offline
    assert cpu_placement(serving, env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "2"}).cpus == (0, 1)
    given = cpu_placement(ParallelConfig(), env={"VLLM_CPU_OMP_THREADS_BIND": "1-2"})
    assert (given.cpus, given.threads, given.bound) == ((1, 2), 2, True)
    with pytest.raises(ValueError, match="one per rank"):
        cpu_placement(ParallelConfig(tensor_parallel_size=2), env={"VLLM_CPU_OMP_THREADS_BIND": "0-3"})


def test_flag_reaches_the_config_and_is_checked():
    args = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser()).parse_args(["--cpu-threads", "1"])
    assert EngineArgs.from_cli_args(args).create_engine_config().parallel.cpu_threads == 1
    with pytest.raises(ConfigError, match="cpu_threads"):
        ParallelConfig(cpu_threads=0)
