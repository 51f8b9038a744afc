"""fox-kernel: Forgetting Attention (FoX) kernels for PyTorch.

``forgetting_attention`` runs Triton kernels on CUDA and a chunked PyTorch twin on the CPU;
``fox_kernel.reference.forgetting_attention_ref`` is the plain materialised reference.
"""

from fox_kernel.decode import append_to_cache, append_to_paged_cache, forgetting_attention_with_kvcache
from fox_kernel.ops import forgetting_attention, pruning_threshold

__version__ = "0.1.0"
__all__ = [
    "append_to_cache",
    "append_to_paged_cache",
    "forgetting_attention",
    "forgetting_attention_with_kvcache",
    "pruning_threshold",
    "__version__",
]
