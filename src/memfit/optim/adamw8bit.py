"""AdamW with 8-bit states (memfit.ops.adamw8bit): 2 bytes of state per parameter, plus 8 bytes
per block of 256, instead of AdamW's 8.

    AdamW8bit(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
              min_8bit_size=4096)

torch.optim.AdamW's hyperparameters and update (decoupled weight decay, bias correction); the
moments are stored block-wise quantized and dequantized for each step. Tensors of fewer than
`min_8bit_size` elements (norm weights, biases: a sliver of the memory, and the tensors whose
few values the quantization would perturb most) keep fp32 moments, as does every tensor of a
parameter group with `"states_32bit": True` (bitsandbytes' advice for embeddings, whose rows see
gradients rarely and of very different sizes). `stochastic_rounding=True` rounds bf16 parameters
up or down at random in proportion (unbiased), for bf16 weights kept without fp32 masters:
rounding to nearest would drop every update smaller than half a bf16 step.

Per parameter, `state` holds "step" (a CPU tensor: bias correction needs no GPU sync) and either
"exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_root_codes", "exp_avg_sq_root_absmax" (uint8 of
the parameter's shape, fp32 per block of 256) or "exp_avg", "exp_avg_sq" (fp32). On CUDA each
step is one fused Triton launch per parameter group and kind of state; on the CPU, vectorized
torch ops per tensor (the same arithmetic). Parameters may be fp32 or bf16, with gradients of
their dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from memfit.ops._triton import use_triton
from memfit.ops.adamw8bit import (
    BLOCK,
    ChunkTable,
    adamw_step_reference,
    dequantize,
    fused_adamw_step,
    quantize,
)
from memfit.optim.states import load_states_as_saved

__all__ = ["AdamW8bit", "state_bytes"]

_QUANTIZED = ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_root_codes", "exp_avg_sq_root_absmax")


def state_bytes(numel: int, *, quantized: bool = True) -> int:
    """Bytes of state AdamW8bit keeps for a tensor of `numel` elements (the CPU step counter
    aside): a byte per element and an fp32 absmax per block of 256 for each moment, or two fp32
    moments for a tensor kept in 32 bits."""
    if not quantized:
        return 8 * numel
    return 2 * numel + 2 * 4 * -(-numel // BLOCK)


CPU_CHUNK = 1 << 20  # elements per pass of the torch path (a multiple of BLOCK)


def _torch_step(param: Tensor, grad: Tensor, state: dict, *, stochastic_seed, **options) -> None:
    """`adamw_step_reference` over chunks of CPU_CHUNK elements of a contiguous tensor (the
    blocks are the same, so are the values; stochastic rounding draws per chunk): its fp32
    temporaries stay a few MiB and in cache instead of several of the tensor's size."""
    n = param.numel()
    if n <= CPU_CHUNK or not (param.is_contiguous() and grad.is_contiguous()):
        adamw_step_reference(param, grad, state, stochastic_seed=stochastic_seed, **options)
        return
    flat = {key: value.view(-1) for key, value in state.items() if key != "step"}
    for index, start in enumerate(range(0, n, CPU_CHUNK)):
        end = min(start + CPU_CHUNK, n)
        part = {
            key: value[start // BLOCK : -(-end // BLOCK)]
            if key.endswith("absmax")
            else value[start:end]
            for key, value in flat.items()
        }
        seed = None if stochastic_seed is None else stochastic_seed + index
        adamw_step_reference(
            param.view(-1)[start:end], grad.view(-1)[start:end], part, stochastic_seed=seed,
            **options,
        )  # fmt: skip


class AdamW8bit(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        min_8bit_size: int = 4096,
        stochastic_rounding: bool = False,
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"AdamW8bit: lr must be >= 0, got {lr}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"AdamW8bit: betas must be in [0, 1), got {betas}")
        if not eps >= 0:
            raise ValueError(f"AdamW8bit: eps must be >= 0, got {eps}")
        if not weight_decay >= 0:
            raise ValueError(f"AdamW8bit: weight_decay must be >= 0, got {weight_decay}")
        if min_8bit_size < 0:
            raise ValueError(f"AdamW8bit: min_8bit_size must be >= 0, got {min_8bit_size}")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "states_32bit": False,
        }
        super().__init__(params, defaults)
        self.min_8bit_size = min_8bit_size
        self.stochastic_rounding = stochastic_rounding
        self._places: dict[int, int] | None = None
        self._tables: dict[tuple, ChunkTable] = {}

    def _quantized(self, param: Tensor, group: dict) -> bool:
        return not group["states_32bit"] and param.numel() >= self.min_8bit_size

    def _init_state(self, param: Tensor, group: dict) -> dict:
        if param.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"AdamW8bit: parameters must be fp32 or bf16, got {param.dtype} (shape "
                f"{tuple(param.shape)})"
            )
        state = self.state[param]
        state["step"] = torch.zeros((), dtype=torch.float32)
        if self._quantized(param, group):
            blocks = -(-param.numel() // BLOCK)
            for key in _QUANTIZED:
                if key.endswith("codes"):
                    state[key] = torch.zeros_like(param, dtype=torch.uint8)
                else:
                    state[key] = torch.zeros(blocks, dtype=torch.float32, device=param.device)
        else:
            state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            options = {
                "lr": group["lr"],
                "beta1": beta1,
                "beta2": beta2,
                "eps": group["eps"],
                "weight_decay": group["weight_decay"],
            }
            launches: dict[tuple, tuple[list, list, list]] = {}
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise ValueError("AdamW8bit: sparse gradients are not supported")
                if grad.dtype != param.dtype:
                    raise ValueError(
                        f"AdamW8bit: a gradient of {grad.dtype} for a parameter of {param.dtype}"
                    )
                state = self.state[param] or self._init_state(param, group)
                state["step"] += 1
                step = int(state["step"].item())
                if not use_triton(param) or not param.is_contiguous():  # (flat offsets)
                    seed = self._seed(step, param) if self.stochastic_rounding else None
                    _torch_step(param, grad, state, step=step, stochastic_seed=seed, **options)
                    continue
                key = (param.device, param.dtype, "exp_avg_codes" in state, step)
                batch = launches.setdefault(key, ([], [], []))
                batch[0].append(param)
                batch[1].append(grad.contiguous())
                batch[2].append(state)
            for (device, _, _, step), (params, grads, states) in launches.items():
                seed = self._seed(step, params[0]) if self.stochastic_rounding else None
                fused_adamw_step(
                    params, grads, states, self._table(params, device), step=step,
                    stochastic_seed=seed, **options,
                )  # fmt: skip
        return loss

    def _seed(self, step: int, param: Tensor) -> int:
        """The stochastic rounding's seed for the launch or tensor that `param` begins: a
        function of the step and of the parameter's place, so that a resumed run draws the same
        bits."""
        if self._places is None:
            params = (p for group in self.param_groups for p in group["params"])
            self._places = {id(p): i for i, p in enumerate(params)}
        return (step * 1_000_003 + self._places[id(param)]) % (1 << 31)

    def _table(self, params: list[Tensor], device: torch.device) -> ChunkTable:
        numels = tuple(p.numel() for p in params)
        key = (device, numels)
        if key not in self._tables:
            self._tables[key] = ChunkTable(list(numels), device)
        return self._tables[key]

    def checkpoint_state(self, param: Tensor) -> dict[str, Tensor]:
        """The state of `param` as per-element fp32 tensors and the step: "exp_avg" and
        "exp_avg_sq_root" (8-bit states, dequantized) or "exp_avg" and "exp_avg_sq". ZeRO's
        sharded checkpoints save this form, which reshards like AdamW's states; loading it
        (`load_state_dict` takes both forms) quantizes again, to the same codes where the
        blocks are the same."""
        state = self.state.get(param, {})
        if "exp_avg_codes" not in state:
            return dict(state)
        return {
            "step": state["step"],
            "exp_avg": dequantize(state["exp_avg_codes"], state["exp_avg_absmax"], True),
            "exp_avg_sq_root": dequantize(
                state["exp_avg_sq_root_codes"], state["exp_avg_sq_root_absmax"], False
            ),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, except that the states keep their dtypes (torch casts floating-point states
        to the parameter's dtype, which would turn the codes into floats and round a bf16
        parameter's fp32 moments); states in `checkpoint_state`'s form are quantized (or kept
        in 32 bits) as this optimizer keeps them for the parameter."""
        load_states_as_saved(self, state_dict, self._from_checkpoint)

    def _from_checkpoint(self, param: Tensor, group: dict, state: dict) -> dict:
        """A loaded state in the form this optimizer keeps for `param`: per-element fp32
        moments (exp_avg, and exp_avg_sq or its root) quantized or kept in 32 bits; 8-bit states
        as they are."""
        if "exp_avg_codes" in state:
            return state
        m = state.pop("exp_avg").float().view(param.shape)
        root = state.pop("exp_avg_sq_root", None)
        squares = state.pop("exp_avg_sq", None)
        if root is None:
            root = torch.sqrt(squares.float())
        root = root.float().view(param.shape)
        if not self._quantized(param, group):
            state["exp_avg"] = m
            state["exp_avg_sq"] = (
                squares.float().view(param.shape) if squares is not None else root * root
            )
            return state
        state["exp_avg_codes"], state["exp_avg_absmax"] = quantize(m, True)
        state["exp_avg_sq_root_codes"], state["exp_avg_sq_root_absmax"] = quantize(root, False)
        return state
