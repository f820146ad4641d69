"""radiance: serve 4-bit MXFP4 / NVFP4 checkpoints fast on GPUs without FP4 tensor cores."""

__version__ = "0.1.0"

__all__ = ["BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CompletionOutput", "GenerationOutput",
           "LLM", "Logprob", "RequestOutput", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams",
           "__version__"]

# LLM.generate's output classes under vLLM's names too (`from vllm import RequestOutput, CompletionOutput`;
# vLLM's Logprob lives in vllm.logprobs)
_OUTPUT_CLASSES = {"RequestOutput": "GenerationOutput", "GenerationOutput": "GenerationOutput",
                   "CompletionOutput": "CompletionOutput", "Logprob": "Logprob"}


def __getattr__(name):  # lazy: `import radiance` stays cheap (no torch import for --help)
    if name == "LLM":
        from radiance.engine.llm import LLM
        return LLM
    if name in ("BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence"):
        from radiance.engine import beam_search
        return getattr(beam_search, name)
    if name in ("SamplingParams", "RequestOutputKind"):
        from radiance.engine import sampling_params
        return getattr(sampling_params, name)
    if name == "StructuredOutputsParams":  # vLLM's name of the structured-output constraint
        from radiance.engine.structured_output import StructuredOutput
        return StructuredOutput
    if name in _OUTPUT_CLASSES:
        from radiance.engine import outputs
        return getattr(outputs, _OUTPUT_CLASSES[name])
    raise AttributeError(f"module 'radiance' has no attribute {name!r}")
