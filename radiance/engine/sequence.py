"""One sequence: its tokens, how many of them sit in the KV cache, its blocks and its state."""

from __future__ import annotations

import enum

import torch

from radiance.engine.outputs import RequestTimes, TokenLogprob
from radiance.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival: int, generator: torch.Generator | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival = arrival            # FIFO order; preempted sequences keep theirs
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0      # tokens whose K/V are in the cache
        self.num_cached_tokens = 0        # prompt tokens served from the prefix cache (first admission)
        self.block_table: list[int] = []  # KV group 0's blocks (engine.kv_layout), one per block_size tokens
        # the blocks of KV groups 1, 2, ... (as many as block_table); a local group's entries behind its span point
        # at the null block once released, the first `released_blocks[g]` of group g's (group 0 included)
        self.group_tables: list[list[int]] = []
        self.released_blocks: list[int] = []
        self.num_hashed_blocks = 0        # leading full blocks already registered in the prefix cache
        self.block_hashes: list[bytes] = []  # block_manager.block_hash of each hashed block
        self.generator = generator
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        # the sum of the sampled tokens' logprobs, as vLLM reports it: only when logprobs are requested
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        # SamplingParams.prompt_logprobs: one entry per prompt position scored so far (the first token has none)
        self.prompt_logprobs: list[TokenLogprob | None] | None = [None] if params.prompt_logprobs is not None else None
        self.finish_reason: str | None = None
        # vLLM's stop_reason: the stop string or stop_token_ids id that ended the output (None for EOS, length)
        self.stop_reason: int | str | None = None
        self.text = ""
        self.admitted = False
        self.times = RequestTimes()  # set by the engine's steps, for the server's metrics
        self.output_counts = None  # the sampler's device-side token counts, when penalties need them
        self.disallowed = None  # the sampler's device mask of the tokens params.allowed_token_ids leaves out
        self.grammar = None  # structured_output.GrammarState, when params.structured_output is set
        self.num_draft_tokens = 0  # speculative tokens at the end of token_ids, until their step is verified
        self.draft_misses = 0  # speculative steps in a row that kept no draft
        self.draft_backoff = 0  # steps to decode before the next draft lookup (after misses)
        # the tokens that would end the output (EOS, stop_token_ids), banned while it is shorter than
        # params.min_tokens; set by the engine, which knows the EOS ids
        self.min_tokens_bans: tuple[int, ...] = ()
        self.bad_words = None  # sampler.BadWords of params' bad words; set by the engine, which tokenizes them
        # the LoRA adapter it runs with (engine-set): its request, id (0: the base), fingerprint (the prefix cache
        # keys blocks by it) and the slot of the model's LoraLinears it was given at admission (-1: none)
        self.lora_request = None
        self.lora_int_id = 0
        self.lora_fingerprint: bytes | None = None
        self.lora_slot = -1
        self.state_slot = -1  # its slot of a hybrid model's linear-attention states (engine.state_cache), -1: none
        # the states its prefix cache keeps from inside this step: (tokens into the step, the digest of the block
        # ending there, the row), kept by block_manager until the step is committed (None: none)
        self.state_save: tuple[int, bytes, int] | None = None

    def kv_table(self, group: int) -> list[int]:
        """The block table of KV group `group` (0: block_table)."""
        return self.block_table if group == 0 else self.group_tables[group - 1]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def samples_after_host(self) -> bool:
        """Whether its next token's logits depend on the tokens before it as the host has them (a structured
        output's grammar, a bad word of several tokens): the engine may queue its forward ahead (overlapped
        decode) but samples it only once the host has the token before."""
        return self.grammar is not None or self.bad_words is not None and self.bad_words.needs_output

    def bans_after(self, num_output: int) -> tuple[int, ...]:
        """The tokens banned for the output token that follows `num_output` output tokens (min_tokens, bad
        words). A bad word of several tokens reads those output tokens: the host must have them."""
        bans = self.min_tokens_bans if num_output < self.params.min_tokens else ()
        if self.bad_words is None:
            return bans
        end = self.num_prompt_tokens + num_output
        if self.bad_words.needs_output and end > self.num_tokens:
            raise RuntimeError(f"request {self.request_id}: sampled before the host had its previous token, which "
                               "its bad words need")
        tail = self.token_ids[max(self.num_prompt_tokens, end - self.bad_words.context):end]
        words = self.bad_words.banned(tail)
        return bans + words if bans else words

    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        self.token_ids.append(token_id)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
            self.cumulative_logprob += logprob.logprob
