"""Training profiles on the CPU: defaults, validation, refusals of GPU-only choices."""
import pytest
import torch

from aner import gen
from aner.errors import ConfigError
from aner.train.scaler import LossScale
from aner.errors import DataError


def test_defaults(base):
    p = base.training_profile()
    assert p == {"precision": "float32", "optimizer": "adamw", "nf4_kernel": "host_tiled", "page_bytes": 2097152,
                 "cuda_graphs": False, "adapter_kernel": "torch", "layer_kernel": "torch",
                 "attention_kernel": None, "master_dtype": "float32", "loss_scale": None}
    assert base.memory_summary().compute_dtype == "float32"
    assert base.with_training_profile().training_profile() == p


@pytest.mark.parametrize("kw,message", [
    (dict(precision="float64"), "precision='float64'"), (dict(optimizer="sgd"), "optimizer='sgd'"),
    (dict(nf4_kernel="cuda"), "nf4_kernel='cuda'"), (dict(page_bytes=4095), "page_bytes=4095"),
    (dict(page_bytes=6000), "page_bytes=6000"), (dict(page_bytes=(64 << 20) + 4096), "page_bytes=67112960"),
    (dict(precision="float16"), "needs a CUDA device"), (dict(precision="bfloat16"), "needs a CUDA device"),
    (dict(optimizer="paged_adamw"), "needs a CUDA device"), (dict(nf4_kernel="fused"), "needs a CUDA device"),
    (dict(nf4_kernel="decoded"), "nf4_kernel='decoded' runs GPU kernels and needs a CUDA device"),
    (dict(nf4_kernel="decoded_kept"), "nf4_kernel='decoded_kept' runs GPU kernels and needs a CUDA device"),
    (dict(nf4_kernel="dense"),
     "nf4_kernel='dense' is not supported; accepted: host_tiled, fused, decoded, decoded_kept"),
    (dict(cuda_graphs=True), "needs a CUDA device"), (dict(cuda_graphs="yes"), "cuda_graphs='yes'"),
    (dict(adapter_kernel="triton"), "adapter_kernel='triton' is not supported; accepted: torch, fused"),
    (dict(adapter_kernel="fused"), "adapter_kernel='fused' runs GPU kernels and needs a CUDA device"),
    (dict(layer_kernel="triton"), "layer_kernel='triton' is not supported; accepted: torch, fused"),
    (dict(layer_kernel="fused"), "layer_kernel='fused' runs GPU kernels and needs a CUDA device"),
    (dict(attention_kernel="flash"), "attention_kernel='flash' is not supported; accepted: torch, fused, cudnn"),
    (dict(attention_kernel="fused"), "attention_kernel='fused' runs GPU kernels and needs a CUDA device"),
    (dict(attention_kernel="cudnn"), "attention_kernel='cudnn' runs GPU kernels and needs a CUDA device"),
])
def test_refusals(base, kw, message):
    with pytest.raises(ConfigError, match=message):
        base.with_training_profile(**kw)


def test_profile_is_fixed_once_trained(base, tiny):
    from conftest import EXAMPLES
    tr = gen.supervised_csv(base, EXAMPLES / "data" / "training.csv", role="training", context=64)
    va = gen.supervised_csv(base, EXAMPLES / "data" / "validation.csv", role="validation", context=64)
    tuned = base.lora().fine_tune(tr, va, steps=1)
    with pytest.raises(ConfigError, match="trained model"):
        tuned.with_training_profile()
    with pytest.raises(ConfigError, match="recorded device"):
        tuned.to("cpu")


def test_to_cpu_is_a_new_handle(base):
    moved = base.to("cpu")
    assert moved is not base and moved.device() == "cpu"
    assert all(torch.equal(moved._weights[n], base._weights[n]) for n in base._weights)


def test_loss_scale_policy():
    s = LossScale()
    assert s.scale == 65536.0
    s = s.overflowed(1)
    assert (s.scale, s.overflows, s.retries, s.good_updates) == (32768.0, 1, 1, 0)
    s = s.succeeded()
    assert (s.retries, s.good_updates) == (0, 1)
    for _ in range(1999):
        s = s.succeeded()
    assert (s.scale, s.good_updates) == (65536.0, 0)
    big = LossScale(scale=2.0 ** 32, good_updates=1999)
    assert big.succeeded().scale == 2.0 ** 32
    with pytest.raises(DataError, match="33 times in a row"):
        t = LossScale()
        for _ in range(40):
            t = t.overflowed(7)
    with pytest.raises(DataError, match="overflowed"):
        LossScale(scale=2.0 ** -24).overflowed(3)


def test_adapter_contractions_stay_fp32_under_a_low_precision_policy():
    """Under autocast the base projection runs in BF16, the LoRA delta in FP32 exactly."""
    from aner.adapters.lora import LoRALinear
    from aner.model.llama import Dense
    g = torch.Generator().manual_seed(0)
    w, a, b = (torch.randn(s, generator=g) for s in ((48, 32), (4, 32), (48, 4)))
    x = torch.randn(5, 32, generator=g)
    layer = LoRALinear(Dense(w), a, b, scale=2.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        base = Dense(w)(x)
    assert base.dtype == torch.bfloat16            # the policy reached the projection
    delta = 2.0 * ((x @ a.t()) @ b.t())             # FP32 reference
    assert torch.equal(y, base + delta.to(torch.bfloat16))
