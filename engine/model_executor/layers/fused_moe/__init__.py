"""Mixture-of-experts layers (vLLM's ``layers/fused_moe/``): the router (``router.py``), the
experts' computation (``fused_moe.py``) and the layer holding the experts' weights (``layer.py``)."""
from engine.model_executor.layers.fused_moe.layer import FusedMoE
from engine.model_executor.layers.fused_moe.router import GateLinear, fused_topk

__all__ = ["FusedMoE", "GateLinear", "fused_topk"]
