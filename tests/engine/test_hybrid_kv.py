"""KV groups (engine.kv_layout): local layers (sliding windows, chunks) keep their own block tables and give back the
blocks behind their span. The layouts of real models, the block manager's accounting and prefix cache with groups,
and engines whose tokens are the same with the groups as without them, and transformers'."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from radiance.engine.block_manager import BlockManager
from radiance.engine.kv_layout import KvLayout, LocalSpan
from radiance.engine.sampling_params import SamplingParams
from radiance.engine.sequence import Sequence
from tests.engine.conftest import TINY_TOKENIZER_VOCAB, tiny_byte_bpe_tokenizer, tiny_hf_model
from tests.engine.test_engine_churn import PROFILES, make_reference, sync_churn


def arch(num_layers: int, window: int | None = None, sliding=(), chunk: int | None = None, chunked=()):
    return SimpleNamespace(num_layers=num_layers, window_of=lambda i: window if i in sliding else None,
                           chunk_of=lambda i: chunk if i in chunked else None,
                           attention_layer_ids=list(range(num_layers)))


# ---------------------------------------------------------------- layouts


def test_gemma3_27b_full_layers_set_the_slots_and_the_sliding_ones_fill_six_groups():
    full = {i for i in range(62) if i % 6 == 5}  # every 6th layer attends to everything: 10 of 62
    layout = KvLayout.of(arch(62, 1024, set(range(62)) - full))
    assert layout.slots == 10 and layout.num_groups == 7 and layout.releases_pages
    assert layout.groups[0] == tuple(sorted(full)) and layout.spans[0] is None
    assert all(s == LocalSpan(window=1024) for s in layout.spans[1:])
    assert sorted(i for g in layout.groups for i in g) == list(range(62)) and len(layout.groups[-1]) == 2
    assert layout.place(5) == (0, 0) and layout.place(0) == (1, 0) and layout.place(61) == (6, 1)


@pytest.mark.parametrize("model, layers, local, slots, groups", [
    ("gpt-oss (every other layer, window 128)", 24, set(range(0, 24, 2)), 12, 2),
    ("Llama 4 Scout (3 of 4 layers chunked)", 48, {i for i in range(48) if i % 4 != 3}, 12, 4),
])
def test_layouts_of_real_models(model, layers, local, slots, groups):
    a = arch(layers, 128, local) if "gpt" in model else arch(layers, chunk=8192, chunked=local)
    layout = KvLayout.of(a)
    assert (layout.slots, layout.num_groups) == (slots, groups)
    assert all(len(g) == slots for g in layout.groups)  # no slot left unused


def test_one_group_without_local_layers_when_turned_off_or_when_padding_would_cost_more():
    assert KvLayout.of(arch(32)) == KvLayout.single(32) and not KvLayout.single(32).releases_pages
    assert KvLayout.of(arch(24, 128, set(range(0, 24, 2))), hybrid=False) == KvLayout.single(24)
    # 2 local layers beside 30 full ones: a group of 30 slots for 2 layers would waste most of a page
    assert KvLayout.of(arch(32, 64, {0, 1})) == KvLayout.single(32)
    mistral = KvLayout.of(arch(4, 4096, set(range(4))))  # every layer local: one group that releases
    assert mistral.num_groups == 1 and mistral.slots == 4 and mistral.spans == (LocalSpan(window=4096),)


def test_what_a_span_reads_and_the_pages_a_sequence_holds():
    window, chunk = LocalSpan(window=24), LocalSpan(chunk=32)
    assert [window.first_read(p) for p in (0, 23, 24, 100)] == [0, 0, 1, 77]  # p - W < j <= p
    assert [chunk.first_read(p) for p in (0, 31, 32, 100)] == [0, 0, 32, 96]
    layout = KvLayout(1, ((0,), (1,)), (None, window))
    assert layout.first_kept_block(0, 100, 16) == 0 and layout.first_kept_block(1, 100, 16) == 77 // 16
    # a 1000-token sequence in steps of 16: the full group all its 63 blocks, the local one at most its window
    # and a step over block boundaries
    assert layout.pages_for(1000, 16, 16) == 63 + 4
    assert layout.pages_for(20, 16, 16) == 2 + 2  # short: no more than its own blocks
    assert layout.capacity(67, 16, 16, limit=10_000) == 1008  # (67 - 4) blocks of 16 in the full group
    assert layout.capacity(67, 16, 16, limit=500) == 500


# ---------------------------------------------------------------- the block manager


def manager(num_blocks=32, block_size=4, window=6, caching=True) -> BlockManager:
    return BlockManager(num_blocks, block_size, caching, layout=KvLayout(1, ((0,), (1,)), (None, LocalSpan(window))))


def seq_of(tokens: list[int], name="a") -> Sequence:
    return Sequence(name, tokens, SamplingParams(max_tokens=4), 0)


def run_prefill(bm: BlockManager, seq: Sequence, step: int, until: int | None = None) -> None:
    """Allocate and 'compute' the prompt (up to `until` tokens; all but the last) in steps of `step` tokens, as the
    scheduler and engine do."""
    until = seq.num_tokens - 1 if until is None else until
    while seq.num_computed_tokens < until:
        n = min(step, until - seq.num_computed_tokens)
        assert bm.can_allocate(seq, n)
        before = bm.num_free_blocks
        expected = bm.new_blocks_needed(seq, n)
        bm.allocate(seq, n)
        assert before - bm.num_free_blocks == expected  # the count the scheduler admits by is what it takes
        seq.num_computed_tokens += n
        bm.commit(seq)


def test_a_local_group_releases_the_blocks_behind_its_window_and_counts_them_back():
    bm = manager()
    seq = seq_of(list(range(41)))
    run_prefill(bm, seq, 4)  # 40 tokens computed in steps of 4 (blocks of 4, window 6)
    assert len(seq.block_table) == len(seq.group_tables[0]) == 10
    local = seq.group_tables[0]
    # the next step's token (position 40) reads 35..40: blocks 8 on; every earlier one released before the last step
    first = bm.layout.first_kept_block(1, 36, 4)
    assert local[:first] == [bm.null_block] * first and bm.null_block not in local[first:]
    assert bm.num_free_blocks == 32 - 10 - (10 - first)
    assert seq.released_blocks == [0, first]
    bm.free(seq)
    assert bm.num_free_blocks == 32 and not any(bm.ref_counts) and seq.group_tables == [[]]


def test_a_prefix_hit_needs_the_local_groups_blocks_behind_its_end():
    bm = manager()
    first = seq_of(list(range(41)), "first")
    run_prefill(bm, first, 4)
    first.num_computed_tokens = 40  # a decode step later every block of the prompt is full and committed
    bm.commit(first)
    bm.free(first)
    again = seq_of(list(range(41)) + [7, 7, 7], "again")
    tables, digests = bm.cached_prefix(again)
    # released blocks keep their digests until handed out again: the whole prompt hits, the local group holding
    # only the window behind it
    hit = len(digests)
    kept = bm.layout.first_kept_block(1, hit * 4, 4)
    assert hit == 10 and kept == 8 and tables[1][:kept] == [bm.null_block] * kept
    assert all(b != bm.null_block for b in tables[0] + tables[1][kept:])
    assert bm.match_prefix(again) == hit * 4 and again.released_blocks == [0, kept]
    for table in bm.tables(again):
        assert all(bm.ref_counts[b] == 1 for b in table if b != bm.null_block)
    # evicting a block of the window behind the hit shortens it
    bm.free(again)
    victim = tables[1][hit - 1]
    bm.free_blocks.move_to_end(victim, last=False)  # the next block handed out
    assert bm._take_fresh_block() == victim
    shorter = bm.cached_prefix(seq_of(list(range(41)) + [7, 7, 7], "third"))[1]
    assert 0 < len(shorter) < hit  # a hit of 9 blocks reads the local group's blocks 7 and 8 only


def test_a_shared_block_released_by_one_sequence_stays_with_the_other():
    bm = manager(window=4)
    a = seq_of(list(range(40)), "a")
    run_prefill(bm, a, 4, until=28)
    b = seq_of(list(range(30)), "b")
    assert bm.match_prefix(b) == 28  # 7 blocks; the local group's block 6 holds the window behind them
    local = b.group_tables[0][6]
    assert local == a.group_tables[0][6] and bm.ref_counts[local] == 2
    run_prefill(bm, a, 4)  # a's window moves past block 6: its reference goes, b's stays
    assert a.group_tables[0][6] == bm.null_block
    assert bm.ref_counts[local] == 1 and local not in bm.free_blocks and local in bm.live_blocks(b)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


# ---------------------------------------------------------------- engines


@pytest.mark.parametrize("model", ["gemma3", "gptoss", "mistral"])
@pytest.mark.parametrize("chunk", [None, 8])
def test_engine_tokens_equal_without_groups_and_blocks_stay_within_the_window(tiny_model_dir, model, chunk):
    """Greedy tokens of a 70-token prompt and 40 new ones (windows of 24 / 32 tokens, blocks of 4): the same with
    and without KV groups, while the local layers hold at most their window and a step's blocks."""
    from radiance import LLM

    path, _ = tiny_model_dir(model)
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(11)).tolist()
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    options = dict(device="cpu", dtype="float32", block_size=4, **({"max_num_batched_tokens": chunk} if chunk else {}))
    plain = LLM(path, hybrid_kv_cache=False, **options)
    assert plain.engine.block_manager.num_groups == 1 and plain.engine.block_manager.null_block is None
    hybrid = LLM(path, **options)
    bm = hybrid.engine.block_manager
    assert bm.layout.releases_pages
    held = []
    step = hybrid.engine.step

    def counting_step():
        out = step()
        for seq in hybrid.engine.scheduler.running:
            held.append(len(bm.live_blocks(seq)) - sum(len(bm.tables(seq)[g]) for g, s in
                                                       enumerate(bm.layout.spans) if s is None))
        return out

    hybrid.engine.step = counting_step
    assert (hybrid.generate([prompt], params)[0].outputs[0].token_ids
            == plain.generate([prompt], params)[0].outputs[0].token_ids)
    span = max(s.tokens for s in bm.layout.spans if s is not None)
    groups = sum(s is not None for s in bm.layout.spans)
    step_tokens = chunk or hybrid.engine.config.scheduler.max_num_batched_tokens
    assert max(held) <= groups * (-(-(span + step_tokens) // 4) + 1)
    assert max(held[-30:]) <= groups * (-(-(span + 1) // 4) + 1)  # decoding: the window, one block more


def test_on_the_cpu_the_full_attention_blocks_still_run_in_order(tiny_model_dir):
    """The CPU attention reads a context in place when its blocks run in order (BlockManager.prefer_in_order): the
    window layer's blocks come from the other end of the free list, so the full layer's stay in order."""
    from radiance import LLM

    engine = LLM(tiny_model_dir("gemma3")[0], device="cpu", dtype="float32", block_size=4,
                 max_num_batched_tokens=8).engine
    bm = engine.block_manager
    engine.add_request("r", list(range(10, 60)), SamplingParams(max_tokens=30, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        for seq in engine.scheduler.running:
            full = seq.block_table
            assert full == list(range(full[0], full[0] + len(full)))
            assert engine.runner.inputs.first_blocks_in_order(np.array([full]), [seq.num_computed_tokens]) == [full[0]]
            assert any(b == bm.null_block for b in seq.group_tables[0]) or seq.num_computed_tokens < 40
    assert steps > 30


def test_llama4_chunked_layers_release_their_blocks_and_match_transformers(tiny_model_dir):
    from tests.engine.conftest import assert_engine_greedy_matches_transformers

    assert_engine_greedy_matches_transformers(*tiny_model_dir("llama4"), prompt_len=40, chunk=7, block_size=4)


def test_the_capacity_a_cpu_budget_gives_grows_with_groups(tiny_model_dir):
    """With a byte budget for 40 blocks of 4 tokens of both layers, a model whose window layer releases its blocks
    serves a longer max_model_len than one keeping them all."""
    from radiance import LLM

    path, _ = tiny_model_dir("gemma3")
    per_block = 2 * 2 * 2 * 32 * 4 * 4  # K and V, 2 layers, 2 KV heads of 32, 4 tokens of float32
    options = dict(device="cpu", dtype="float32", block_size=4, cpu_kv_cache_bytes=40 * per_block,
                   max_num_batched_tokens=16)
    plain = LLM(path, hybrid_kv_cache=False, **options).engine
    hybrid = LLM(path, **options).engine
    assert plain.runner.num_blocks == 40 and plain.max_model_len == 160
    assert hybrid.runner.num_blocks == 80  # a block is one layer's slot now
    assert "KV groups of 1 layers: 1 x full attention, 1 x window 24" in hybrid.load_summary[-1]
    assert "KV groups" not in plain.load_summary[-1]
    assert hybrid.max_model_len == (80 - (-(-(24 + 16) // 4) + 1)) * 4  # the window's blocks aside, all full layer


@pytest.fixture(scope="module")
def tiny_windowed_text_llm(tmp_path_factory):
    """LLM factory over a tiny random Gemma 3 (a 10-token window on layer 0) with the churn's tokenizer; the KV
    cache block count the churn asks for is doubled (two groups of one layer: a block holds one layer)."""
    from radiance import LLM

    path = tmp_path_factory.mktemp("gemma3-text")
    tokenizer = tiny_byte_bpe_tokenizer()
    model = tiny_hf_model("gemma3", seed=1, vocab_size=TINY_TOKENIZER_VOCAB)
    model.config.sliding_window = 10
    for config in (model.config, model.generation_config):
        config.bos_token_id, config.eos_token_id, config.pad_token_id = None, tokenizer.eos_token_id, None
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)

    def make(**options):
        options.setdefault("device", "cpu")
        options.setdefault("dtype", "float32")
        if options.get("num_gpu_blocks_override"):
            options["num_gpu_blocks_override"] *= 2
        return LLM(str(path), **options)

    return make


@pytest.mark.parametrize("seed", range(len(PROFILES)), ids=lambda s: PROFILES[s % len(PROFILES)].name)
def test_churn_with_a_window_layer_matches_an_engine_without_groups(tiny_windowed_text_llm, seed):
    """The churn scenarios (admission, preemption, prefix cache, chunks, overlap, speculation, aborts) on a model
    with a window layer: outputs equal the same requests served alone without KV groups, and the block accounting
    (every group's table) holds at every step."""
    reference = make_reference(lambda **o: tiny_windowed_text_llm(**o, hybrid_kv_cache=False))
    engine, _, _ = sync_churn(tiny_windowed_text_llm, reference, seed)
    assert engine.block_manager.num_groups == 2


def test_inspect_says_what_a_whole_context_takes_with_and_without_released_blocks(tiny_model_dir):
    from radiance.checkpoint import open_checkpoint
    from radiance.checkpoint.inspect import _kv_line, inspect_lines
    from tests.engine.test_gemma3 import HUB_STYLE

    # 12 layers, every 6th full: 2 full + 10 sliding in 6 groups of 2 slots; 256 bytes a layer a token
    assert _kv_line(HUB_STYLE) == ("3.0 KiB per token in 16 bits; a sequence of the whole context (131072 tokens): "
                                   "384.0 MiB, 71.5 MiB with the local layers' blocks released (6 groups of 2 layers)")
    assert _kv_line({**HUB_STYLE, "sliding_window": None}).endswith("384.0 MiB")
    lines = inspect_lines(open_checkpoint(tiny_model_dir("gemma3")[0]))
    assert ("kv cache   0.5 KiB per token in 16 bits; a sequence of the whole context (512 tokens): 256.0 KiB, "
            "256.0 KiB with the local layers' blocks released (2 groups of 1 layers)") in lines  # too short to gain
