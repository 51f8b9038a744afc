"""Fused Triton kernels of the FoX layer (GPU, or CPU with TRITON_INTERPRET=1), each with a PyTorch twin."""
