"""Synchronized batch norm that also works on CPU (gloo).

``torch.nn.SyncBatchNorm`` refuses CPU tensors. :class:`SyncBatchNorm` here computes the global batch
statistics with one differentiable ``all_reduce`` per layer (sum, sum of squares, count), so its
backward pass all-reduces the matching gradient terms like the CUDA kernel does. Parameter and buffer
names equal ``BatchNorm*d``'s, so checkpoints move freely between the two.
:func:`convert_sync_batchnorm` picks torch's fused version on CUDA and this one elsewhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks whose gradient is again the sum over ranks (each rank's loss uses every input)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _AllReduceSum.apply(grad)


class SyncBatchNorm(_BatchNorm):
    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        sync = self.training and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not sync:
            return super().forward(x)
        channels = x.size(1)
        dims = [0, *range(2, x.dim())]
        xf = x.float()
        count = torch.full((1,), float(x.numel() // channels), dtype=torch.float32, device=x.device)
        packed = torch.cat([xf.sum(dims), (xf * xf).sum(dims), count])
        packed = _AllReduceSum.apply(packed)
        total = packed[2 * channels]
        mean = packed[:channels] / total
        var = (packed[channels : 2 * channels] / total - mean * mean).clamp_min(0.0)
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)  # type: ignore[union-attr]
                factor = (
                    1.0 / float(self.num_batches_tracked.item())  # type: ignore[union-attr]
                    if self.momentum is None
                    else self.momentum
                )
                n = float(total.item())
                unbiased = var * (n / max(n - 1.0, 1.0))
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        shape = [1, channels] + [1] * (x.dim() - 2)
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


def convert_sync_batchnorm(module: nn.Module, device: torch.device | None = None) -> nn.Module:
    """Replace every BatchNorm*d in ``module`` by a synchronized one suited to ``device``."""
    if device is not None and device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        out = SyncBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        if module.affine:
            with torch.no_grad():
                out.weight = module.weight
                out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, device))
    return out
