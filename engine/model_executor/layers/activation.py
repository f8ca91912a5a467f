"""Activation functions as modules (vLLM's ``model_executor/layers/activation.py``): GPT-2's
``gelu_new`` (GELU, tanh approximation), Llama's ``SiluAndMul`` (SwiGLU's gate) and Gemma's
``GeluAndMul`` (GeGLU's, tanh approximation). Modules,
not bare functions, so that profiling (engine/worker/profiler.py) sees each as an op of its own."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class NewGELU(nn.Module):
    """gelu_new: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), Hugging Face GPT-2's activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")


class SiluAndMul(nn.Module):
    """x = [gate | up] (2·F features) -> silu(gate) · up (F features)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up



class GeluAndMul(nn.Module):
    """x = [gate | up] (2·F features) -> gelu_tanh(gate) · up (F features): Gemma's gelu_pytorch_tanh."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
