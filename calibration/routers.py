"""Train FiRST routers with the model frozen (docs/architecture.md section 2, "Routers").

p_i is the mean over the prompt's tokens of sigmoid(w_i . x_t) on layer i's input: the
statistic the prefill graph emits and the runtime thresholds. The loss is next-token
cross-entropy on the model's own greedy continuation (what the full model would say) plus
lambda * sum_i p_i plus a small weight decay. Only the [L, H] router matrix trains.

The forward pass trains what inference runs. Prompt rows go through every layer (prefill
never skips), so p_i is computed on exactly the inputs the prefill graph sees. Continuation
rows are gated by g_i = 1[p_i >= 0.5] + p_i - stopgrad(p_i): in the forward pass the hard
keep/skip decision the runtime makes, in the backward pass the gradient of the soft gate
p_i * f_i(x) + (1 - p_i) * x (a straight-through estimator). Soft gating alone trained a
blend the runtime never runs: on SmolLM2 it skipped layers whose hard removal cost half of
the top-1 agreement even at lambda = 0 (benchmarks/router_sweep.py, docs/routers.md).

Adam trains w_i * rms_i (rms_i: each input coordinate's root-mean-square at layer i), not
w_i: on raw inputs every router logit moved by lr x the size of its layer's activations,
so SmolLM2's last two layers (the largest activations, and the costliest layers to skip)
were the first to go at every lambda.
"""

from __future__ import annotations

import math
import time
from collections.abc import Set
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from adaptive_export.graphs.adaptive import Routers
from adaptive_export.graphs.layers import DecoderStack

DEFAULT_LAMBDA = 0.02
WEIGHT_DECAY = 1e-4
INIT_KEEP_PROBABILITY = 0.95
THRESHOLD = 0.5  # the runtime keeps layer i iff p_i >= THRESHOLD (manifest router_threshold)
LEARNING_RATE = 5e-3


@dataclass
class TrainingSequence:
    ids: list[int]  # prompt + greedy continuation
    prompt_len: int


@dataclass
class RouterTrainingResult:
    routers: Routers
    lam: float
    epochs: int
    seconds: float
    loss_first: float
    loss_last: float
    mean_p_last: float


class GatedModel(DecoderStack):
    """The frozen decoder with FiRST gates on continuation rows; returns logits and the p_i."""

    def __init__(self, loaded: Any) -> None:
        super().__init__(loaded.hf_model, loaded.spec, range(loaded.spec.num_layers))

    def layer_inputs(self, ids: list[int]) -> list[torch.Tensor]:
        """Input of every layer for an ungated forward pass (for router initialisation)."""
        x, frame, empty = self._start(ids)
        inputs = []
        with torch.no_grad():
            for layer, step in zip(self.layers, frame):
                inputs.append(x)
                x, _, _ = layer(x, empty, empty, *step)
        return inputs

    def forward(self, ids: list[int], prompt_len: int, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """weight: the [L, H] router matrix (a tensor, so training can reparametrise it)."""
        x, frame, empty = self._start(ids)
        is_prompt = (torch.arange(len(ids)) < prompt_len)[:, None]
        scores = []
        for index, layer in enumerate(self.layers):
            p = torch.sigmoid(x[:prompt_len] @ weight[index]).mean()
            gate = (p >= THRESHOLD).float() + p - p.detach()  # hard decision forward, soft gradient backward
            out, _, _ = layer(x, empty, empty, *frame[index])
            x = torch.where(is_prompt, out, gate * out + (1 - gate) * x)
            scores.append(p)
        return self.head(x), torch.stack(scores)

    def _start(self, ids: list[int]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]], torch.Tensor]:
        """(embeddings, each layer's (cos, sin, mask), an empty KV prefix) for a fresh pass over ids."""
        x = self.embed_ids(torch.tensor(ids))
        empty = torch.zeros(0, self.spec.num_kv_heads, self.spec.head_dim)
        return x, self.frame(0, len(ids)), empty


def input_statistics(model: GatedModel, sequences: list[TrainingSequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, root-mean-square) per layer and hidden coordinate of the layers' prompt inputs, [L, H] each."""
    spec = model.spec
    sums = torch.zeros(spec.num_layers, spec.hidden_size)
    squares = torch.zeros(spec.num_layers, spec.hidden_size)
    for seq in sequences:
        for index, x in enumerate(model.layer_inputs(seq.ids[: seq.prompt_len])):
            sums[index] += x.mean(0)
            squares[index] += x.pow(2).mean(0)
    count = max(len(sequences), 1)
    return sums / count, (squares / count).sqrt().clamp_min(1e-3)


def initial_routers(means: torch.Tensor) -> Routers:
    """w_i along the mean input direction of layer i, scaled so p_i starts near 0.95 (keep all)."""
    routers = Routers(*means.shape)
    target = math.log(INIT_KEEP_PROBABILITY / (1 - INIT_KEEP_PROBABILITY))
    with torch.no_grad():
        routers.weight.copy_(means * (target / means.pow(2).sum(-1, keepdim=True).clamp_min(1e-6)))
    return routers


def train_routers(
    loaded: Any,
    sequences: list[TrainingSequence],
    lam: float = DEFAULT_LAMBDA,
    epochs: int = 3,
    lr: float = LEARNING_RATE,
    seed: int = 0,
    progress: bool = True,
    routers: Routers | None = None,
) -> RouterTrainingResult:
    torch.manual_seed(seed)
    model = GatedModel(loaded).eval()
    means, scale = input_statistics(model, sequences)
    routers = routers or initial_routers(means)
    # Adam moves every coordinate by about lr per step, so on raw inputs a router's logit moves
    # with the size of its layer's activations: late layers (and outlier coordinates) flipped
    # first, whatever their cost. Training w * scale (scale: each coordinate's RMS) moves
    # every logit alike; the exported router is still the linear map w on the raw input.
    scaled = torch.nn.Parameter(routers.weight.detach() * scale)
    optimizer = torch.optim.Adam([scaled], lr=lr)
    order = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    mean_p = 1.0
    started = time.perf_counter()
    bar = tqdm(total=epochs * len(sequences), desc=f"train routers (lambda={lam})", unit="seq", disable=not progress)
    for _ in range(epochs):
        for index in torch.randperm(len(sequences), generator=order).tolist():
            seq = sequences[index]
            logits, p = model(seq.ids, seq.prompt_len, scaled / scale)
            targets = torch.tensor(seq.ids[seq.prompt_len :])
            ce = torch.nn.functional.cross_entropy(logits[seq.prompt_len - 1 : -1], targets)
            loss = ce + lam * p.sum() + WEIGHT_DECAY * scaled.pow(2).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            mean_p = p.mean().item()
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", mean_p=f"{mean_p:.3f}")
    bar.close()
    with torch.no_grad():
        routers.weight.copy_(scaled / scale)
    window = max(1, len(sequences))
    return RouterTrainingResult(
        routers=routers.eval(),
        lam=lam,
        epochs=epochs,
        seconds=time.perf_counter() - started,
        loss_first=sum(losses[:window]) / window,
        loss_last=sum(losses[-window:]) / window,
        mean_p_last=mean_p,
    )


def skipping_logits(model: GatedModel, ids: list[int], prompt_len: int, kept: Set[int]) -> torch.Tensor:
    """Logits where rows after the prompt bypass the layers outside `kept`: the runtime's
    semantics (prefill runs every layer, decode skips), in one teacher-forced pass."""
    x, frame, empty = model._start(ids)
    is_prompt = (torch.arange(len(ids)) < prompt_len)[:, None]
    with torch.no_grad():
        for index, layer in enumerate(model.layers):
            out, _, _ = layer(x, empty, empty, *frame[index])
            x = out if index in kept else torch.where(is_prompt, out, x)
        return model.head(x)


def continuation_agreement(model: GatedModel, sequences: list[TrainingSequence], kept: Set[int]) -> float:
    """Teacher-forced top-1 agreement with the full model's greedy continuation when decoding
    skips the layers outside `kept`."""
    hits = total = 0
    for seq in sequences:
        logits = skipping_logits(model, seq.ids, seq.prompt_len, kept)[seq.prompt_len - 1 : -1]
        hits += int((logits.argmax(-1) == torch.tensor(seq.ids[seq.prompt_len :])).sum())
        total += len(seq.ids) - seq.prompt_len
    return hits / max(total, 1)


def router_scores(loaded: Any, routers: Routers, prompt_ids: list[int]) -> list[float]:
    """p_i exactly as the prefill graph computes them: no gating, full model, prompt tokens."""
    model = GatedModel(loaded).eval()
    with torch.no_grad():
        return [
            float(torch.sigmoid(x @ routers.weight[i]).mean()) for i, x in enumerate(model.layer_inputs(prompt_ids))
        ]


def kept_by_routers(loaded: Any, routers: Routers | None, prompt_ids: list[int]) -> frozenset[int]:
    """The layers the runtime keeps for this prompt (p_i >= THRESHOLD); every layer without routers."""
    if routers is None:
        return frozenset(range(loaded.spec.num_layers))
    return frozenset(i for i, s in enumerate(router_scores(loaded, routers, prompt_ids)) if s >= THRESHOLD)
