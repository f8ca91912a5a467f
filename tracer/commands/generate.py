"""`vllm-trace generate MODEL PROMPT...`: offline generation, printed."""
from __future__ import annotations

import argparse
import sys

from engine.arg_utils import EngineArgs
from tracer.commands import HelpFormatter, model_help


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion offline and print it",
                       description="Run the engine offline on one or more prompts and print each completion.",
                       formatter_class=HelpFormatter)
    p.add_argument("model", help=model_help())
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text (several run as one batch)")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: draw from the fewest most likely tokens whose probabilities sum to P "
                        "(1 = off)")
    s.add_argument("--top-k", type=int, default=-1, help="-1 = off")
    s.add_argument("--min-p", type=float, default=0.0,
                   help="drop the tokens less likely than P times the most likely token's probability (0 = off)")
    s.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    EngineArgs.add_cli_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed, stop=args.stop,
                            ignore_eos=args.ignore_eos)
    print(f"loading {args.model} ...", file=sys.stderr)
    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    for out in llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 1):
        c = out.outputs[0]
        if len(args.prompts) > 1:
            print(f"--- request {out.request_id}: {out.prompt!r}")
        print(f"{out.prompt}{c.text}")
        print(
            f"[{len(out.prompt_token_ids)} prompt tokens, {len(c.token_ids)} generated, "
            f"finish_reason={c.finish_reason}]",
            file=sys.stderr,
        )
    return 0
