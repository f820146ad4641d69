"""vLLM's per-request lists of a `bench serve` result (vllm/benchmarks/serve.py benchmark()): one entry a request in
the order the requests were made, failed ones included (0 tokens, 0.0 s and their error), times in seconds."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radiance.bench.serve_bench import RequestResult
    from radiance.bench.serve_prompts import PromptSpec

DETAILED_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times",
                 "generated_texts", "errors")
# the lists vLLM's main drops from its result without --save-detailed: "latencies" and "queue_times" stay in it
DROPPED_WITHOUT_DETAILED = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")


def per_request_lists(specs: list[PromptSpec], results: list[RequestResult | None]) -> dict[str, list]:
    """The lists of the requests that finished (None: not sent before a Ctrl-C), as vLLM writes them: input_lens
    the server's usage prompt_tokens else the client's count of the prompt (None where none was taken), output_lens
    the counted output tokens, ttfts / itls / latencies the request's timings, start_times the send's
    perf_counter, queue_times the wait for a --max-concurrency slot, generated_texts the streamed content and
    errors "" for a request that succeeded."""
    lists: dict[str, list] = {key: [] for key in DETAILED_KEYS}
    for spec, r in zip(specs, results):
        if r is None:
            continue
        ok = r.ok
        lists["input_lens"].append(r.prompt_tokens if ok and r.prompt_tokens is not None else spec.prompt_len)
        lists["output_lens"].append(r.output_tokens if ok else 0)
        lists["ttfts"].append(r.ttft_s if ok else 0.0)
        lists["itls"].append(list(r.itl_s) if ok else [])
        lists["latencies"].append(r.e2e_s if ok else 0.0)
        lists["start_times"].append(r.start_s)
        lists["queue_times"].append(r.queue_s)
        lists["generated_texts"].append("".join(r.stream.text) if ok and r.stream is not None else "")
        lists["errors"].append("" if ok else r.error or "")
    return lists


def kept_lists(lists: dict[str, list], save_detailed: bool, vllm_form: bool) -> dict[str, list]:
    """The lists a result keeps: all with --save-detailed, those vLLM keeps without it on a vLLM line (its result
    file's), none on radiance's own line."""
    if save_detailed:
        return dict(lists)
    if vllm_form:
        return {key: value for key, value in lists.items() if key not in DROPPED_WITHOUT_DETAILED}
    return {}
