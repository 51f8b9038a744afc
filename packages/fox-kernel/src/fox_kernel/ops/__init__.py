from fox_kernel.ops.forgetting_attention import forgetting_attention, pruning_threshold

__all__ = ["forgetting_attention", "pruning_threshold"]
