"""Every projection of the model goes through `linear()`: the one dispatch point.

On the CPU it is `F.linear` (FP8 weights are dequantized first, so CI runs that path).
On CUDA, a layer whose startup tuning (`tandem.kernels.gemm_tuner`) found a faster
weight-streaming kernel for this many rows uses it; otherwise cuBLAS (`F.linear`, or
`torch._scaled_mm` for FP8 weights). Layers whose input is an activation or a norm can take
it fused into that kernel's prologue (`Linear.silu_mul_forward`, `Linear.add_norm_forward`),
each from a plan of its own. Parallel (tensor-parallel) layers call the same
function on their shard. The kernel modules are imported on first CUDA use, so
CPU-only installs never import Triton.
"""
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
MAX_SMALL_M = 16  # rows up to which the weight-streaming kernels are considered


def m_bucket(m: int) -> int:
    """Tuning buckets: 1, 2, 4, 8, 16 (the CUDA-graph batch sizes up to 16)."""
    return 1 << max(m - 1, 0).bit_length()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale: torch.Tensor | None = None, plan: dict | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias). `weight_scale` [N] (fp32) marks an FP8 weight;
    `plan` maps an M bucket to the tuned small-M kernel config (absent: cuBLAS)."""
    if not x.is_cuda:
        if weight_scale is not None:
            weight = (weight.float() * weight_scale[:, None]).to(x.dtype)
        return F.linear(x, weight, bias)
    cfg = _small_m_config(x, plan)
    if cfg is not None:
        from tandem.kernels.small_m_gemm import small_m_gemm
        return small_m_gemm(x, weight, bias, weight_scale, cfg)
    if weight_scale is not None:
        return fp8_linear_cublas(x, weight, bias, weight_scale)
    return F.linear(x, weight, bias)


def _small_m_config(x: torch.Tensor, plan: dict | None):
    """The tuned small-M kernel config for x's row count (CUDA), or None: cuBLAS."""
    if not plan or not x.is_cuda:
        return None
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return plan.get(m_bucket(m)) if 0 < m <= MAX_SMALL_M else None


def fp8_linear_cublas(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      weight_scale: torch.Tensor) -> torch.Tensor:
    """Per-token dynamic activation quantization, then cuBLAS's row-wise scaled FP8 GEMM."""
    from tandem.kernels.fp8_quant import quantize_rows_fp8
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    xq, x_scale = quantize_rows_fp8(x2)
    out = fp8_scaled_mm(xq, x_scale, weight, bias, weight_scale, x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def fp8_scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  weight_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """(xq * x_scale) @ (weight * weight_scale)^T (+ bias): e4m3 rows [M, K] with fp32 row
    scales [M, 1] against an FP8 weight [N, K] with per-channel scales [N], cuBLAS's row-wise
    scaled GEMM."""
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
                           out_dtype=out_dtype)
    return out if bias is None else out + bias


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel e4m3: returns (fp8 weight [N, K], fp32 scale [N])."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


class Linear(nn.Module):
    """A projection: weight [out, in] (16-bit, or FP8 after `quantize_fp8_`), optional bias,
    and its small-M kernel plan (filled by the startup tuner; empty means cuBLAS).
    `reduce` is applied to the output: a row-parallel layer passes its all-reduce. A `gated`
    layer (an MLP's down projection) is also called on packed (gate, up) rows through
    `silu_mul_forward`, with a plan of its own (`silu_plan`): the fused input is tuned apart,
    since it was measured 4-6x slower than the two launches at 8 and 16 rows (docs/benchmarks.md).
    A `normed` layer (qkv, gate/up: an RMSNorm in front) likewise takes the residual add + norm
    in its kernel through `add_norm_forward`, from `norm_plan` (issue 21: at batch 1 the step is
    bound by its kernel count, and this saves a launch per norm)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, gated: bool = False,
                 normed: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.register_buffer("weight_scale", None)
        self.plan: dict = {}
        self.gated = gated
        self.silu_plan: dict = {}  # gated layers: M bucket -> the fused kernel's config
        self.normed = normed
        self.norm_plan: dict = {}  # normed layers: M bucket -> the add + norm kernel's config
        self.reduce = reduce
        # FP8 weights above the small-M kernels: the norm or SiLU-mul in front writes the FP8
        # input rows (off: a quantization launch of its own; `Experiments.fp8_fused_input`).
        self.fp8_fused_input = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, self.bias, self.weight_scale, self.plan)
        return out if self.reduce is None else self.reduce(out)

    def silu_mul_forward(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """self(silu(gate) * up) in one launch when the fused kernel was tuned faster for these
        rows (CUDA); None otherwise, and the caller runs the two steps."""
        cfg = _small_m_config(gate_up, self.silu_plan)
        if cfg is not None:
            from tandem.kernels.small_m_gemm import small_m_gemm
            out = small_m_gemm(gate_up, self.weight, self.bias, self.weight_scale, cfg, silu_mul=True)
        elif self._fp8_input_fused(gate_up):
            from tandem.kernels.fp8_quant import silu_mul_quantize_rows_fp8
            out = fp8_scaled_mm(*silu_mul_quantize_rows_fp8(gate_up), self.weight, self.bias, self.weight_scale,
                                gate_up.dtype)
        else:
            return None
        return out if self.reduce is None else self.reduce(out)

    def add_norm_forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(self(rms_norm(x + residual)), x + residual) in one launch when the fused kernel was
        tuned faster for these rows (CUDA); without a residual, (self(rms_norm(x)), x). None
        otherwise, and the caller runs the norm, then the layer."""
        cfg = _small_m_config(x, self.norm_plan)
        if cfg is not None:
            from tandem.kernels.small_m_gemm import NormInput, small_m_gemm_add_norm
            out, residual = small_m_gemm_add_norm(x, NormInput(norm_weight, eps, residual), self.weight,
                                                  self.bias, self.weight_scale, cfg)
        elif self._fp8_input_fused(x) and x.dim() == 2:
            from tandem.kernels.norm import add_rms_norm_fp8
            xq, x_scale, residual = add_rms_norm_fp8(x, residual, norm_weight, eps)
            out = fp8_scaled_mm(xq, x_scale, self.weight, self.bias, self.weight_scale, x.dtype)
        else:
            return None
        return (out if self.reduce is None else self.reduce(out)), residual

    def _fp8_input_fused(self, x: torch.Tensor) -> bool:
        """Whether an FP8 layer takes its input rows quantized by the kernel in front (CUDA)."""
        return self.weight_scale is not None and self.fp8_fused_input and x.is_cuda

    @torch.no_grad()
    def quantize_fp8_(self, fused_input: bool = True) -> None:
        q, scale = quantize_fp8(self.weight)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = scale
        self.fp8_fused_input = fused_input
        # Tuned for the 16-bit weight; retune after quantizing.
        self.plan, self.silu_plan, self.norm_plan = {}, {}, {}


def quantize_model_fp8(model: nn.Module, fused_input: bool = True) -> int:
    """Quantize every `Linear` in place (embeddings, norms and the LM head stay 16-bit);
    returns how many were quantized. `fused_input`: see `Linear.fp8_fused_input`."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    for layer in layers:
        layer.quantize_fp8_(fused_input)
    return len(layers)


def check_fp8_support(device: torch.device, feature: str = "quantization='fp8'") -> None:
    """FP8 GEMMs and e4m3 conversions need compute capability 8.9 (Ada) or 9.0+ (Hopper); the
    CPU dequantizes. `feature` names what asked for FP8 in the error."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"{feature} needs a GPU with FP8 support (compute capability "
                         f">= 8.9, e.g. Ada or Hopper); {name} has {major}.{minor}")
