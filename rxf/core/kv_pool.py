"""The two-level KV memory: request rows -> token slots -> per-layer K/V buffers.

Slot 0 of the token pool is reserved and never handed out: padded tokens (e.g. in CUDA-graph
batches) write their K/V there. Free lists live on the CPU so allocation never syncs the device.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """`req_to_token[r, i]` is the KV slot of token i of the request occupying row r."""

    def __init__(self, size: int, max_context_len: int, device: torch.device | str) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=device)
        self._free_rows: list[int] = list(range(size - 1, -1, -1))  # pop() hands out row 0 first

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        assert 0 <= row < self.size, row
        self._free_rows.append(row)

    def clear(self) -> None:
        self._free_rows = list(range(self.size - 1, -1, -1))


class TokenToKVPool:
    """Per layer, K and V buffers `[num_slots + 1, kv_heads, head_dim]`; slots are 1..num_slots.

    Slot indices handed out and taken back are CPU int64 tensors; the scheduler and radix tree keep
    them on the CPU and the model runner moves them to the device once per batch.
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        page_size: int = 1,
    ) -> None:
        if page_size != 1:
            raise NotImplementedError("only page_size = 1 is implemented")
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_slots + 1, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.clear()

    # ---- allocation (CPU-side free list) ----
    def clear(self) -> None:
        self._free = torch.arange(1, self.num_slots + 1, dtype=torch.int64)

    def available_size(self) -> int:
        return int(self._free.numel())

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slots as a CPU int64 tensor, or None (nothing taken) when fewer are free."""
        if n > self._free.numel():
            return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free = torch.cat((self._free, slots.to(device="cpu", dtype=torch.int64)))

    # ---- data ----
    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the new tokens' K/V (`[n, kv_heads, head_dim]`) at slots `loc` (device int64)."""
        self.k_buffer[layer_id][loc] = k.to(self.dtype)
        self.v_buffer[layer_id][loc] = v.to(self.dtype)

    def bytes_per_slot(self) -> int:
        k = self.k_buffer[0]
        return 2 * self.num_layers * k.shape[1] * k.shape[2] * k.element_size()
