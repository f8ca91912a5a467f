"""SamplingStates: every live request's sampling settings, by slot (vLLM 0.33's ``worker/gpu/sample/states.py``).

A request gets a slot the first time the sampler sees it and keeps it until it finishes
(``remove_request``); its settings are written there once, as arrays the sampler gathers with
the batch's slots (``idx_mapping``) each step instead of reading each request's parameters. The
seed is the request's own (``sampling_seed``, picked by the engine when the user set none), so
every draw is keyed by (seed, position). The token history (penalties, bad words, min_tokens)
is not here: it is the request's, read from the rows the sampler is given.
"""
from __future__ import annotations

import numpy as np

NO_LOGPROBS = -1
_INT64 = 2 ** 64


def as_int64(seed: int) -> int:
    """A seed as the int64 with the same 64 low bits (the key the noise hash and Philox read)."""
    seed %= _INT64
    return seed - _INT64 if seed >= 2 ** 63 else seed


class SamplingStates:
    def __init__(self, max_num_reqs: int = 64):
        self.req_id_to_index: dict[str, int] = {}
        self.params: list = []  # slot -> the SamplingParams written there (None: free)
        self.free: list[int] = []
        self._alloc(max_num_reqs)

    def _alloc(self, n: int) -> None:
        """Grow every array to n slots (the new ones free)."""
        old = len(self.params)

        def grow(name: str, dtype, fill) -> None:
            arr = np.full(n, fill, dtype)
            if old:
                arr[:old] = getattr(self, name)
            setattr(self, name, arr)

        grow("temperature", np.float32, 0.0)
        grow("top_k", np.int64, 0)  # 0: off
        grow("top_p", np.float32, 1.0)
        grow("min_p", np.float32, 0.0)
        grow("seeds", np.int64, 0)
        grow("repetition_penalty", np.float32, 1.0)
        grow("presence_penalty", np.float32, 0.0)
        grow("frequency_penalty", np.float32, 0.0)
        grow("min_tokens", np.int64, 0)
        grow("num_logprobs", np.int64, NO_LOGPROBS)
        # per slot, Python objects: allowed ids, bad words, logit bias, the stop tokens min_tokens blocks
        for name in ("allowed_token_ids", "bad_words_token_ids", "logit_bias", "stop_token_ids"):
            setattr(self, name, getattr(self, name, []) + [None] * (n - old))
        self.params += [None] * (n - old)
        self.free = list(range(n - 1, old - 1, -1)) + self.free

    def add_request(self, req_id: str, params, seed: int, eos_token_id: int | None) -> int:
        """Write a request's settings into a free slot; returns the slot."""
        if not self.free:
            self._alloc(2 * len(self.params))
        i = self.free.pop()
        self.req_id_to_index[req_id] = i
        self.params[i] = params
        self.temperature[i], self.top_p[i], self.min_p[i] = params.temperature, params.top_p, params.min_p
        self.top_k[i] = max(params.top_k, 0)
        self.seeds[i] = as_int64(seed)
        self.repetition_penalty[i] = params.repetition_penalty
        self.presence_penalty[i], self.frequency_penalty[i] = params.presence_penalty, params.frequency_penalty
        self.min_tokens[i] = params.min_tokens
        self.num_logprobs[i] = NO_LOGPROBS if params.logprobs is None else params.logprobs
        self.allowed_token_ids[i] = params.allowed_token_ids
        self.bad_words_token_ids[i] = params.bad_words_token_ids or None
        self.logit_bias[i] = params.logit_bias or None
        stops = list(params.stop_token_ids or ())
        if not params.ignore_eos and eos_token_id is not None:
            stops.append(eos_token_id)
        self.stop_token_ids[i] = stops
        return i

    def remove_request(self, req_id: str) -> None:
        i = self.req_id_to_index.pop(req_id, None)
        if i is not None:
            self.params[i] = self.allowed_token_ids[i] = self.bad_words_token_ids[i] = self.logit_bias[i] = None
            self.free.append(i)

    def index(self, req) -> int:
        """A request's slot (a request row: request_id, params, sampling_seed, eos_token_id), added the
        first time it is seen; a new request that reuses a finished one's id gets its own settings."""
        i = self.req_id_to_index.get(req.request_id)
        if i is None or self.params[i] is not req.params:
            if i is not None:
                self.remove_request(req.request_id)
            seed = req.sampling_seed if req.sampling_seed is not None else req.params.seed
            if seed is None:
                raise ValueError(f"request {req.request_id!r} has no sampling_seed: set it (the engine picks one "
                                 "when SamplingParams.seed is None)")
            i = self.add_request(req.request_id, req.params, seed, req.eos_token_id)
        return i

    def idx_mapping(self, requests: list) -> np.ndarray:
        """Each row's slot (V1's idx_mapping)."""
        return np.array([self.index(r) for r in requests], np.int64)
