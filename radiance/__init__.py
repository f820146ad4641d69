"""radiance: serve 4-bit MXFP4 / NVFP4 checkpoints fast on GPUs without FP4 tensor cores."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):  # lazy: `import radiance` stays cheap (no torch import for --help)
    if name == "LLM":
        from radiance.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from radiance.engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'radiance' has no attribute {name!r}")
