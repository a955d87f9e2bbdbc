"""How many clients the vectorised executor stacks at once: the device's memory budget, the
allocator's measured peak (CUDA), and on CPU the activations of one stacked step."""

from __future__ import annotations

import os

import torch
from torch import nn

from fedskew.models.functional import in_eval_mode

# A group of clients that is not a contiguous range of the stack is gathered (and scattered back)
# when its clients' training state is at most this many bytes per chunk; larger states train as
# several contiguous runs of views instead (MAP's MLPNet, 20 clients: 29.6 s a round gathering vs
# 13.4 s padded; the copies cost more than the extra calls).
GATHER_BYTES = 16 << 20


# CPU: the activations of one stacked step are kept within this many bytes, so that a step's
# working set stays near the caches (measured, BatchNorm CNN, 1,000 Fashion-MNIST clients, B = 16:
# 25 s a round in chunks of 20 clients vs 62 s with all 1,000 stacked and 34 s sequential).
CPU_STEP_BYTES = 64 << 20


def activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of every leaf module's output for the batch ``x`` (eval mode, no gradient); 0 when
    the model cannot run it (then nothing is capped)."""
    def size(out):
        if isinstance(out, torch.Tensor):
            return out.numel() * out.element_size()
        return sum(size(o) for o in out) if isinstance(out, (tuple, list)) else 0

    total = [0]
    hooks = [m.register_forward_hook(lambda mod, inp, out: total.__setitem__(0, total[0] + size(out)))
             for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            in_eval_mode(model, lambda: model(x))
    except (RuntimeError, ValueError):
        return 0
    finally:
        for h in hooks:
            h.remove()
    return total[0]


# The share of a CUDA device this process may plan for: 1 / the number of sweep workers that share
# it (set by :func:`fedskew.experiments.pool.worker_init`). Each worker sized its chunks from the
# whole device's free memory, so the first to start a large chunk took most of the card and the
# others ran out of memory however far they halved (a GPU window of 2026-11-28: four workers,
# MAP's final passes, 33 GiB held by each of three).
DEVICE_SHARE = 1.0


def _device_memory(device: torch.device) -> int:
    """Bytes the executor may use: on CUDA the free memory plus what PyTorch's caching allocator
    holds unused (the previous chunk's blocks), within this process's :data:`DEVICE_SHARE` of the
    device; on CPU the physical memory."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        budget = free + torch.cuda.memory_reserved(device) - allocated
        return max(0, min(budget, int(DEVICE_SHARE * total) - allocated))
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


class DeviceMemory:
    """What the executor asks the device about memory: the budget, and the allocator's peak since
    a reset (None on CPU, which has no such counter). Tests stand a fake in for CUDA."""

    def __init__(self, device: torch.device):
        self.device = device

    def budget(self) -> int:
        return _device_memory(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None


def chunk_size(num_clients: int, model: nn.Module, device: torch.device, memory: DeviceMemory, x_one: torch.Tensor,
               batch_size: int, limit: int | None, client_bytes: int, step_bytes: list) -> int:
    """Clients stacked at once: ``limit`` (``max_parallel_clients``) if set; else as many as fit in
    the device's budget, by the measured peak per client of earlier chunks (``client_bytes``, CUDA)
    once there is one, before that by 4 copies of the parameters in a quarter of the budget; on CPU
    at most ``CPU_STEP_BYTES`` of one step's activations (``step_bytes``: a one-element cache)."""
    if limit:
        return min(limit, num_clients)
    if client_bytes:
        return max(1, min(num_clients, int(0.8 * memory.budget()) // client_bytes))
    per_client = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
    size = max(1, min(num_clients, memory.budget() // 4 // max(per_client, 1)))
    if device.type == "cpu":  # near the caches (CPU_STEP_BYTES)
        if not step_bytes:
            step_bytes.append(batch_size * activation_bytes(model, x_one))
        size = min(size, max(1, CPU_STEP_BYTES // max(step_bytes[0], 1)))
    return size
