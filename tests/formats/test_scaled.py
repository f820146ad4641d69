"""formats.scaled: a weight times a factor folded into its scales (Granite's residual multiplier), for every format:
its values are the unscaled weight's times the factor; MXFP4 takes powers of two only."""

import pytest
import torch

from radiance.formats import (DenseWeight, Fp8Weight, Int4Weight, Mxfp4Weight, Nvfp4Weight, dequantize,
                              quantize_fp8_per_channel, quantize_mxfp4, quantize_nvfp4, scaled)


def _weights():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    packed = torch.randint(0, 256, (8, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    return {
        "dense": DenseWeight(w.to(torch.bfloat16), (4, 4)),
        "fp8": Fp8Weight(*quantize_fp8_per_channel(w)),
        "int4": Int4Weight(packed, torch.rand(8, 2, generator=torch.Generator().manual_seed(2)) + 0.1,
                           torch.randn(8, 2, generator=torch.Generator().manual_seed(3))),
        "nvfp4": Nvfp4Weight(*quantize_nvfp4(w, (4, 4)), partition_sizes=(4, 4)),
        "mxfp4": Mxfp4Weight(*quantize_mxfp4(w)),
    }


@pytest.mark.parametrize("fmt", ["dense", "fp8", "int4", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("factor", [0.25, 4.0, 0.22])
def test_scaled_values_are_the_weights_times_the_factor(fmt, factor):
    weight = _weights()[fmt]
    if fmt == "mxfp4" and factor == 0.22:
        with pytest.raises(ValueError, match="power of two"):
            scaled(weight, factor)
        return
    out = scaled(weight, factor)
    assert type(out) is type(weight) and out.partition_sizes == weight.partition_sizes
    want = dequantize(weight) * factor  # int4's code * scale + offset cancels near 0: an absolute slack there
    torch.testing.assert_close(dequantize(out), want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    if fmt == "mxfp4":
        assert torch.equal(out.packed, weight.packed)  # the codes stay; only the block exponents move


def test_mxfp4_exponents_outside_e8m0_are_refused():
    weight = _weights()["mxfp4"]
    with pytest.raises(ValueError, match="e8m0 range"):
        scaled(weight, 2.0 ** 200)
