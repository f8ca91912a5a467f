"""Stop checks on the token ids the engine core sees (vLLM V1's ``v1/core/sched/utils.py``).

Stop *strings* are not here: the core never sees text. The front end's OutputProcessor
matches them and asks the core to finish the request."""
from __future__ import annotations

from engine.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """The status that finishes `request` after its newest token, or None to go on.
    EOS and stop_token_ids count only once it has min_tokens outputs; lengths always."""
    p, num_output_tokens = request.params, request.num_output_tokens
    if num_output_tokens >= p.min_tokens:
        last = request.output_token_ids[-1]
        if not p.ignore_eos and last == request.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if last in p.stop_token_ids:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
    if num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
