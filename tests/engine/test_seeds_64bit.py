"""A request's seed counts with all its 64 bits on the CPU too: torch's CPU generator (mt19937) keeps only the
low 32 bits of its seed, so -2 and 2**63 - 2 (and 1 and 2**32 + 1) drew the same tokens. The engine mixes the
64 bits first (sampling_params.generator_seed, one to one). Not -1: a request's seed -1 is vLLM's "no seed"."""

from radiance import SamplingParams
from radiance.engine.sampling_params import generator_seed

SEEDS = (1, 2**32 + 1, -2, 2**63 - 2)


def test_the_mix_is_one_to_one_and_spreads_the_high_bits():
    assert len({generator_seed(s) % 2**32 for s in SEEDS}) == len(SEEDS)
    assert generator_seed(-1) == generator_seed(2**64 - 1)  # the same seed, wrapped into 64 bits
    values = [generator_seed(s) for s in range(-500, 500)]
    assert len(set(values)) == len(values) and all(0 <= v < 2**64 for v in values)


def test_seeds_that_differ_only_above_32_bits_draw_differently(tiny_llm):
    llm = tiny_llm()

    def draw(seed):
        params = SamplingParams(max_tokens=12, temperature=2.0, seed=seed, ignore_eos=True)
        return tuple(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids)

    draws = [draw(s) for s in SEEDS]
    assert len(set(draws)) == len(SEEDS), draws
    assert draw(2**63 - 2) == draws[3]  # a seed still repeats its tokens
