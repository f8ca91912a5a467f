"""Each slot's block tables (vLLM 0.33's ``v1/worker/gpu/block_table.py``).

One row per request slot and KV-cache group: the physical blocks of its logical blocks 0, 1, ...,
padded with the null block (0). A dense model has one group; a hybrid one (sliding-window and
full-attention layers) one table per group. The scheduler sends a request's whole tables when it
comes whole (new, or resumed after a preemption), then only the blocks they gained; a step's tables
are gathered from these rows by slot. A sliding-window group's row keeps the blocks its window has
passed (the scheduler gave them back to the pool): the attention never reads them again.
(``resumed_req_ids``, V1's field for a runner that keeps preempted requests, would overwrite the
row; Model Runner V2 and ours never send it.)
"""
from __future__ import annotations

import numpy as np


class BlockTables:
    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, num_kv_cache_groups: int = 1):
        self.num_kv_cache_groups = num_kv_cache_groups
        # per group: [max_num_reqs, max_num_blocks] and each row's length
        self.group_block_tables = [np.zeros((max_num_reqs, max_num_blocks_per_req), np.int32)
                                   for _ in range(num_kv_cache_groups)]
        self.group_num_blocks = [np.zeros(max_num_reqs, np.int32) for _ in range(num_kv_cache_groups)]

    @property
    def block_tables(self) -> np.ndarray:
        """The first group's rows (a dense model's only table)."""
        return self.group_block_tables[0]

    @property
    def num_blocks(self) -> np.ndarray:
        return self.group_num_blocks[0]

    def append_block_ids(self, slot: int, block_ids: tuple[list[int], ...] | None, overwrite: bool) -> None:
        """Add a request's new blocks, one list per group, to its rows (overwrite: they are its whole tables)."""
        if slot >= len(self.num_blocks):  # the request state grew its slots: grow with it
            self._grow(max(slot + 1, 2 * len(self.num_blocks)))
        for g, (table, num) in enumerate(zip(self.group_block_tables, self.group_num_blocks)):
            if overwrite:
                num[slot] = 0
            ids = block_ids[g] if block_ids else ()
            start = int(num[slot])
            table[slot, start:start + len(ids)] = ids
            num[slot] = start + len(ids)

    def _grow(self, n: int) -> None:
        old = len(self.num_blocks)
        for g, table in enumerate(self.group_block_tables):
            table = self.group_block_tables[g] = np.resize(table, (n, table.shape[1]))
            table[old:] = 0
            self.group_num_blocks[g] = np.concatenate([self.group_num_blocks[g], np.zeros(n - old, np.int32)])
