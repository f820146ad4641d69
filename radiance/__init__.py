"""radiance: serve 4-bit MXFP4 / NVFP4 checkpoints fast on GPUs without FP4 tensor cores."""

__version__ = "0.1.0"

__all__ = ["BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CompletionOutput", "GenerationOutput",
           "LLM", "LoRARequest", "Logprob", "RequestOutput", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams",
           "__version__"]

# LLM.generate's output classes under vLLM's names too (`from vllm import RequestOutput, CompletionOutput`;
# vLLM's Logprob lives in vllm.logprobs)
_OUTPUT_CLASSES = {"RequestOutput": "GenerationOutput", "GenerationOutput": "GenerationOutput",
                   "CompletionOutput": "CompletionOutput", "Logprob": "Logprob"}


# the rest come from radiance.engine, which imports each lazily under the same name
_ENGINE_NAMES = ("LLM", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "SamplingParams",
                 "RequestOutputKind", "StructuredOutputsParams")


def __getattr__(name):  # lazy: `import radiance` stays cheap (no torch import for --help)
    if name in _ENGINE_NAMES:
        from radiance import engine
        return getattr(engine, name)
    if name == "LoRARequest":  # vLLM's `from vllm.lora.request import LoRARequest`
        from radiance.lora.request import LoRARequest
        return LoRARequest
    if name in _OUTPUT_CLASSES:
        from radiance.engine import outputs
        return getattr(outputs, _OUTPUT_CLASSES[name])
    raise AttributeError(f"module 'radiance' has no attribute {name!r}")
