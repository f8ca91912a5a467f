"""The worker's persistent request state, by slot (vLLM 0.33's ``v1/worker/gpu/states.py``).

A request the scheduler sends whole (``NewRequestData``) takes a free slot and keeps it until it
finishes: its tokens (the prompt, then every token this worker sampled for it), where its computed
tokens end, its sampling parameters and its seed (the sampler keys every draw by (seed, position)).
Later steps only say how far it got (``CachedRequestData``). A preempted request gives its slot up
(``finish_requests`` frees the slots of ``preempted_req_ids`` too, as V1's): it comes back whole, its
prompt and generated tokens to compute again. Slots are rows of numpy buffers that the
input-building steps read by index (``idx_mapping``); the buffers grow when more requests are live
than they have rows, and a row's length grows to max_model_len.
"""
from __future__ import annotations

import numpy as np

from engine.sampling_params import SamplingParams


class CachedRequestState:
    """One live request as the worker's sampler and proposers read it (V1's name)."""
    __slots__ = ("req_id", "all_token_ids", "num_prompt_tokens", "params", "eos_token_id", "seed", "slot")

    def __init__(self, req_id: str, token_ids: list[int], num_prompt_tokens: int, params: SamplingParams,
                 eos_token_id: int | None, seed: int, slot: int):
        self.req_id, self.all_token_ids, self.num_prompt_tokens = req_id, token_ids, num_prompt_tokens
        self.params, self.eos_token_id, self.seed, self.slot = params, eos_token_id, seed, slot

    @property
    def sampling_seed(self) -> int:
        """The seed the sampler keys this request's draws by (with each token's position)."""
        return self.seed

    @property
    def request_id(self) -> str:
        return self.req_id

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class RequestState:
    """Every live request by slot: req_id_to_index / index_to_req_id, the token buffer
    (``token_ids[slot, :num_tokens[slot]]``), num_computed_tokens, and each one's CachedRequestState."""

    def __init__(self, max_num_reqs: int, max_model_len: int):
        self.max_model_len = max_model_len
        self.req_id_to_index: dict[str, int] = {}
        self.index_to_req_id: dict[int, str] = {}
        self.requests: dict[str, CachedRequestState] = {}
        self.free_indices = list(range(max_num_reqs - 1, -1, -1))  # popped from the end: slot 0 first
        self.token_ids = np.zeros((max_num_reqs, min(max_model_len, 256)), np.int64)
        self.num_tokens = np.zeros(max_num_reqs, np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, np.int32)

    @property
    def num_reqs(self) -> int:
        return len(self.requests)

    def add_request(self, req_id: str, prompt_len: int, token_ids: list[int], num_computed_tokens: int,
                    params: SamplingParams, eos_token_id: int | None, seed: int) -> int:
        """Take a free slot (growing the buffers if none is free); returns it."""
        if not self.free_indices:
            n = len(self.num_tokens)
            self.free_indices = list(range(2 * n - 1, n - 1, -1))
            self.token_ids = np.concatenate([self.token_ids, np.zeros_like(self.token_ids)])
            self.num_tokens = np.concatenate([self.num_tokens, np.zeros_like(self.num_tokens)])
            computed = self.num_computed_tokens
            self.num_computed_tokens = np.concatenate([computed, np.zeros_like(computed)])
        slot = self.free_indices.pop()
        self.req_id_to_index[req_id], self.index_to_req_id[slot] = slot, req_id
        self.requests[req_id] = CachedRequestState(req_id, list(token_ids), prompt_len, params, eos_token_id, seed,
                                                   slot)
        self.num_tokens[slot] = 0
        self.append_token_ids(slot, token_ids)
        self.num_computed_tokens[slot] = num_computed_tokens
        return slot

    def remove_request(self, req_id: str) -> int | None:
        """Free its slot; returns it (None for a request not held)."""
        slot = self.req_id_to_index.pop(req_id, None)
        if slot is not None:
            del self.index_to_req_id[slot], self.requests[req_id]
            self.free_indices.append(slot)
        return slot

    def append_token_ids(self, slot: int, token_ids: list[int]) -> None:
        """Write tokens after the slot's last (the buffer's rows grow up to max_model_len)."""
        start = int(self.num_tokens[slot])
        end = start + len(token_ids)
        self.reserve(end)
        self.token_ids[slot, start:end] = token_ids
        self.num_tokens[slot] = end

    def reserve(self, num_tokens: int) -> None:
        """Rows at least num_tokens wide (a new, wider buffer: doubled, at most max_model_len)."""
        if num_tokens > self.token_ids.shape[1]:
            width = min(self.max_model_len, max(num_tokens, 2 * self.token_ids.shape[1]))
            grown = np.zeros((self.token_ids.shape[0], width), np.int64)
            grown[:, :self.token_ids.shape[1]] = self.token_ids
            self.token_ids = grown
