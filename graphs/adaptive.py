"""The two small trainable additions: FiRST routers and LayerSkip-style exit adapters."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


class Routers(nn.Module):
    """One bias-free linear router R^H -> R per decoder layer (FiRST), stored as [L, H].

    Router i scores the input of layer i (layer 0: the token embeddings).
    """

    def __init__(self, num_layers: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_layers, hidden_size))

    def score(self, layer: int, x: Tensor) -> Tensor:
        """Sequence-mean sigmoid of router `layer` over x [T, H]: a scalar."""
        return torch.sigmoid(x @ self.weight[layer]).mean()


class _NormedResidual(nn.Module):
    """What both exit blocks share: an RMS norm of h_E with its own weight (`norm_weight`, the
    tensor name the bundle's exit_adapters.safetensors uses), the block's output added to h_E."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm_weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def normed(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight


class ExitAdapter(_NormedResidual):
    """Low-rank residual map h_E -> h_E + up(silu(down(norm(h_E)))) before the shared head.

    `up` starts at zero, so an untrained adapter is the identity (raw early exit).
    """

    def __init__(self, hidden_size: int, rank: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        self.down = nn.Linear(hidden_size, rank, bias=False)
        self.up = nn.Linear(rank, hidden_size, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.up(torch.nn.functional.silu(self.down(self.normed(x))))


class GatedExitAdapter(_NormedResidual):
    """Gated-MLP residual map h_E -> h_E + down(silu(gate(n)) * up(n)), n = norm(h_E): a decoder
    layer's MLP without its attention, so a trained draft exit costs at most one layer.

    Why: a low-rank adapter only rotates h_E within `rank` directions; the late layers it stands
    in for are MLP-heavy, and a gated MLP of the same width as the model's is the cheapest block
    that can mimic them. `down` starts at zero, so an untrained adapter is the identity.
    """

    def __init__(self, hidden_size: int, width: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        self.gate = nn.Linear(hidden_size, width, bias=False)
        self.up = nn.Linear(hidden_size, width, bias=False)
        self.down = nn.Linear(width, hidden_size, bias=False)
        nn.init.zeros_(self.down.weight)

    def forward(self, x: Tensor) -> Tensor:
        h = self.normed(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


@dataclass(frozen=True)
class DraftHead:
    """A trained draft exit (calibration/draft_training.py, `build --draft-head`): the exit block
    at `exit_layer`, the ascending token ids its head scores (rows of the LM head, VocabTrim),
    the round's draft length and the confidence below which a round stops drafting."""

    exit_layer: int
    form: str  # "lowrank" (ExitAdapter) | "gated" (GatedExitAdapter)
    block: nn.Module
    ids: Tensor
    draft_len: int
    stop_below: float
