"""vLLM's runtime LoRA routes: POST /v1/load_lora_adapter and /v1/unload_lora_adapter, served only with
--allow-runtime-lora-updating (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING); without it they are unknown routes (404),
as vLLM leaves them out. A success answers 200 with vLLM's text ("Success: LoRA adapter 'x' added successfully.");
a failure an OpenAI-shaped error (lora_adapters.ServedAdapters, which also says what load_inplace does)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from radiance.server.protocol_messages import _Model
from radiance.server.routes_common import State

router = APIRouter()


class LoadLoRAAdapterRequest(_Model):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: reload a served adapter from lora_path under its name


class UnloadLoRAAdapterRequest(_Model):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's field, which it no longer reads either: the name says which


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, state: State):
    message = await state.adapters.load(state.require_engine(), body.lora_name, body.lora_path, state.served_names,
                                        inplace=body.load_inplace)
    return PlainTextResponse(message)


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, state: State):
    message = await state.adapters.unload(state.require_engine(), body.lora_name)
    return PlainTextResponse(message)
