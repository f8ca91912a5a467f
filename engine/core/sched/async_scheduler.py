"""The scheduler under async scheduling (vLLM V1's ``v1/core/sched/async_scheduler.py``).

``EngineCore.step_with_batch_queue`` schedules step N+1 while step N's forward pass runs, so when
step N+1 is scheduled nobody knows the tokens step N will sample. They are *placeholders*: each
scheduled request that samples this step gets ``num_output_placeholders`` += 1 (+ its drafts), and
``Scheduler.schedule`` counts them as tokens it has (a decode's next position is the placeholder's).
The workers need no token from the scheduler: each keeps the tokens it sampled, so step N+1's input
id at that position is read from the worker's own buffer once step N has sampled (the worker runs
its calls in order). ``update_from_output`` turns placeholders into real tokens (and takes back the
slots of rejected drafts).

Speculative decoding: the drafts proposed after step N are not known either, so step N+1 verifies
``num_speculative_tokens`` *placeholder draft ids* (-1); the worker (or, under tensor parallelism,
the executor, with rank 0's proposals) puts its real drafts there and verifies as many as it has.
Once they are known (after the step before it sampled), EngineCore hands them to
``update_draft_token_ids_in_output``: the placeholders the worker had no draft for stay -1 and are
counted in ``num_invalid_spec_tokens``, so the statistics count only the drafts really verified, as
the synchronous step's do.

Structured outputs: a request's grammar bitmask needs its previous tokens accepted by its matcher,
so a step that schedules a grammar request with tokens in flight is marked
``pending_structured_output_tokens``: EngineCore runs its forward pass at once (its placeholder
drafts filled with the worker's drafts, unchecked), and after the previous step's
update_from_output checks those drafts against the grammar (update_draft_token_ids_in_output: the
ones it refuses become -1 again), then computes the bitmask (a row per draft position; from the
first -1 on the rows constrain nothing, and the worker verifies no draft there) and samples (V1's).
"""
from __future__ import annotations

from engine.core.sched.output import SchedulerOutput
from engine.core.sched.scheduler import Scheduler


class AsyncScheduler(Scheduler):
    """A Scheduler whose steps may be scheduled before the previous one's tokens are known."""

    def __init__(self, *args, num_spec_tokens: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_spec_tokens = num_spec_tokens  # placeholder drafts per decoding request (speculation on)

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        super()._update_after_schedule(scheduler_output)
        spec = scheduler_output.scheduled_spec_decode_tokens
        for rid in scheduler_output.num_scheduled_tokens:
            req = self.requests[rid]
            if req.is_prefill_chunk:
                continue  # samples nothing this step
            if req.use_structured_output and req.num_output_placeholders > 0:
                scheduler_output.pending_structured_output_tokens = True
            # this step samples one token plus the drafts it verifies: none of them known yet
            req.num_output_placeholders += 1 + len(spec.get(rid, ()))
            req.spec_token_ids = self._placeholder_drafts(req.num_computed_tokens)

    def _placeholder_drafts(self, num_computed_tokens: int) -> list[int]:
        """The next step verifies the drafts proposed after this one, unknown yet: -1 each. As many as
        fit before max_model_len (the step's token, its drafts and the token it samples)."""
        if not self.num_spec_tokens:
            return []
        return [-1] * max(0, min(self.num_spec_tokens, self.max_model_len - num_computed_tokens - 2))
