"""The engine's errors that the API server maps to HTTP answers (vLLM V1's ``v1/engine/exceptions.py``).
Importing this module costs no torch: the API server's process never loads it."""


class EngineDeadError(RuntimeError):
    """The engine core died (its process: a crash, a signal, out of memory; or one of its
    tensor-parallel workers): nothing it held survives."""


class EngineClosedError(RuntimeError):
    """The engine is shutting down (or has stopped) and takes no new requests."""
