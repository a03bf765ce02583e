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


class ExitAdapter(nn.Module):
    """Low-rank residual map h_E -> h_E + up(silu(down(norm(h_E)))) before the shared head.

    `up` starts at zero, so an untrained adapter is the identity (raw early exit).
    """

    def __init__(self, hidden_size: int, rank: int, eps: float) -> None:
        super().__init__()
        self.norm_weight = nn.Parameter(torch.ones(hidden_size))
        self.down = nn.Linear(hidden_size, rank, bias=False)
        self.up = nn.Linear(rank, hidden_size, bias=False)
        nn.init.zeros_(self.up.weight)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        return x + self.up(torch.nn.functional.silu(self.down(h)))


class GatedExitAdapter(nn.Module):
    """Gated-MLP residual map h_E -> h_E + down(silu(gate(n)) * up(n)), n = norm(h_E): a decoder
    layer's MLP without its attention, so a trained draft exit costs at most one layer.

    Why: a low-rank adapter only rotates h_E within `rank` directions; the late layers it stands
    in for are MLP-heavy, and a gated MLP of the same width as the model's is the cheapest block
    that can mimic them. `down` starts at zero, so an untrained adapter is the identity.
    """

    def __init__(self, hidden_size: int, width: int, eps: float) -> None:
        super().__init__()
        self.norm_weight = nn.Parameter(torch.ones(hidden_size))
        self.gate = nn.Linear(hidden_size, width, bias=False)
        self.up = nn.Linear(hidden_size, width, bias=False)
        self.down = nn.Linear(width, hidden_size, bias=False)
        nn.init.zeros_(self.down.weight)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
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
