"""Each slot's block table (vLLM 0.33's ``v1/worker/gpu/block_table.py``).

One row per request slot: the physical blocks of its logical blocks 0, 1, ..., padded with the
null block (0). The scheduler sends a request's whole table when it comes whole (new, or resumed
after a preemption), then only the blocks it gained; a step's tables are gathered from these rows
by slot. (``resumed_req_ids``, V1's field for a runner that keeps preempted requests, would
overwrite the row; Model Runner V2 and ours never send it.)
"""
from __future__ import annotations

import numpy as np


class BlockTables:
    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int):
        self.block_tables = np.zeros((max_num_reqs, max_num_blocks_per_req), np.int32)
        self.num_blocks = np.zeros(max_num_reqs, np.int32)

    def append_block_ids(self, slot: int, block_ids: tuple[list[int], ...] | None, overwrite: bool) -> None:
        """Add a request's new blocks to its row (overwrite: they are its whole table)."""
        if slot >= len(self.num_blocks):  # the request state grew its slots: grow with it
            n = max(slot + 1, 2 * len(self.num_blocks))
            self.block_tables = np.resize(self.block_tables, (n, self.block_tables.shape[1]))
            self.block_tables[len(self.num_blocks):] = 0
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros(n - len(self.num_blocks), np.int32)])
        if overwrite:
            self.num_blocks[slot] = 0
        if not block_ids:
            return
        ids = block_ids[0]
        start = int(self.num_blocks[slot])
        self.block_tables[slot, start:start + len(ids)] = ids
        self.num_blocks[slot] = start + len(ids)
