"""Randomized churn of the engine: seeded scenarios that mix what the other engine tests cover one at a time, on
the tiny text model (fp32, CPU): staggered arrivals, aborts at random steps, a KV cache small enough to preempt,
chunked and unchunked prefill, prefix-cache hits (shared prefixes, repeated prompts, follow-up turns, cache salts),
overlapped decode, n > 1, stop strings and stop tokens, min_tokens, logprobs and prompt logprobs, n-gram
speculation, structured output (JSON schema, regex, choice), seeded sampling, penalties, logit bias,
allowed_token_ids, bad words, outputs that reach max_model_len. Each seed picks a profile (PROFILES) that forces
part of the engine's options; the rest is random. What must hold whatever the mix:

- each request's outputs are those it gets served alone on a roomy engine (greedy, or seeded): every streamed
  output a prefix of that, the finished one equal to it (tokens, text, finish and stop reason, logprobs);
- each request ends exactly once (its own finished output, or one "abort" output after its abort, and nothing
  after that);
- after every step the block manager's reference counts are those of the sequences' block tables, the free list
  holds exactly the unreferenced blocks and waiting sequences hold none; at the end every block is free (cached
  ones evictable), the queues are empty and the stats add up (generation_tokens_total: every token appended, a
  preempted request's once, an aborted one's up to its abort; the prefix-cache counters per first admission);
- the same under AsyncLLMEngine with concurrent clients that leave mid-stream (some sending the same request id
  again at once) or whose tasks are cancelled.

What the churn found is kept at the end as focused repros.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from contextlib import aclosing
from dataclasses import dataclass, field, replace

import pytest
import torch

from radiance import SamplingParams
from radiance.engine.async_engine import AsyncLLMEngine
from radiance.engine.outputs import StepOutput
from radiance.engine.sequence import Sequence, SequenceStatus
from radiance.engine.structured_output import StructuredOutput

TEXT_TOKENS = 300  # the tiny tokenizer's tokens (0 is <eos>); the model's vocabulary has a few more rows
SCHEMA = StructuredOutput(json=json.dumps({
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False}))
REGEX = StructuredOutput(regex=r"[a-z]{1,5}( [a-z]{1,5}){0,4}")
CHOICE = StructuredOutput(choice=("Paris", "Rome", "the capital of France"))
# prompts of 3 to 12 of one of these tokens: the tiny text model answers each with a run of one token (greedy), so
# n-gram drafts are kept (they only make speculation pay; any tokens would test the same)
STICKY = (276, 244, 224, 113, 32)
MAX_REQUEST_TOKENS = 72  # prompt + output of any churn request: every churn engine's KV cache holds this


# ---------------------------------------------------------------- references: each request alone, roomy


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the model is too small to split, and on a busy 2-core machine two OpenMP threads waiting
    for each other made each step ~25x slower (one scenario: 33 s instead of 1.2 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(tiny_text_llm):
    return make_reference(tiny_text_llm)


def make_reference(tiny_text_llm, max_model_len: int | None = None):
    """reference(prompt, params): the final StepOutput of the request served alone on a roomy engine
    (no prefix cache, no chunking, no overlap, no speculation, one sequence at a time), memoized."""
    engine = tiny_text_llm(max_num_seqs=1, enable_prefix_caching=False, enable_chunked_prefill=False,
                           num_gpu_blocks_override=64, overlap_decode=False, max_model_len=max_model_len).engine
    memo = {}

    def get(prompt, params):
        key = (tuple(prompt), repr(params))
        if key not in memo:
            assert not engine.has_unfinished_requests()
            engine.add_request("ref", list(prompt), params)
            final = None
            try:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            final = out
            finally:  # a step that raised leaves nothing behind for the next reference
                engine.abort_request("ref")
                engine._aborted.clear()
            memo[key] = final
        return memo[key]

    return get


# ---------------------------------------------------------------- scenario generation


@dataclass
class Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    arrival: int  # engine step at (or after) which it is added
    leave_after: int | None = None  # async: the client stops reading after this many outputs
    cancel_at: int | None = None  # async: the client's task is cancelled at this engine step
    outputs: list = field(default_factory=list)
    again: list | None = None  # async: after leaving, the client sends the same id again; its outputs


def _ascii_stop(rng: random.Random, text: str) -> str | None:
    """A short stop string taken from `text` (letters only, so it is not a piece of a broken character)."""
    words = [w for w in "".join(c if c.isascii() and c.isalpha() else " " for c in text).split()]
    if not words:
        return None
    word = rng.choice(words)
    start = rng.randrange(len(word))
    return word[start:start + rng.randint(1, 3)]


def _params(rng: random.Random, prompt: list[int], room: int, reference, least: int = 1,
            extras: float = 1.0) -> SamplingParams:
    """Greedy parameters with a random mix of the options that end or shape an output (`extras` scales how
    often). Stop tokens and stop strings are taken from the plain greedy output, so they do fire."""
    max_tokens = rng.randint(min(least, room), min(32, room))
    plain = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    opts: dict = dict(ignore_eos=rng.random() < 0.8)
    if rng.random() >= extras:
        return replace(plain, **opts)
    if rng.random() < 0.15:
        opts["logprobs"] = rng.choice([0, 1, 3])
    if rng.random() < 0.2:
        ids = reference(prompt, plain).token_ids
        opts["stop_token_ids"] = (rng.choice(ids),)
        if rng.random() < 0.5:
            opts["min_tokens"] = rng.randint(1, max_tokens)
        if rng.random() < 0.3:
            opts["include_stop_str_in_output"] = True
    if rng.random() < 0.2:
        stop = _ascii_stop(rng, reference(prompt, plain).text)
        if stop:
            opts["stop"] = (stop,)
            opts["include_stop_str_in_output"] = rng.random() < 0.3
            if rng.random() < 0.3:
                opts["min_tokens"] = rng.randint(0, max_tokens)
    if rng.random() < 0.1:
        opts["structured_output"] = rng.choice([SCHEMA, REGEX, CHOICE])
    if rng.random() < 0.08:  # seeded sampling: its own generator, so the same draws however it is batched
        opts.update(temperature=rng.choice([0.6, 1.0]), seed=rng.randrange(1 << 20), top_k=rng.choice([-1, 20]),
                    top_p=rng.choice([1.0, 0.9]))
    if rng.random() < 0.08:
        opts.update(rng.choice([dict(repetition_penalty=1.3), dict(frequency_penalty=0.5, presence_penalty=0.3)]))
    if rng.random() < 0.05:
        opts["logit_bias"] = {rng.randrange(1, TEXT_TOKENS): rng.choice([-100.0, 3.0])}
    if rng.random() < 0.05:
        opts["allowed_token_ids"] = tuple(rng.sample(range(1, TEXT_TOKENS), 40))
    if rng.random() < 0.05:
        opts["prompt_logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.05:
        opts["cache_salt"] = rng.choice(["a", "b"])
    if rng.random() < 0.05:  # bad words the plain output writes: a one-token word, and maybe a two-token one
        ids = reference(prompt, plain).token_ids
        at = rng.randrange(len(ids))
        words = [(ids[at],)]
        if len(ids) > 1 and rng.random() < 0.5:  # (two-token words alone: test_multi_token_bad_words_alone)
            at = rng.randrange(len(ids) - 1)
            words.append(tuple(ids[at:at + 2]))
        opts["bad_words_token_ids"] = tuple(words)
    return replace(plain, **opts)


def _prompt(rng: random.Random, prefixes: list[list[int]], earlier: list[list[int]], loopy: bool) -> list[int]:
    roll = rng.random()
    if earlier and roll < 0.15:
        return list(rng.choice(earlier))  # a repeat: its blocks may be cached, or still in use
    if loopy and roll < 0.3:  # repeats itself: n-gram drafts find something to propose
        unit = [rng.randrange(1, TEXT_TOKENS) for _ in range(rng.randint(2, 5))]
        return (unit * 12)[:rng.randint(8, 30)]
    if loopy and roll < 0.6:  # a run the model answers with a run: drafts it keeps
        return [rng.choice(STICKY)] * rng.randint(3, 12)
    head = list(rng.choice(prefixes)) if roll < 0.65 else []
    return head + [rng.randrange(TEXT_TOKENS) for _ in range(rng.randint(1, 16))]


@dataclass
class Profile:
    """What a scenario's engine forces; the rest of its options are random."""
    name: str
    options: dict
    loopy: bool = False
    abort_rate: float = 0.08
    arrival_gap: int = 2  # most engine steps between two arrivals
    least_tokens: int = 1  # the fewest max_tokens of a request
    extras: float = 1.0  # the share of requests that may get options beyond max_tokens and ignore_eos
    max_model_len: int | None = None  # a context that outputs run into (finish_reason "length" there)


PROFILES = [
    Profile("tight-cache", dict(tight=True, max_num_seqs=8), arrival_gap=1, least_tokens=16),
    Profile("chunked-overlap", dict(overlap_decode=True, enable_chunked_prefill=True, max_num_batched_tokens=8)),
    Profile("speculative", dict(ngram_draft_tokens=4), loopy=True, arrival_gap=24, abort_rate=0.03, extras=0.5),
    Profile("speculative-overlap-tight", dict(ngram_draft_tokens=3, overlap_decode=True, tight=True), loopy=True,
            arrival_gap=12, abort_rate=0.04, extras=0.5),
    Profile("unchunked", dict(enable_chunked_prefill=False, max_num_batched_tokens=16)),
    Profile("random", {}),
    # most requests aborted: before admission, mid-prefill, while sharing cached blocks, beside a queued decode
    Profile("abort-storm", dict(enable_prefix_caching=True, max_num_batched_tokens=8, overlap_decode=True,
                                max_num_seqs=4), arrival_gap=1, abort_rate=0.35),
    # outputs that reach the context: its last token, drafts, a decode queued ahead must all stop there
    Profile("context-limit", dict(overlap_decode=True), loopy=True, arrival_gap=6, max_model_len=40),
]


def _engine_options(rng: random.Random, profile: Profile) -> dict:
    forced = dict(profile.options)
    tight = forced.pop("tight", rng.random() < 0.4)
    block_size = rng.choice([2, 4, 8, 16])
    blocks = math.ceil((MAX_REQUEST_TOKENS + 1) / block_size)
    options = dict(
        block_size=block_size,
        num_gpu_blocks_override=blocks + rng.randint(0, 2) if tight else 4 * blocks,
        max_num_seqs=rng.choice([1, 2, 3, 4, 8]),
        max_num_batched_tokens=rng.choice([1, 3, 4, 8, 16, 64, 2048]),
        enable_chunked_prefill=rng.random() < 0.8,
        enable_prefix_caching=rng.random() < 0.8,
        overlap_decode=rng.random() < 0.5,
        ngram_draft_tokens=rng.choice([0, 0, 3, 5]),
    )
    options.update(forced)
    if profile.max_model_len:
        options["max_model_len"] = profile.max_model_len
    return options


def _scenario(rng: random.Random, profile: Profile, reference, num_requests: int) -> list[Req]:
    """Requests (n > 1 ones expanded as LLM.generate does) with their arrival steps."""
    prefixes = [[rng.randrange(TEXT_TOKENS) for _ in range(rng.randint(6, 24))] for _ in range(3)]
    reqs: list[Req] = []
    earlier: list[list[int]] = []
    arrival = 0
    for i in range(num_requests):
        prompt = _prompt(rng, prefixes, earlier, profile.loopy)
        if rng.random() < 0.1 and earlier:  # a follow-up turn: an earlier prompt and its whole output
            base = rng.choice(earlier)
            follow = base + reference(base, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)).token_ids
            if len(follow) < MAX_REQUEST_TOKENS - 8:
                prompt = follow + [rng.randrange(TEXT_TOKENS)]
        context = profile.max_model_len or MAX_REQUEST_TOKENS
        prompt = prompt[-(context - 2):]
        earlier.append(prompt)
        params = _params(rng, prompt, MAX_REQUEST_TOKENS - len(prompt) - 1, reference, profile.least_tokens,
                         profile.extras)
        if profile.max_model_len and rng.random() < 0.5:
            params = replace(params, max_tokens=None, min_tokens=0)  # up to the context
        n = rng.choice([2, 3]) if rng.random() < 0.1 else 1
        if n > 1 and not params.greedy:  # greedy choices are alike: n > 1 needs sampling (vLLM's rule)
            params = replace(params, n=n)
        for j in range(n):
            sub = params if params.n == 1 else params.for_choice(j)
            reqs.append(Req(f"q{i}" if n == 1 else f"q{i}-{j}", prompt, sub, arrival))
        arrival += rng.randint(0, profile.arrival_gap)
    return reqs


# ---------------------------------------------------------------- invariants


def check_accounting(engine) -> None:
    """The block manager agrees with the sequences: each block's reference count is the number of block tables
    holding it, the free list is exactly the unreferenced blocks, a waiting sequence holds none, and each live
    sequence sits in exactly one queue with the status of that queue."""
    bm, sched = engine.block_manager, engine.scheduler
    live = list(engine.sequences.values())
    assert sorted(map(id, live)) == sorted(map(id, sched.running + list(sched.waiting)))
    assert all(s.status == SequenceStatus.RUNNING for s in sched.running)
    assert all(s.status == SequenceStatus.WAITING and not s.block_table for s in sched.waiting)
    refs = [0] * bm.num_blocks
    for seq in sched.running:
        live = bm.live_blocks(seq)  # every KV group's table (engine.kv_layout), released entries left out
        assert len(set(live)) == len(live)
        assert all(len(table) == len(seq.block_table) for table in bm.tables(seq))
        assert len(seq.block_table) >= bm.blocks_needed(seq.num_computed_tokens)
        assert seq.num_computed_tokens < seq.num_tokens  # the last token is always to compute
        assert seq.num_draft_tokens == 0
        for g, table in enumerate(bm.tables(seq)):  # a local group keeps what its span reads from the next token on
            first = bm.layout.first_kept_block(g, seq.num_computed_tokens, bm.block_size)
            assert bm.null_block not in table[first:]
        for block in live:
            refs[block] += 1
    assert refs == bm.ref_counts
    assert set(bm.free_blocks) == {b for b in range(bm.num_blocks) if refs[b] == 0}
    for h, block in bm.block_of_hash.items():
        assert bm.hash_of_block[block] == h and bm.tokens_of_block[block] is not None


def check_idle(engine, ended: list[tuple[Sequence, StepOutput]]) -> None:
    """Everything finished or aborted (each engine request with its final output): nothing held, nothing queued,
    the counters add up."""
    check_accounting(engine)
    bm = engine.block_manager
    assert not engine.has_unfinished_requests()
    assert engine.sequences == {} and engine.detokenizers == {} and not engine._aborted
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)  # cached blocks are free, evictable
    assert all(seq.is_finished and not seq.block_table for seq, _ in ended)
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    assert stats.prompt_tokens_total == sum(seq.num_prompt_tokens for seq, _ in ended)
    # every token appended to a sequence, kept through preemption; an aborted request's up to its abort
    assert stats.generation_tokens_total == sum(len(final.token_ids) for _, final in ended)
    assert stats.accepted_draft_tokens_total <= stats.draft_tokens_total
    if engine.block_manager.enable_prefix_caching:
        # looked up at a request's first admission, unless it scores its prompt (prompt_logprobs)
        counted = [(seq, final) for seq, final in ended if seq.admitted and seq.params.prompt_logprobs is None]
        assert stats.prefix_cache_queries_total == sum(seq.num_prompt_tokens for seq, _ in counted)
        assert stats.prefix_cache_hits_total == sum(final.num_cached_tokens for _, final in counted)
    else:
        assert stats.prefix_cache_queries_total == stats.prefix_cache_hits_total == 0


def check_outputs(req: Req, want, aborted: bool) -> None:
    """Streamed outputs grow and each is a prefix of the request's output alone; the last one ends it: equal to
    that output, or an abort (then a prefix of it)."""
    outs = req.outputs
    assert outs, f"{req.rid}: no output"
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], f"{req.rid}: finished != once, last"
    previous: list[int] = []
    for out in outs:
        assert out.request_id == req.rid and out.prompt_token_ids == req.prompt
        assert out.token_ids[:len(previous)] == previous, f"{req.rid}: outputs do not grow"
        assert out.token_ids == want.token_ids[:len(out.token_ids)], f"{req.rid}: diverged from its output alone"
        previous = list(out.token_ids)
    last = outs[-1]
    if aborted and last.finish_reason == "abort":
        return
    assert not aborted or last.finish_reason != "abort"
    assert (last.token_ids, last.text, last.finish_reason, last.stop_reason) == \
           (want.token_ids, want.text, want.finish_reason, want.stop_reason), req.rid
    if req.params.logprobs is not None:
        assert [lp.token_id for lp in last.logprobs] == want.token_ids
        for got, ref in zip(last.logprobs, want.logprobs):
            assert got.logprob == pytest.approx(ref.logprob, abs=1e-4)
            assert [t for t, _ in got.top] == [t for t, _ in ref.top]
        assert last.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)
    if req.params.prompt_logprobs is not None:
        assert len(last.prompt_logprobs) == len(req.prompt) and last.prompt_logprobs[0] is None
        for got, ref in zip(last.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            assert (got.token_id, got.rank) == (ref.token_id, ref.rank)
            assert got.logprob == pytest.approx(ref.logprob, abs=1e-4)


# ---------------------------------------------------------------- the synchronous engine


def run_sync(engine, reqs: list[Req], rng: random.Random, abort_rate: float, max_steps: int = 2000):
    """Adds each request at its arrival step, aborts live ones at random, steps until nothing is left; checks
    after every step that each request's outputs stop at its end. Returns (aborted ids, each id's Sequence)."""
    pending = sorted(reqs, key=lambda r: r.arrival)
    by_id = {r.rid: r for r in reqs}
    seqs: dict[str, Sequence] = {}
    live: set[str] = set()
    aborted: set[str] = set()
    ended: set[str] = set()
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrival <= step:
            r = pending.pop(0)
            engine.add_request(r.rid, r.prompt, r.params)
            seqs[r.rid] = engine.sequences[r.rid]
            live.add(r.rid)
        if live and rng.random() < abort_rate:
            rid = rng.choice(sorted(live))
            engine.abort_request(rid)
            live.discard(rid)
            aborted.add(rid)
        if rng.random() < 0.05:  # aborting what already ended, or was never added, changes nothing
            engine.abort_request(rng.choice(sorted(ended)) if ended else "never-added")
        outs = engine.step()
        seen = set()
        for out in outs:
            assert out.request_id in by_id and out.request_id not in ended, f"output after the end: {out}"
            assert out.request_id not in seen, f"two outputs in one step: {out.request_id}"
            seen.add(out.request_id)
            if out.request_id in aborted:
                assert out.finished and out.finish_reason == "abort", f"output after its abort: {out}"
            by_id[out.request_id].outputs.append(out)
            if out.finished:
                ended.add(out.request_id)
                live.discard(out.request_id)
        check_accounting(engine)
        step += 1
        assert step < max_steps, "the engine stopped making progress"
    assert ended == set(by_id), f"never ended: {set(by_id) - ended}"
    return aborted, seqs


def sync_churn(tiny_text_llm, reference, seed: int, num_requests: int = 14):
    """One seeded scenario on the synchronous engine, checked; returns the engine, its requests, the aborted ids."""
    rng = random.Random(seed)
    profile = PROFILES[seed % len(PROFILES)]
    options = _engine_options(rng, profile)
    engine = tiny_text_llm(**options).engine
    assert engine.max_model_len >= (profile.max_model_len or MAX_REQUEST_TOKENS)
    if profile.max_model_len:
        reference = make_reference(tiny_text_llm, profile.max_model_len)
    reqs = _scenario(rng, profile, reference, num_requests)
    aborted, seqs = run_sync(engine, reqs, rng, profile.abort_rate)
    for r in reqs:
        check_outputs(r, reference(r.prompt, r.params), r.rid in aborted)
    check_idle(engine, [(seqs[r.rid], r.outputs[-1]) for r in reqs])
    return engine, reqs, aborted


def _seed_id(seed: int) -> str:
    return f"{seed}-{PROFILES[seed % len(PROFILES)].name}"


@pytest.mark.parametrize("seed", range(2 * len(PROFILES)), ids=_seed_id)  # two per profile
def test_sync_churn(tiny_text_llm, reference, seed):
    sync_churn(tiny_text_llm, reference, seed)


# ---------------------------------------------------------------- the async engine


class _Recorder:
    """Wraps the engine's add_request, abort_request and step (called on the engine thread): counts the steps,
    and pairs each engine request (its Sequence: an id may serve a new request once the old one is aborted) with
    its outputs, checking that it ends exactly once."""

    def __init__(self, engine):
        self.engine = engine
        self.steps = 0
        self.seqs: list[Sequence] = []
        self.outputs: dict[int, list[StepOutput]] = {}  # id(seq) -> its outputs
        self.aborted: list[StepOutput] = []  # the abort outputs queued for the next step
        self._add, self._step, self._abort = engine.add_request, engine.step, engine.abort_request
        engine.add_request, engine.step, engine.abort_request = self.add, self.step, self.abort

    def add(self, request_id, prompt, params=None):
        self._add(request_id, prompt, params)
        seq = self.engine.sequences[request_id]
        self.seqs.append(seq)
        self.outputs[id(seq)] = []

    def abort(self, request_id):
        seq = self.engine.sequences.get(request_id)
        self._abort(request_id)
        if seq is not None:
            final = self.engine._aborted[-1]
            assert final.request_id == request_id and final.finish_reason == "abort"
            self.outputs[id(seq)].append(final)
            self.aborted.append(final)

    def step(self):
        live = dict(self.engine.sequences)
        outs = self._step()
        for out in outs:
            if out.finish_reason == "abort":
                assert out is self.aborted.pop(0), "an abort output nobody asked for"
                continue
            seq = live[out.request_id]  # a request gets outputs only while it is in the engine
            assert not (self.outputs[id(seq)] and self.outputs[id(seq)][-1].finished), f"output after the end: {out}"
            self.outputs[id(seq)].append(out)
        assert not self.aborted, "an abort output that never came"
        check_accounting(self.engine)
        self.steps += 1
        return outs

    def ended(self) -> list[tuple[Sequence, StepOutput]]:
        """Each engine request with its final output, checked to be its only finished one."""
        for seq in self.seqs:
            outs = self.outputs[id(seq)]
            assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], seq.request_id
        return [(seq, self.outputs[id(seq)][-1]) for seq in self.seqs]


async def _until_step(engine: AsyncLLMEngine, rec: _Recorder, step: int) -> None:
    """Waits for the engine's step `step`, or until the engine has nothing to do (it does not step then)."""
    while rec.steps < step and (engine.engine.has_unfinished_requests() or engine._pending):
        await asyncio.sleep(0.001)


async def _client(engine: AsyncLLMEngine, rec: _Recorder, req: Req) -> None:
    await _until_step(engine, rec, req.arrival)
    async with aclosing(engine.generate(req.rid, req.prompt, req.params)) as stream:
        async for out in stream:
            req.outputs.append(out)
            if req.leave_after is not None and len(req.outputs) >= req.leave_after:
                break  # a client that goes away mid-stream: leaving the iterator aborts the request
    if req.again is not None:  # the same id again at once, as a new request, read to its end
        async with aclosing(engine.generate(req.rid, req.prompt, req.params)) as stream:
            async for out in stream:
                req.again.append(out)


async def _async_churn(engine: AsyncLLMEngine, rec: _Recorder, reqs: list[Req]) -> dict:
    tasks = {r.rid: asyncio.create_task(_client(engine, rec, r)) for r in reqs}

    async def cancel(req: Req):
        await _until_step(engine, rec, req.cancel_at)
        tasks[req.rid].cancel()  # the client's task is cancelled (a disconnect the server sees this way)

    cancellers = [asyncio.create_task(cancel(r)) for r in reqs if r.cancel_at is not None]
    await asyncio.wait_for(asyncio.gather(*cancellers), 60)
    results = await asyncio.wait_for(asyncio.gather(*tasks.values(), return_exceptions=True), 60)
    for _ in range(3000):  # the aborts of the clients that left are applied by the loop's next step
        with engine._lock:
            pending = bool(engine._pending)
        if not pending and not engine.engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.002)
    await engine.shutdown()
    return dict(zip(tasks, results))


@pytest.mark.parametrize("seed", range(len(PROFILES)), ids=_seed_id)  # one per profile
def test_async_churn(tiny_text_llm, reference, seed):
    async_churn(tiny_text_llm, reference, seed)


def async_churn(tiny_text_llm, reference, seed: int, num_requests: int = 12):
    """One seeded scenario on the async engine, checked; returns the async engine and its requests."""
    rng = random.Random(1000 + seed)
    profile = PROFILES[seed % len(PROFILES)]
    engine = AsyncLLMEngine(engine=tiny_text_llm(**_engine_options(rng, profile)).engine)
    if profile.max_model_len:
        reference = make_reference(tiny_text_llm, profile.max_model_len)
    rec = _Recorder(engine.engine)
    reqs = _scenario(rng, profile, reference, num_requests)
    for r in reqs:
        roll = rng.random()
        if roll < 0.2:
            r.leave_after = rng.randint(1, 4)
            if rng.random() < 0.5:
                r.again = []
        elif roll < 0.35:
            r.cancel_at = r.arrival + rng.randint(0, 6)
    results = asyncio.run(_async_churn(engine, rec, reqs))

    for r in reqs:
        error = results[r.rid]
        assert error is None or isinstance(error, asyncio.CancelledError), f"{r.rid}: {error!r}"
        want = reference(r.prompt, r.params)
        for out in r.outputs + (r.again or []):  # what the client saw: growing prefixes of its output alone
            assert out.request_id == r.rid and out.finish_reason != "abort"
            assert out.token_ids == want.token_ids[:len(out.token_ids)]
        if r.outputs and r.outputs[-1].finished:
            check_outputs(r, want, aborted=False)
        if error is None and r.leave_after is None:  # read to its end
            assert r.outputs and r.outputs[-1].finished
        if error is None and r.again is not None:  # a new request under the id it left: its own output, whole
            check_outputs(replace(r, outputs=r.again), want, aborted=False)
    assert engine._queues == {} and engine._serving == {}

    # engine side: every request ends exactly once, as it would alone or by an abort at a prefix of that
    ended = rec.ended()
    for seq, final in ended:
        want = reference(seq.prompt_token_ids, seq.params)
        assert final.token_ids == want.token_ids[:len(final.token_ids)]
        if final.finish_reason != "abort":
            assert (final.token_ids, final.text, final.finish_reason) == (want.token_ids, want.text,
                                                                          want.finish_reason)
    check_idle(engine.engine, ended)
    return engine, reqs


# ---------------------------------------------------------------- focused repros of what the churn found


def test_multi_token_bad_words_alone(tiny_text_llm):
    """A request whose only bad word has two tokens, alone in its step: every row had an adjustment with nothing in it
    until the word's first token was written, and the sampler's masks-only path indexed an empty list of masks (an
    IndexError in the step, which killed the async engine for every request). Found by the churn above."""
    engine = tiny_text_llm(num_gpu_blocks_override=16).engine
    free = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    plain = []
    engine.add_request("free", [1, 2, 3], free)
    while engine.has_unfinished_requests():
        plain = [o.token_ids for o in engine.step() if o.finished] or plain
    word = (plain[0][1], plain[0][2])  # the free output writes it: the ban must change the output
    engine.add_request("banned", [1, 2, 3], replace(free, bad_words_token_ids=(word,)))
    got = []
    while engine.has_unfinished_requests():
        got = [o.token_ids for o in engine.step() if o.finished] or got
    out = got[0]
    assert len(out) == 6 and out[:2] == plain[0][:2] and out[2] != word[1]
