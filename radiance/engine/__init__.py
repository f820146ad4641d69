"""The inference engine: sequences, paged KV blocks, scheduler, model runner, sync/async engines, `LLM`.

Imports are lazy so `radiance.engine.cli` (argparse registration) does not pull in torch.
"""

__all__ = ["AsyncLLMEngine", "EngineStats", "LLM", "LLMEngine", "RequestOutput", "SamplingParams", "StepOutput",
           "TokenLogprob"]


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
    if name == "SamplingParams":
        from radiance.engine.sampling_params import SamplingParams
        return SamplingParams
    if name in ("StepOutput", "TokenLogprob", "EngineStats"):
        from radiance.engine import outputs
        return getattr(outputs, name)
    if name == "RequestOutput":  # vLLM's name for LLM.generate's result, as `radiance.RequestOutput`
        from radiance.engine.outputs import GenerationOutput
        return GenerationOutput
    raise AttributeError(f"module 'radiance.engine' has no attribute {name!r}")
