"""bench/gpu_check.py's pieces that a lease cannot debug: the kernel kinds its eager-step rows sum
(checked on kernel names as CUDA profiles print them), the one-QKV-matmul variant it times against
ours (the same function, or the comparison means nothing), and the rows those make, here on a CPU."""

from __future__ import annotations

import sys

import pytest
import torch

from qkgeom import config as C
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
gpu_check = pytest.importorskip("gpu_check")

# names as torch.profiler reports them for kernels on an H100 / H200 (cuBLAS, flash and memory-efficient
# attention, fused AdamW, LayerNorm, the loss's softmax) and an elementwise kernel that is none of them
KERNELS = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas": "gemm",  # noqa: E501
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT": "gemm",
    "void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>": "gemm",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t, "
    "Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, false, false>"
    "(pytorch_flash::Flash_fwd_params)": "attention",
    "fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<cutlass::arch::Sm80, "
    "cutlass::bfloat16_t, true, false, true, 64, 64, 64, false>::Params)": "attention",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
    "(at::native::ADAM_MODE)1, false>, double*, double, double, double, double, double, bool, float*, "
    "float*>": "optimizer",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>(int, float, "
    "float const*, float const*, float const*, float*, float*, float*)": "layer norm",
    "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<float, float, 32u, 32u, 256u, false, "
    "true, false>": "layer norm",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
    "namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)": "loss",
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
    "at::native::GeluType)::{lambda()#2}::operator()() const, std::array<char*, 2ul> >(int, "
    "at::native::GeluCUDAKernelImpl, std::array<char*, 2ul>)": "other",
    "Memcpy HtoD (Pageable -> Device)": "other",
    "aten::mm": "gemm",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
}


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_kinds(name):
    assert gpu_check.kernel_kind(name) == KERNELS[name]


def test_one_qkv_matmul_is_the_same_function():
    """FusedQKV on our GPT's parameters: the same loss (bit for bit on this CPU's float32 GEMMs, which
    give x @ [A|B|C] column blocks equal to x @ A ...) and gradients within float32 rounding; the explicit
    (probe) path untouched."""
    cfg = C.load("tiny")
    x = torch.randint(0, 284, (4, cfg.model.n_ctx), generator=torch.Generator().manual_seed(0))
    ours, fused = (gpu_check.GPT(cfg.model, 284, seed=3) for _ in range(2))
    for block in fused.blocks:
        block.attn.__class__ = gpu_check.FusedQKV
    losses = [m.loss(x, x) for m in (ours, fused)]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
    for loss in losses:
        loss.backward()
    for (name, a), b in zip(ours.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert torch.equal(ours(x, explicit=True), fused(x, explicit=True))


def test_eager_step_rows_on_the_cpu(tmp_path):
    """step_rows without nanoGPT: our step beside the variant, and our op time per step by kind (gemm
    and attention present, the kinds summing to the total), its profile written."""
    cfg = C.load("tiny", ["train.batch_size=4"])
    rows = dict(gpu_check.step_rows("paper", cfg, False, None, True, tmp_path))
    assert "nanoGPT not measured" in rows["paper: bare step, eager"]
    assert "ours with one QKV matmul" in rows["paper: bare step, eager"]
    timing = rows["paper: eager step's op time, ms/step"]
    total, kinds = (
        float(timing.split()[1]),
        dict(
            (k.strip(), float(v))
            for k, v in (p.rsplit(" ", 1) for p in timing.split("(", 1)[1].rstrip(")").split(", "))
        ),
    )
    assert kinds["gemm"] > 0 and kinds["attention"] > 0
    assert sum(kinds.values()) == pytest.approx(total, abs=0.01 * len(kinds))
    assert "aten::mm" in (tmp_path / "profile-paper-ours.txt").read_text()
