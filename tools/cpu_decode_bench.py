"""Single-stream decode speed of a model on this machine's CPU (default: the embedded SmolLM2).

Per-token decode time = (time of 8 + N tokens - time of 8 tokens) / N, greedy, best of --repeats, so the
prefill and the request overhead cancel. Engine options go through as flags of `radiance serve`:

    python3 tools/cpu_decode_bench.py                                  # the default serving
    python3 tools/cpu_decode_bench.py --dtype float32 --cpu-int4 false # the exact path
"""

from __future__ import annotations

import argparse
import time

from radiance import LLM, SamplingParams
from radiance.config_cli import add_engine_args, engine_config_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="decode tokens timed (after 8 untimed)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--context", type=int, default=0,
                        help="prompt length in tokens (decode then runs at this depth); 0: the prompt 'Hi'")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    llm = LLM.from_engine_config(engine_config_from_args(args, device=getattr(args, "device", None) or "cpu",
                                                         max_num_seqs=1))

    prompt = [[100 + i % 1000 for i in range(args.context)]] if args.context else ["Hi"]

    def run(tokens: int) -> float:
        started = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - started

    run(8)
    # the best of each length, then their difference: a difference per repeat went negative on a busy machine
    longer = min(run(8 + args.tokens) for _ in range(args.repeats))
    shorter = min(run(8) for _ in range(args.repeats))
    best = (longer - shorter) / args.tokens
    if best <= 0:
        raise SystemExit(f"timings too noisy ({longer:.3f} s for {8 + args.tokens} tokens, {shorter:.3f} s for 8): "
                         "raise --tokens or --repeats on a quieter machine")
    print("\n".join(llm.engine.load_summary))
    print(f"decode {best * 1e3:.2f} ms/token = {1 / best:.1f} tok/s (best of {args.repeats}, {args.tokens} tokens"
          f"{f' after {args.context} prompt tokens' if args.context else ''})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
