"""tools/decode_ablation.py: its stubs must keep the signatures of the launchers they replace (or the
GPU run breaks in the next session), and the harness must run end to end (a CPU dry run)."""

import inspect
import math
import sys
from pathlib import Path

import pytest
import torch

import radiance.kernels.w4a8 as w4a8_module
from radiance.kernels.norm import PartialSums
import radiance.layers.norm as norm_module
import radiance.models.llama as llama_module
from radiance.layers.attention import Attention
from radiance.layers.rotary import RotaryEmbedding
from tests.bench.test_bench_synthetic import TINY

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import decode_ablation  # noqa: E402


@pytest.mark.parametrize("stub,real", [(decode_ablation._no_norm, norm_module.add_rmsnorm),
                                       (decode_ablation._no_glu, llama_module.glu_mul),
                                       (decode_ablation._no_parts_quantize, w4a8_module.quantize_rows_from_parts),
                                       (decode_ablation._no_attention, Attention.forward),
                                       (decode_ablation._no_rotary, RotaryEmbedding.rotate_and_store)])
def test_stubs_take_the_launchers_arguments(stub, real):
    assert list(inspect.signature(stub).parameters) == list(inspect.signature(real).parameters)


class _Ops:
    """Records the aten ops run inside (a stub must launch nothing: only allocations and views)."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        names = self.names = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                names.append(str(func.overloadpacket))
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


@pytest.mark.parametrize("quantize", [False, True])
def test_the_norm_stub_computes_nothing_from_deferred_partials(quantize):
    """A stub that sliced or cast the partials would launch a kernel (outside the PDL chain) and spoil the row."""
    parts = PartialSums(torch.randn(3, 2, 64), 48, torch.bfloat16, (2,))
    residual, weight = torch.zeros(2, 48), torch.ones(48)
    with _Ops() as ops:
        y, summed = decode_ablation._no_norm(parts, residual, weight, 1e-6, quantize=quantize)
    assert summed.shape == (2, 48) and summed.dtype == torch.bfloat16
    assert (y.x_q.shape if quantize else y.shape) == (2, 48)
    assert set(ops.names) <= {"aten.empty", "aten.empty_strided"}, ops.names


def test_the_rotary_stub_copies_nothing():
    q, q_out = torch.randn(2, 4, 8), torch.empty(2, 4, 8)
    with _Ops() as ops:
        out = decode_ablation._no_rotary(None, None, q, None, None, None, None, None, q_out=q_out)
    assert out is q_out and ops.names == []


def test_removed_swaps_and_restores():
    real = (norm_module.add_rmsnorm, llama_module.glu_mul, Attention.forward)
    with decode_ablation.removed({"norm", "attn"}):
        assert norm_module.add_rmsnorm is decode_ablation._no_norm
        assert Attention.forward is decode_ablation._no_attention
        assert llama_module.glu_mul is real[1]
    with decode_ablation.removed({"silu"}):  # the SiLU launch, or the quantize launch of the fused GLU
        assert llama_module.glu_mul is decode_ablation._no_glu
        assert w4a8_module.quantize_rows_from_parts is decode_ablation._no_parts_quantize
    with decode_ablation.removed({"rotary"}):
        assert RotaryEmbedding.rotate_and_store is decode_ablation._no_rotary
    assert RotaryEmbedding.rotate_and_store is not decode_ablation._no_rotary
    assert (norm_module.add_rmsnorm, llama_module.glu_mul, Attention.forward) == real
    with pytest.raises(ValueError, match="removable"):
        with decode_ablation.removed({"rope"}):
            pass


def test_dry_run_on_the_cpu():
    rows = decode_ablation.run("synthetic:llama-3.1-8b", "mxfp4", batches=(1, 2), variants=("base", "silu+attn"),
                               device="cpu", overrides={**TINY, "vocab_size": 512}, steps=2)
    assert [name for name, _ in rows] == ["base", "silu+attn"]
    assert all(math.isfinite(t) and t > 0 for _, times in rows for t in times)
    assert Attention.forward is not decode_ablation._no_attention  # restored after the run
