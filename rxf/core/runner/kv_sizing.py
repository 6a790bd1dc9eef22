"""How many KV slots a runner's pool gets, and the check that the device can hold the pools it is
told to build."""

from __future__ import annotations

import torch

from rxf.core.config import CacheConfig


def slots_from_memory(
    cache: CacheConfig, device: torch.device, bytes_per_slot: int, max_running: int, max_context_len: int
) -> int:
    """The slots `cache.mem_fraction_static` of the GPU leaves beside the live tensors (the weights),
    or `cache.cpu_kv_cache_gb` holds on the CPU."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # count only live tensors (the weights) as used
        free, total = torch.cuda.mem_get_info(device)
        budget = total * cache.mem_fraction_static - (total - free)
        where = f"cache.mem_fraction_static={cache.mem_fraction_static} of {total / 2**30:.1f} GiB"
    else:
        budget = cache.cpu_kv_cache_gb * 2**30
        where = f"cache.cpu_kv_cache_gb={cache.cpu_kv_cache_gb}"
    # More slots than every running request at full context could never be in use at once.
    slots = min(int(budget // bytes_per_slot), max_running * max_context_len)
    if slots < 1:
        raise RuntimeError(f"no memory left for the KV cache ({where}); raise it or set cache.max_total_tokens")
    return slots


def check_pool_memory(
    device: torch.device, slots: int, max_context_len: int, kv_bytes: int, row_bytes: int
) -> None:
    """Refuse, naming the settings, pools the device cannot hold (a `cache.max_total_tokens` set
    past the machine's memory was zero-filled on a CPU until the kernel killed the scheduler,
    and the launch said only "EOFError")."""
    if device.type == "cuda":
        available = torch.cuda.mem_get_info(device)[0]
    else:
        available = _cpu_available_bytes()
        if available is None:  # not Linux: nothing to read it from
            return
    if kv_bytes + row_bytes > available:
        raise RuntimeError(
            f"the KV cache needs {kv_bytes / 2**30:.1f} GiB ({slots} slots: "
            f"cache.max_total_tokens) and its request rows {row_bytes / 2**30:.1f} GiB "
            f"(scheduler.max_running_requests x the {max_context_len}-token context), but "
            f"{available / 2**30:.1f} GiB of {device.type} memory is available; lower them"
        )


def _cpu_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (what the kernel could hand out without swapping), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
