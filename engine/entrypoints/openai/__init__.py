"""The HTTP serving path: an OpenAI-compatible FastAPI app over an EngineClient (AsyncLLM).

    http (routers) -> api (protocol models, serving_*) -> EngineClient (AsyncLLM) -> engine core
"""
from engine.entrypoints.openai.app import build_app

__all__ = ["build_app"]
