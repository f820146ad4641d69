"""What serving LoRA adapters costs a decode step on the GPU: a synthetic model's batch-1 (and batch-B) decode with
LoRA off, with LoRA on and only base requests (the runner replays its decode graphs captured without the deltas,
so this should match LoRA off), and with every request on a rank-r adapter over all seven projections (gate_up then
gives up its fused GLU epilogue), once per --max-loras value (the other slots empty: a step reads only the
adapters it serves, so this should not grow with max_loras).

    python3 tools/lora_decode_cost.py [--model synthetic:llama-3.1-8b] [--quantization mxfp4] [--rank 16]
                                      [--max-loras 1 4]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from safetensors.torch import save_file

from radiance.bench.synthetic import SyntheticCheckpoint, synthetic_config
from radiance.config import EngineConfig
from radiance.engine.llm_engine import LLMEngine
from radiance.engine.sampling_params import SamplingParams
from radiance.lora import LoRARequest
from radiance.models.registry import resolve_architecture


def write_random_adapter(path: str, arch, rank: int) -> str:
    """A PEFT adapter on q/k/v/o/gate/up/down of every layer (small random values)."""
    hidden, inter = arch.hidden_size, arch.intermediate_size
    shapes = {"self_attn.q_proj": (arch.q_size, hidden), "self_attn.k_proj": (arch.kv_size, hidden),
              "self_attn.v_proj": (arch.kv_size, hidden), "self_attn.o_proj": (hidden, arch.q_size),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(arch.num_layers):
        for proj, (out, inp) in shapes.items():
            name = f"base_model.model.model.layers.{layer}.{proj}"
            tensors[f"{name}.lora_A.weight"] = 0.01 * torch.randn(rank, inp, generator=gen, dtype=torch.float32)
            tensors[f"{name}.lora_B.weight"] = 0.01 * torch.randn(out, rank, generator=gen, dtype=torch.float32)
    os.makedirs(path, exist_ok=True)
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, os.path.join(path, "adapter_model.safetensors"))
    modules = sorted({p.split(".")[-1] for p in shapes})
    with open(os.path.join(path, "adapter_config.json"), "w") as handle:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules}, handle)
    return path


def decode_ms(engine, batch: int, context: int, steps: int, lora) -> float:
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(100, vocab - 100, (context,), generator=gen).tolist()
        engine.add_request(f"r{batch}-{i}-{time.monotonic_ns()}", ids,
                           SamplingParams(max_tokens=steps + 3, temperature=0.0, ignore_eos=True), lora_request=lora)
    first = 0
    while first < batch:  # prefills up to every request's first token
        first += sum(1 for out in engine.step() if len(out.token_ids) == 1)
    for _ in range(2):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    done = 0
    while engine.has_unfinished_requests():
        engine.step()
        done += 1
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / done * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="synthetic:llama-3.1-8b", help="default: synthetic:llama-3.1-8b")
    parser.add_argument("--quantization", default="mxfp4", help="default: mxfp4")
    parser.add_argument("--rank", type=int, default=16, help="adapter rank (default: 16)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="default: 1 16")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps (default: 64)")
    parser.add_argument("--max-loras", type=int, nargs="+", default=[1],
                        help="adapter slots of the adapter rows, one row each (default: 1)")
    args = parser.parse_args()
    arch = resolve_architecture(synthetic_config(args.model, None))[1]
    adapter = write_random_adapter(os.path.join(tempfile.mkdtemp(), "adapter"), arch, args.rank)
    rows = []
    variants = [("LoRA off", 0, False), ("LoRA on, base requests", args.max_loras[0], False)]
    variants += [(f"LoRA on, adapter requests, max_loras {slots}", slots, True) for slots in args.max_loras]
    for name, slots, use in variants:
        ckpt = SyntheticCheckpoint(args.model, device="cuda", dtype=torch.bfloat16)
        options = dict(enable_lora=True, max_loras=slots, max_lora_rank=args.rank) if slots else {}
        config = EngineConfig.from_flat(model=args.model, quantization=args.quantization, max_model_len=2048,
                                        device="cuda", **options)
        engine = LLMEngine(config, checkpoint=ckpt, progress=False)
        lora = LoRARequest("a", 1, adapter) if use else None
        row = {"variant": name}
        for batch in args.batches:
            row[f"decode ms @b{batch}"] = round(min(decode_ms(engine, batch, 128, args.steps, lora) for _ in range(2)), 3)
        rows.append(row)
        print(row, flush=True)
        del engine, ckpt
        torch.cuda.empty_cache()
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
