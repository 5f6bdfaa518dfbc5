"""Forward and backward FLOPs of one aten op call.

Forward FLOPs come from PyTorch's own formula registry (`torch.utils.flop_counter`), completed with the ops it
does not know: the CPU flash-attention kernel that SDPA lowers to on fake CPU tensors (PYTORCH-FACTS: FlopCounterMode
misses it) and grouped matmul (mixture-of-experts).

Backward FLOPs are model FLOPs: every contraction costs one forward-sized product per operand that needs a gradient
(``dA = dC @ B^T``, ``dB = A^T @ dC``; for attention the four products dV, dP, dQ, dK). This is the convention of
the 72·B·s·l·h² formula and of MFU; kernel recomputation is left to the cost model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

aten = torch.ops.aten

# op packet -> indices of the positional args that are contraction operands (their gradients cost a product each)
_CONTRACTION_OPERANDS: dict[Any, tuple[int, ...]] = {
    aten.mm: (0, 1),
    aten.bmm: (0, 1),
    aten.addmm: (1, 2),
    aten.baddbmm: (1, 2),
    aten.convolution: (0, 1),
    aten._convolution: (0, 1),
    aten._grouped_mm: (0, 1),
    aten._scaled_dot_product_flash_attention_for_cpu: (0, 1, 2),
    aten._scaled_dot_product_flash_attention: (0, 1, 2),
    aten._scaled_dot_product_efficient_attention: (0, 1, 2),
    aten._scaled_dot_product_cudnn_attention: (0, 1, 2),
    aten._flash_attention_forward: (0, 1, 2),
    aten._efficient_attention_forward: (0, 1, 2),
}
_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
    aten._flash_attention_forward,
    aten._efficient_attention_forward,
}


def _cpu_flash_attention_flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: Any, **__: Any) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _grouped_mm_flops(mat_a: torch.Tensor, mat_b: torch.Tensor, *_: Any, out: torch.Tensor, **__: Any) -> int:
    # 2-D x 3-D and 3-D x 3-D: every output element is a length-K dot product. 2-D x 2-D groups split K instead,
    # so each of the G output matrices sees K/G on average: the total is still 2 * (numel / G) * K.
    k = mat_a.shape[-1]
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        return 2 * (out.numel() // out.shape[0]) * k
    return 2 * out.numel() * k


_EXTRA_FORWARD: dict[Any, Callable[..., int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention_flops,
    aten._grouped_mm: _grouped_mm_flops,
}


def _first_tensor(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def forward_flops(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> int:
    packet = func.overloadpacket
    extra = _EXTRA_FORWARD.get(packet)
    if extra is not None:
        return int(extra(*args, out=_first_tensor(out), **kwargs))
    formula = flop_registry.get(packet)
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))


def backward_flops(func: torch._ops.OpOverload, args: Sequence[Any], forward: int) -> int:
    """Model FLOPs of the backward of one contraction whose forward cost ``forward``."""
    packet = func.overloadpacket
    operands = _CONTRACTION_OPERANDS.get(packet)
    if not operands or not forward:
        return 0
    needs_grad = [i for i in operands if i < len(args) and _requires_grad(args[i])]
    if packet in _ATTENTION:
        # dV = P^T dO and dP = dO V^T are needed for any input gradient; dQ and dK follow from dS.
        return 2 * forward if needs_grad else 0
    return forward * len(needs_grad)


def _requires_grad(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad
