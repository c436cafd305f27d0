"""KV injection (new tokens' K/V into their arena slots) and rollback zeroing: launchers and
pure-torch references. Slots are given per token as (block, offset) from the block tables."""

from __future__ import annotations

import torch

from dspark.kernels.library import KernelLibrary


def kv_inject_reference(k_new: torch.Tensor, v_new: torch.Tensor, k_pool: torch.Tensor,
                        v_pool: torch.Tensor, block: torch.Tensor, offset: torch.Tensor) -> None:
    """k_new/v_new [T, kv_heads, d] -> pool[block[t], :, offset[t]]."""
    k_pool[block.long(), :, offset.long()] = k_new
    v_pool[block.long(), :, offset.long()] = v_new


def kv_zero_reference(k_pool: torch.Tensor, v_pool: torch.Tensor, block: torch.Tensor,
                      offset: torch.Tensor) -> None:
    k_pool[block.long(), :, offset.long()] = 0
    v_pool[block.long(), :, offset.long()] = 0


def kv_inject(k_new: torch.Tensor, v_new: torch.Tensor, k_pool: torch.Tensor,
              v_pool: torch.Tensor, block: torch.Tensor, offset: torch.Tensor,
              library: KernelLibrary) -> None:
    if len(block):
        library.launch("kv_inject", (len(block), library.spec.num_kv_heads), k_new, v_new,
                       k_pool, v_pool, block, offset)


def kv_zero(k_pool: torch.Tensor, v_pool: torch.Tensor, block: torch.Tensor,
            offset: torch.Tensor, library: KernelLibrary) -> None:
    if len(block):
        library.launch("kv_zero", (len(block), library.spec.num_kv_heads), k_pool, v_pool,
                       block, offset)
