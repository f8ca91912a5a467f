"""Profiling on demand (vLLM's ``/start_profile``): every op of the forward pass a launch.

``Profiler.start()`` wraps the forward of each of the model's ops (its linear layers, norms,
embeddings, activation and LM head: the leaf modules that do the arithmetic) so that, while the
model runner observes a step with ``profile=True``, each call is recorded by a
``kernels.instrument.Op``: its name (the module's attribute, e.g. ``c_attn``, ``ln_1``,
``lm_head``), op kind, tensor shapes and duration; the cost model (``kernels.op_cost``) adds
FLOPs and bytes when the step's launches are published. ``stop()`` removes the wrappers, so
with profiling off a forward pass runs exactly the code it runs without this module: the cost
is nothing, not even a flag check (the wrapper is an instance attribute shadowing the class's
``forward``, which ``nn.Module.__call__`` looks up each call). While on, recording an op costs
the engine thread ~3 us (a decode token's LayerNorm itself takes ~4 us), and publishing it with
its cost model ~5 us more; the ops' own durations cover about two thirds of a traced decode step
of the built-in model (benchmarks/profiling.py; the rest is the scheduler, the trace points and
Python between ops).

With a ``profiler_dir`` the same window is also captured by ``torch.profiler`` (every aten op,
and on CUDA every kernel with its grid) and written there as one Chrome-trace JSON file per
rank, which ui.perfetto.dev and chrome://tracing open.
"""
from __future__ import annotations

import inspect
import logging
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

from engine.model_executor.layers.activation import NewGELU, SiluAndMul
from engine.model_executor.layers.layernorm import RMSNorm
from engine.model_executor.layers.linear import LinearBase
from engine.model_executor.layers.logits_processor import LogitsProcessor
from engine.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from engine.model_executor.models.gpt2 import Conv1D
from kernels import instrument
from kernels.op_cost import ELEMENTWISE, EMBEDDING, MATMUL, NORM

log = logging.getLogger(__name__)

# module class -> (op kind, cost formula in kernels.op_cost, launch name if not the attribute's)
OPS: dict[type, tuple[str, str, str | None]] = {
    Conv1D: (MATMUL, "matmul", None), LinearBase: (MATMUL, "matmul", None),
    LogitsProcessor: (MATMUL, "matmul", "lm_head"),
    nn.LayerNorm: (NORM, "layer_norm", None), RMSNorm: (NORM, "rms_norm", None),
    nn.Embedding: (EMBEDDING, "embedding", None), VocabParallelEmbedding: (EMBEDDING, "embedding", None),
    NewGELU: (ELEMENTWISE, "gelu_new", "gelu_new"), SiluAndMul: (ELEMENTWISE, "silu_and_mul", "silu_and_mul"),
}


def profiled_forward(name: str, kind: str, formula: str, path: str, module: nn.Module) -> instrument.Op:
    """The module's forward as a profiled op (see the module docstring). Its first argument is
    named ``x`` whatever the module calls it: the cost formulas read "x"."""
    arg_names = ("x", *list(inspect.signature(module.forward).parameters)[1:])
    params = dict(module.named_parameters(recurse=False))
    return instrument.Op(name, kind, module.forward, arg_names, params, {"module": path, "cost": formula},
                         f"profiling: {path} ({type(module).__name__})")


def op_modules(model: nn.Module) -> list[tuple[str, str, str, str, nn.Module]]:
    """(launch name, op kind, cost formula, module path, module) of every op module of a model.
    The launch name is the module's attribute name (``ln_1``, ``c_attn``), qualified by its
    parent's where two modules of a layer share it (GPT-2's ``attn.c_proj`` and ``mlp.c_proj``)."""
    found = []
    for path, module in model.named_modules():
        spec = next((OPS[c] for c in type(module).__mro__ if c in OPS), None)
        if spec is not None:
            found.append((path, module, spec))
    seen: dict[tuple[str, str], int] = {}
    for path, _, _ in found:
        key = _layer_and_leaf(path)
        seen[key] = seen.get(key, 0) + 1
    out = []
    for path, module, (kind, formula, name) in found:
        if name is None:
            name = path.rsplit(".", 1)[-1]
            if seen[_layer_and_leaf(path)] > 1:
                name = ".".join(path.split(".")[-2:])
        out.append((name, kind, formula, path, module))
    return out


def _layer_and_leaf(path: str) -> tuple[str, str]:
    """("h.0", "c_proj") for "h.0.mlp.c_proj"; ("", "ln_f") for "ln_f"."""
    parts = path.split(".")
    i = next((i for i, p in enumerate(parts) if p.isdigit()), -1)
    return ".".join(parts[:i + 1]), parts[-1]


class Profiler:
    """One rank's profiler: start() / stop() (see the module docstring); ``active`` between them."""

    def __init__(self, model: nn.Module, rank: int = 0, profiler_dir: str | None = None):
        self.model, self.rank, self.profiler_dir = model, rank, profiler_dir
        self.active = False
        self._modules: list[nn.Module] = []
        self._torch: torch.profiler.profile | None = None

    def start(self) -> dict:
        if self.active:
            return {"rank": self.rank, "profiling": True}
        for name, kind, formula, path, module in op_modules(self.model):
            module.forward = profiled_forward(name, kind, formula, path, module)
            self._modules.append(module)
        if self.profiler_dir:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._torch = torch.profiler.profile(activities=activities, record_shapes=True)
            self._torch.start()
        self.active = True
        return {"rank": self.rank, "profiling": True, "ops": len(self._modules)}

    def stop(self) -> dict:
        if not self.active:
            return {"rank": self.rank, "profiling": False}
        for module in self._modules:
            del module.forward  # the class's forward again
        self._modules.clear()
        self.active = False
        info = {"rank": self.rank, "profiling": False}
        if self._torch is not None:
            prof, self._torch = self._torch, None
            prof.stop()
            stamp = time.strftime("%Y%m%d-%H%M%S")
            path = Path(self.profiler_dir) / f"rank{self.rank}.{stamp}.{os.getpid()}.pt.trace.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(path))
            info["trace_file"] = str(path)
            log.info("torch.profiler trace of rank %d written to %s (open it in ui.perfetto.dev)", self.rank, path)
        return info

    def step_annotation(self, step: int):
        """A ``step N`` range in the torch.profiler trace (a no-op context without one)."""
        return torch.profiler.record_function(f"step {step}") if self._torch is not None else nullcontext()
