"""Test-session setup. On a machine without CUDA, memfit's Triton kernels are tested under
Triton's interpreter, which must be switched on before triton is imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
