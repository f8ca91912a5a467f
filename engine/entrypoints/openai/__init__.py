"""The HTTP serving path: an OpenAI-compatible FastAPI app over the AsyncLLMEngine.

    http (routers) -> api (protocol models, serving_*) -> AsyncLLMEngine -> engine loop
"""
from engine.entrypoints.openai.app import build_app

__all__ = ["build_app"]
