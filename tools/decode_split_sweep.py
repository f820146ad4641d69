"""Split counts (or another tiling field) of the decode GEMMs, tuned where they run: inside the engine's
decode step (batch 1 by default; CUDA graphs re-captured per variant). One shape's entry changes at a time
against the tuning table, then the winners run together. A GEMM timed alone, back to back, tunes
differently: the 32B's gate_up took 2 splits here (-120 us per step) where the isolated sweep had seen
under 3% (bench/RESULTS.md, eighth session); 5 stages made 28672x4096 10% faster alone and slower here
(fourteenth session).

    python3 tools/decode_split_sweep.py [--model synthetic:qwen3-32b] [--splits 1 2 3 4 5 6 8] [--batch 1]
    python3 tools/decode_split_sweep.py --field num_stages --values 3 4 5   # any GemmConfig field
    python3 tools/decode_split_sweep.py --tilings '{"block_k": 512, "num_stages": 3, "split_k": 1}'  # several fields
    python3 tools/decode_split_sweep.py --compare OLD.json --batches 1 8   # a whole table against the repo's

Prints tuning-table entries for radiance/kernels/tuning/sm90.json: a winner must beat the median of the
table's repeats by more than --margin ms, and the closing table / winners alternation says whether the
winners together gain. Candidates that launch what another one (or the table) already launches are timed
once: a split count is compared as the number of splits it launches (w4a8.choose_split_k: 5 splits of
16 K tiles launch 4 of 4 tiles each), so noise cannot crown a tiling equal to the table's. On the CPU
(`--device cpu`) it is a dry run of the harness: reference kernels, no table, timings meaningless.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics

import torch

import decode_ablation  # tools/, next to this script
import radiance.kernels.tuning as tuning
from radiance.bench.engine_bench import _engine
from radiance.config import KernelConfig
from radiance.kernels.device_info import sm_count
from radiance.kernels.w4a8 import choose_split_k
from radiance.layers.linear import Mxfp4Linear
from radiance.layers.moe import SparseMoeBlock

DECODE_BAND = KernelConfig().decode_band  # the engine's default: up to this M the tuning table's decode entries serve


def serving_index(table: dict, shape: str, m: int) -> int | None:
    """Index of the decode entry of `table` that serves an N x K `shape` at M = m (as select_config picks it)."""
    return tuning.serving_entry_index(table.get("decode", []), shape, m)


def serving_entry(table: dict, shape: str, m: int) -> dict:
    """The decode entry of `table` that serves `shape` at M = m (tuning.DEFAULT_DECODE's when none does)."""
    i = serving_index(table, shape, m)
    return table["decode"][i] if i is not None else {"config": tuning.DEFAULT_DECODE.as_dict()}


def with_fields(table: dict, shape: str, fields: dict, m: int) -> dict:
    """A copy of `table` that serves `shape` at M = m with the GemmConfig `fields` given, the rest of the tiling
    as now: a new entry (m_max m) right before the one serving it now, so smaller M bands keep their entries."""
    for field in fields:
        if field not in tuning.GemmConfig.__dataclass_fields__:
            raise ValueError(f"{field!r} is not a GemmConfig field")
    patched = copy.deepcopy(table)
    decode = patched.setdefault("decode", [])
    i = serving_index(table, shape, m)
    entry = {"shape": shape, "m_max": m, "config": {**serving_entry(table, shape, m)["config"], **fields}}
    tuning.GemmConfig(**entry["config"])  # a tiling the kernel accepts (block_k % 128 ...)
    decode.insert(len(decode) if i is None else i, entry)
    return patched


def with_field(table: dict, shape: str, field: str, value, m: int) -> dict:
    """with_fields for one field."""
    return with_fields(table, shape, {field: value}, m)


def with_split(table: dict, shape: str, split: int, m: int) -> dict:
    """with_field for the split count."""
    return with_field(table, shape, "split_k", split, m)


@contextlib.contextmanager
def table_in_use(table: dict):
    """tuning.load_table returns `table` while inside (select_config reads it at every launch)."""
    saved = tuning.load_table
    tuning.load_table = lambda name: table
    try:
        yield
    finally:
        tuning.load_table = saved


def decode_shapes(model: torch.nn.Module) -> list[str]:
    """The N x K of the model's MXFP4 linears that the table serves, one per distinct shape (experts stacked
    for the grouped kernel run its own tilings, not the table's)."""
    grouped = {id(m) for block in model.modules() if isinstance(block, SparseMoeBlock) and block.grouped is not None
               for m in block.experts.modules()}
    return sorted({f"{m.out_features}x{m.in_features}" for m in model.modules()
                   if isinstance(m, Mxfp4Linear) and id(m) not in grouped})


def launched(config: dict, shape: str, m: int, num_sms: int) -> dict:
    """A decode tiling as it launches at M = m: block_m fitted to M and split_k the split count it runs with (the
    table's 0 means "auto"; a count that leaves a split without K tiles runs fewer), so that equal launches
    compare equal."""
    n, k = (int(v) for v in shape.split("x"))
    fitted = tuning.GemmConfig(**{**config, "block_m": tuning.swap_ab_block_m(m)})
    splits, _ = choose_split_k(m, n, k, fitted, num_sms)
    return {**fitted.as_dict(), "split_k": splits}


def distinct_candidates(candidates: list[dict], now: dict, shape: str, m: int, num_sms: int) -> list[dict]:
    """The candidates (GemmConfig fields) that launch something other than the serving tiling `now` and than
    the candidates before them."""
    seen = [launched(now, shape, m, num_sms)]
    kept = []
    for fields in candidates:
        key = launched({**now, **fields}, shape, m, num_sms)
        if key not in seen:
            seen.append(key)
            kept.append(fields)
    return kept


def step_ms(engine, gen, batch: int = 1, steps: int = 24, repeats: int = 2) -> float:
    """Best of `repeats` wall ms per decode step of `batch` sequences at context 128 (decode_ablation's)."""
    return min(decode_ablation.step_ms(engine, batch, gen, steps=steps) for _ in range(repeats))


def _label(fields: dict, field: str | None):
    """How a candidate prints: its value for a one-field sweep, else its fields."""
    return fields[field] if field is not None else ",".join(f"{k}={v}" for k, v in fields.items())


def run(model: str, quantization: str = "mxfp4", values=(1, 2, 3, 4, 5, 6, 8), batch: int = 1, margin: float = 0.004,
        device: str = "cuda", overrides: dict | None = None, steps: int = 24, log=print,
        field: str = "split_k", tilings: list[dict] | None = None) -> dict:
    """Decode steps of `batch` sequences (the GEMMs' M) with each shape's `field` set to each of `values` (or,
    with `tilings`, each dict of GemmConfig fields put in at once):
    {"table": [ms of every table repeat], "tried": {shape: [(value or label, ms)]}, "chosen": {shape: fields},
    "final": [(variant, ms)], "entries": [(entry, the index in the table's decode list to insert it at)] for
    the winners}."""
    if batch > DECODE_BAND:
        raise ValueError(f"batch {batch} is past the decode band ({DECODE_BAND} tokens): its GEMMs run prefill tilings")
    candidates = [dict(t) for t in tilings] if tilings else [{field: v} for v in values]
    label_field = None if tilings else field
    engine = _engine(model, quantization, 2048, device, overrides, max_num_batched_tokens=4096,
                     max_num_seqs=batch, gpu_memory_utilization=0.85, prefill_graph_tokens=())
    gen = torch.Generator().manual_seed(0)
    base = copy.deepcopy(tuning.load_table("sm90"))
    num_sms = sm_count(torch.device(device))

    def timed(table: dict) -> float:
        with table_in_use(table):
            if engine.runner.decode_graphs:
                engine.runner.capture_decode_graphs()  # the graph bakes in the tilings of its launches
            return step_ms(engine, gen, batch, steps=steps)

    timed(base)  # warm-up (compiles, allocator pools)
    result = {"table": [timed(base)], "tried": {}, "chosen": {}}
    log(f"{model}: table {result['table'][0]:.3f} ms per step")
    for shape in decode_shapes(engine.model):
        now = serving_entry(base, shape, batch)["config"]
        fresh = distinct_candidates(candidates, now, shape, batch, num_sms)
        tried = [(c, timed(with_fields(base, shape, c, batch))) for c in fresh]
        result["table"].append(timed(base))
        result["tried"][shape] = [(_label(c, label_field), ms) for c, ms in tried]
        keys = dict.fromkeys(k for c in candidates for k in c)  # the fields tried, in order
        shown = f"{field} {now.get(field)}" if label_field else _label({k: now.get(k) for k in keys}, None)
        log(f"  {shape} (table {shown}): "
            + "  ".join(f"{_label(c, label_field)}: {ms:.3f}" for c, ms in tried)
            + f"  | table again {result['table'][-1]:.3f}")
        if tried:
            fields, ms = min(tried, key=lambda t: t[1])
            # against the median of the table's repeats: the first ones of a session ran 35-40 us faster
            # than the later ones (8B), so the minimum would reject everything
            if ms < statistics.median(result["table"]) - margin:
                result["chosen"][shape] = fields
    combined = base
    result["entries"] = []
    for shape, fields in result["chosen"].items():
        index = serving_index(base, shape, batch)
        entry = with_fields(base, shape, fields, batch)["decode"][-1 if index is None else index]
        result["entries"].append((entry, index))
        combined = with_fields(combined, shape, fields, batch)
    result["final"] = [(v, timed(base if v == "table" else combined)) for v in ("table", "winners") * 2]
    log("  " + "  ".join(f"{v} {ms:.3f}" for v, ms in result["final"]))
    if engine.runner.decode_graphs:
        engine.runner.capture_decode_graphs()  # leave the engine as the table has it
    return result


def compare_tables(model: str, tables: dict[str, dict], batches, quantization: str = "mxfp4", repeats: int = 3,
                   device: str = "cuda", overrides: dict | None = None, steps: int = 24,
                   log=print) -> list[tuple[str, list[float]]]:
    """Whole tuning tables against each other in one engine: [(name, [ms per decode step for each batch])] in run
    order, the tables alternated `repeats` times, the decode graphs re-captured for each (how a set of sweep
    winners is confirmed before it lands)."""
    if max(batches) > DECODE_BAND:
        raise ValueError(f"batch {max(batches)} is past the decode band ({DECODE_BAND} tokens)")
    loaders = {name: (lambda _name, table=table: table) for name, table in tables.items()}
    names = {id(loader): name for name, loader in loaders.items()}
    engine = decode_ablation.ab_engine(model, quantization, batches, device, overrides)

    def report(loader, times):
        log(f"{names[id(loader)]}: " + "  ".join(f"batch {b} {ms:.3f}" for b, ms in zip(batches, times)))

    rows = decode_ablation.alternate(engine, tuning, "load_table", list(loaders.values()), batches, repeats, steps,
                                     report)
    return [(names[id(loader)], times) for loader, times in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="synthetic:llama-3.1-8b")
    p.add_argument("--quantization", default="mxfp4")
    p.add_argument("--splits", "--values", dest="values", nargs="+", type=int, default=[1, 2, 3, 4, 5, 6, 8],
                   help="the values of --field to try (split counts by default)")
    p.add_argument("--field", default="split_k", help="the GemmConfig field swept: split_k, num_stages, block_k ...")
    p.add_argument("--tilings", nargs="+", type=json.loads, metavar="JSON",
                   help='whole tilings to try instead of one field, each a JSON dict of GemmConfig fields, e.g. '
                        '\'{"block_k": 512, "num_stages": 3, "split_k": 1}\'')
    p.add_argument("--batch", type=int, default=1, help="sequences per decode step (the GEMMs' M)")
    p.add_argument("--margin", type=float, default=0.004, help="ms a winner must beat the table's median repeat by")
    p.add_argument("--device", default="cuda")
    p.add_argument("--compare", metavar="TABLE.json",
                   help="instead of a sweep: alternate this tuning table with the repo's (e.g. `git show "
                        "HEAD~1:radiance/kernels/tuning/sm90.json > old.json`) at --batches")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8], help="--compare's batch sizes")
    p.add_argument("--repeats", type=int, default=3, help="--compare's alternations")
    args = p.parse_args()
    if args.compare:
        with open(args.compare) as f:
            other = json.load(f)
        compare_tables(args.model, {args.compare: other, "repo": tuning.load_table("sm90")}, args.batches,
                       args.quantization, args.repeats, args.device)
        return
    result = run(args.model, args.quantization, args.values, args.batch, args.margin, args.device, field=args.field,
                 tilings=args.tilings)
    for entry, index in result["entries"]:
        print(f"{json.dumps(entry)}  # insert before decode entry {index} of tuning/sm90.json")


if __name__ == "__main__":
    main()
