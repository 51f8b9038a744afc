"""fox-kernel: Forgetting Attention (FoX) kernels for PyTorch.

``forgetting_attention`` runs Triton kernels on CUDA and a chunked PyTorch twin on the CPU;
``fox_kernel.reference.forgetting_attention_ref`` is the plain materialised reference. ``KernelOptions``
steers the GPU kernels (default: the ``FOX_KERNEL_*`` environment variables); ``fox_kernel.pruning``
holds the bound of adaptive computation pruning; ``fox_kernel.context_parallel`` splits one sequence
across the ranks of a process group. ``cdiv`` and ``next_power_of_2`` are Triton's, in plain Python, for
launchers (Triton's own go through its JIT at each host call).
"""

from fox_kernel.context_parallel import context_parallel_forgetting_attention
from fox_kernel.decode import (
    append_to_cache,
    append_to_paged_cache,
    fill_empty_cache,
    forgetting_attention_with_kvcache,
    gate_cache,
)
from fox_kernel.ops import forgetting_attention
from fox_kernel.ops.checks import require_window_size, values_checkable
from fox_kernel.ops.dispatch import runs_triton
from fox_kernel.ops.triton.launch import cdiv, next_power_of_2
from fox_kernel.options import KernelOptions, current_options, kernel_options
from fox_kernel.pruning import DEFAULT_LOG_TOLERANCE, AutoThreshold, check_log_tolerance, pruning_threshold
from fox_kernel.pruning import bound as pruning_bound

__version__ = "0.1.0"
__all__ = [
    "DEFAULT_LOG_TOLERANCE",
    "AutoThreshold",
    "KernelOptions",
    "append_to_cache",
    "append_to_paged_cache",
    "cdiv",
    "check_log_tolerance",
    "context_parallel_forgetting_attention",
    "current_options",
    "fill_empty_cache",
    "forgetting_attention",
    "forgetting_attention_with_kvcache",
    "gate_cache",
    "kernel_options",
    "next_power_of_2",
    "pruning_bound",
    "pruning_threshold",
    "require_window_size",
    "runs_triton",
    "values_checkable",
    "__version__",
]
