"""The inference engine: sequences, paged KV blocks, scheduler, model runner, sync/async engines, `LLM`.

Imports are lazy so `radiance.engine.cli` (argparse registration) does not pull in torch.
"""

__all__ = ["AsyncLLMEngine", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "EngineStats", "LLM",
           "LLMEngine", "RequestOutput", "RequestOutputKind", "SamplingParams", "StepOutput",
           "StructuredOutputsParams", "TokenLogprob"]


def __getattr__(name):
    if name == "LLMEngine":
        from radiance.engine.llm_engine import LLMEngine
        return LLMEngine
    if name == "AsyncLLMEngine":
        from radiance.engine.async_engine import AsyncLLMEngine
        return AsyncLLMEngine
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
    if name in ("StepOutput", "TokenLogprob", "EngineStats"):
        from radiance.engine import outputs
        return getattr(outputs, name)
    if name == "RequestOutput":  # vLLM's name for LLM.generate's result, as `radiance.RequestOutput`
        from radiance.engine.outputs import GenerationOutput
        return GenerationOutput
    raise AttributeError(f"module 'radiance.engine' has no attribute {name!r}")
