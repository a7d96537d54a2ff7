"""Distillation in training: the student's loss against a teacher's output distribution on the
same batch (memfit.functional.linear_distillation_loss: cross-entropy on the labels plus KL or JSD
at a temperature, in chunks: neither model's (tokens x vocab) logits are held whole).

The teacher runs in inference mode (no gradient, no activations kept between its blocks), in
the compute dtype or quantized (NF4 / int8: memfit.nn.quant); its output head's weight is read
in its own dtype, chunk by chunk.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from memfit import functional as MF


class Distillation(nn.Module):
    """`forward(tokens, targets)`: the summed loss of the student against the teacher, as the
    student's own forward returns its summed cross-entropy (the train step divides by the
    token count). The teacher is held, not registered: its weights are no part of the
    student's parameters, state dict or optimizer."""

    def __init__(
        self, student: nn.Module, teacher: nn.Module, *, alpha: float, temperature: float,
        kind: str,
    ) -> None:  # fmt: skip
        super().__init__()
        self.student = student
        self._teacher = [teacher]
        self.alpha, self.temperature, self.kind = alpha, temperature, kind

    @property
    def teacher(self) -> nn.Module:
        return self._teacher[0]

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        hidden = self.student(tokens, return_hidden=True)
        with torch.inference_mode():
            teacher_hidden = self.teacher(tokens, return_hidden=True)
        teacher_hidden = teacher_hidden.clone()  # (out of inference mode, for autograd's inputs)
        rows = tokens.numel()
        return MF.linear_distillation_loss(
            hidden.reshape(rows, -1), self.student.output_weight,
            teacher_hidden.reshape(rows, -1), self.teacher.output_weight.detach(),
            targets.reshape(-1), alpha=self.alpha, temperature=self.temperature, kind=self.kind,
        )  # fmt: skip
