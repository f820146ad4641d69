"""A module-level setting of radiance (a constant its launchers read at call time, e.g.
`radiance.kernels.w4a8.DEFER_MAX_ROW_BYTES_AT_M1`) A/B'd inside the engine's decode step: one engine, the setting
set to each value in turn with the CUDA graphs re-captured, the values alternated `--repeats` times, the original
value restored after.

    python3 tools/module_setting_ab.py radiance.kernels.w4a8.DEFER_MAX_ROW_BYTES_AT_M1 65536 131072 \
        [--model synthetic:qwen3-32b] [--batches 1 8] [--repeats 3]

Values are Python literals converted to the type of the current value (`true` / `false` for a bool; a set or
list literal for a frozenset or tuple). On the CPU (`--device cpu`) it is a dry run of the harness: timings
meaningless.
"""

from __future__ import annotations

import argparse
import ast
import importlib

import decode_ablation  # tools/, next to this script


def resolve(path: str):
    """(module, attribute name) of a dotted `package.module.NAME` that exists."""
    module_name, _, name = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{path}: no module {module_name!r}") from exc
    if not name or not hasattr(module, name):
        raise ValueError(f"{path}: {module_name} has no setting {name!r}")
    return module, name


def parse_value(current, text: str):
    """`text` as a value of the current value's type."""
    if isinstance(current, bool):
        if text.lower() not in ("true", "false"):
            raise ValueError(f"a bool setting takes true or false, not {text!r}")
        return text.lower() == "true"
    if isinstance(current, str):
        return text
    return type(current)(ast.literal_eval(text))


def run(model: str, path: str, values, quantization: str = "mxfp4", batches=(1, 8), repeats: int = 3,
        device: str = "cuda", overrides: dict | None = None, steps: int = 24, log=print):
    """[(value, [best-of-2 ms per decode step for each batch])] in run order."""
    module, name = resolve(path)
    engine = decode_ablation.ab_engine(model, quantization, batches, device, overrides)
    return decode_ablation.alternate(
        engine, module, name, list(values), batches, repeats, steps,
        lambda value, times: log(f"{name} = {value!r}: " + "  ".join(f"batch {b} {ms:.3f} ms"
                                                                    for b, ms in zip(batches, times))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("setting", help="dotted path of the module-level setting, e.g. radiance.kernels.w4a8.NAME")
    p.add_argument("values", nargs="+", help="values to alternate (Python literals)")
    p.add_argument("--model", default="synthetic:llama-3.1-8b")
    p.add_argument("--quantization", default="mxfp4")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    module, name = resolve(args.setting)
    current = getattr(module, name)
    values = [parse_value(current, text) for text in args.values]
    run(args.model, args.setting, values, args.quantization, args.batches, args.repeats, args.device)


if __name__ == "__main__":
    main()
