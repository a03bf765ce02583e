"""The prompt-token source's calibration (parallel prompt decoding, Hao et al. 2024; docs/architecture.md
section 7): its build option (`BUILD`), the training of its tokens, the simulation of its chain
rounds and their price by the cost model and by latency (`MEASURE`). Torch is imported where
used: the command line reads `BUILD`'s option without it.

m trained input embeddings P1..Pm, appended after the newest real token x_t, make the frozen
model guess x_{t+2}..x_{t+m+1} in the same forward pass: P_i sits at position t+i (where the
unknown x_{t+i} will be) and its logits row guesses the token after it. The runtime
(runtimes/drafting/prompt_tokens.py) appends them to every verify pass, so the next round's
drafts cost no extra engine call. Only the m x hidden table trains; the model stays frozen
and stored once.

Data: the model's own greedy continuations of the calibration prompts (what a draft must
equal to be accepted). Each sequence's KV is computed once, frozen; a training step places B
groups of prompt tokens after B different prefixes of one sequence and runs them in ONE pass
of B*m query rows over the frozen prefix KV (DecoderStack.frame_at masks each group to its own
prefix and itself), so a step costs a B*m-token forward and backward, not B full sequences.
Loss: cross-entropy of each P_i's row against the greedy token it must guess. Fixed seed,
Adam, a progress bar; every HOLDOUT_EVERY-th prompt is held out and the report gives per-slot
top-1 accuracy on train and held-out positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from adaptive_export.calibration.draft_builds import BuildOption, BuildStep, SourceBuild
from adaptive_export.calibration.draft_sources import MAX_DRAFT, Candidate, MeasuredElsewhere, latency_candidate
from adaptive_export.runtimes.drafting.prompt_tokens import FIELD, MAX_PROMPT_TOKENS, PromptTokens
from adaptive_export.runtimes.errors import UsageError

if TYPE_CHECKING:
    from torch import Tensor

    from adaptive_export.graphs.layers import DecoderStack

NAME = PromptTokens.name
TABLE = PromptTokens.table
assert TABLE is not None  # the source ships its table

DEFAULT_PROMPT_TOKENS = 3
DEFAULT_STEPS = 240
BATCH = 24  # prefixes per step, each followed by its own group of m prompt tokens
LR_PER_RMS = 0.05  # Adam step size, in units of the token embeddings' RMS
GUESS_CHUNK = 64  # prefixes per no-grad pass when guessing


@dataclass
class FrozenSequence:
    """One greedy run with its per-layer KV computed once (no gradient flows into it)."""

    ids: list[int]
    prompt_len: int
    keys: list[Tensor]  # per layer [L, n_kv, hd]
    values: list[Tensor]

    def positions(self, count: int) -> list[int]:
        """Last-real-token positions t whose m guesses x_{t+2}..x_{t+m+1} are all greedy tokens."""
        return list(range(self.prompt_len - 1, len(self.ids) - count - 1))


@dataclass
class PromptTokenFit:
    table: Tensor  # [m, hidden] in the decoder's input space (after the family's embedding scale)
    report: dict[str, Any] = field(default_factory=dict)


def frozen_sequence(stack: DecoderStack, ids: list[int], prompt_len: int) -> FrozenSequence:
    """Run the sequence once through every layer, keeping each layer's K and V rows."""
    import torch

    with torch.no_grad():
        x = stack.embed_ids(torch.tensor(ids))
        keys, values = [], []
        empty = torch.zeros(0, stack.spec.num_kv_heads, stack.spec.head_dim)
        for layer, frame in zip(stack.layers, stack.frame(0, len(ids))):
            x, k, v = layer(x, empty, empty, *frame)
            keys.append(k)
            values.append(v)
    return FrozenSequence(ids, prompt_len, keys, values)


def guess_logits(stack: DecoderStack, seq: FrozenSequence, table: Tensor, lasts: Sequence[int]) -> Tensor:
    """Logits [len(lasts), m, V]: the prompt tokens placed after each prefix ids[:t+1], t in `lasts`,
    all in one pass; row i of group t guesses ids[t+i+2]."""
    import torch

    m, length = table.shape[0], len(seq.ids)
    last = torch.tensor(list(lasts))
    slot = torch.arange(m)
    query_pos = (last[:, None] + 1 + slot[None, :]).reshape(-1)  # P_i at t+1+i (0-based i)
    group = torch.arange(len(lasts)).repeat_interleave(m)
    own = slot.repeat(len(lasts))
    prefix_seen = torch.arange(length)[None, :] <= last.repeat_interleave(m)[:, None]
    group_seen = (group[:, None] == group[None, :]) & (own[None, :] <= own[:, None])
    allowed = torch.cat((prefix_seen, group_seen), dim=1)
    key_pos = torch.cat((torch.arange(length), query_pos))
    x = table.repeat(len(lasts), 1)
    for layer, frame, k, v in zip(stack.layers, stack.frame_at(query_pos, key_pos, allowed), seq.keys, seq.values):
        x, _, _ = layer(x, k, v, *frame)
    return stack.head(x).view(len(lasts), m, -1)


def guesses(stack: DecoderStack, seq: FrozenSequence, table: Tensor) -> dict[int, list[int]]:
    """Greedy guesses after every prefix that ends in the continuation: t -> [g_{t+2}, ..]."""
    import torch

    out: dict[int, list[int]] = {}
    lasts = list(range(seq.prompt_len - 1, len(seq.ids) - 1))
    with torch.no_grad():
        for begin in range(0, len(lasts), GUESS_CHUNK):
            chunk = lasts[begin : begin + GUESS_CHUNK]
            for t, row in zip(chunk, guess_logits(stack, seq, table, chunk).argmax(-1).tolist()):
                out[t] = row
    return out


def slot_accuracy(stack: DecoderStack, seqs: Sequence[FrozenSequence], table: Tensor) -> list[float]:
    """Per slot i, how often P_i's guess equals the greedy token it stands for."""
    hits, total = [0] * table.shape[0], 0
    for seq in seqs:
        found = guesses(stack, seq, table)
        for t in seq.positions(table.shape[0]):
            total += 1
            for i, guess in enumerate(found[t]):
                hits[i] += int(guess == seq.ids[t + i + 2])
    return [round(h / max(total, 1), 4) for h in hits]


def initial_table(stack: DecoderStack, seqs: Sequence[FrozenSequence], count: int, seed: int) -> Tensor:
    """The mean embedding of the calibration tokens, plus small noise so the slots differ."""
    import torch

    with torch.no_grad():
        tokens = torch.tensor(sorted({t for s in seqs for t in s.ids}))
        embedded = stack.embed_ids(tokens)
        generator = torch.Generator().manual_seed(seed)
        noise = torch.randn(count, embedded.shape[1], generator=generator) * embedded.std()
        return embedded.mean(0, keepdim=True) + 0.1 * noise


def fit_prompt_tokens(
    loaded: Any,
    runs: Sequence[tuple[list[int], list[int]]],
    count: int = DEFAULT_PROMPT_TOKENS,
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
    progress: bool = True,
) -> PromptTokenFit:
    """Train `count` prompt tokens on greedy runs (prompt ids, continuation); returns the table and a report."""
    import torch
    from torch import nn

    from adaptive_export.calibration.exit_adapters import is_held_out
    from adaptive_export.graphs.layers import DecoderStack

    stack = DecoderStack(loaded.hf_model, loaded.spec, range(loaded.spec.num_layers))
    for parameter in stack.parameters():
        parameter.requires_grad_(False)
    seqs = [frozen_sequence(stack, ids + cont, len(ids)) for ids, cont in runs]
    train = [s for i, s in enumerate(seqs) if not is_held_out(i) and s.positions(count)]
    held = [s for i, s in enumerate(seqs) if is_held_out(i) and s.positions(count)]
    if not train:
        raise ValueError(f"no calibration continuation is long enough to train {count} prompt tokens")
    table = nn.Parameter(initial_table(stack, train, count, seed))
    with torch.no_grad():
        rms = float(stack.embed_ids(torch.tensor(train[0].ids)).pow(2).mean().sqrt())
    optimizer = torch.optim.Adam([table], lr=LR_PER_RMS * rms)
    generator = torch.Generator().manual_seed(seed)
    before = {
        "train": slot_accuracy(stack, train, table.detach()),
        "held_out": slot_accuracy(stack, held, table.detach()),
    }
    losses: list[float] = []
    for step in tqdm(range(steps), desc="train prompt tokens", unit="step", disable=not progress):
        seq = train[step % len(train)]
        candidates = seq.positions(count)
        pick = torch.randperm(len(candidates), generator=generator)[:BATCH].tolist()
        lasts = [candidates[i] for i in pick]
        logits = guess_logits(stack, seq, table, lasts)
        targets = torch.tensor([[seq.ids[t + i + 2] for i in range(count)] for t in lasts])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    fitted = table.detach().clone()
    report = {
        "prompt_tokens": count,
        "steps": steps,
        "batch": BATCH,
        "seed": seed,
        "train_sequences": len(train),
        "held_out_sequences": len(held),
        "loss_first": round(losses[0], 4) if losses else None,
        "loss_last": round(sum(losses[-10:]) / max(len(losses[-10:]), 1), 4) if losses else None,
        "slot_accuracy_before": before,
        "slot_accuracy": {"train": slot_accuracy(stack, train, fitted), "held_out": slot_accuracy(stack, held, fitted)},
    }
    return PromptTokenFit(fitted, report)


def simulate_chain(seq: FrozenSequence, found: dict[int, list[int]], k: int) -> dict[str, float]:
    """Greedy chain prompt-token drafting over one continuation, round by round as the runtime runs it: the token
    after the prompt is `pending` at position s; a round with drafts (the guesses made after
    position s-1) emits the accepted ones plus the verifier's token and keeps drafts only if it
    accepted every one; a round without drafts emits one token and makes guesses after s."""
    ids, s = seq.ids, seq.prompt_len
    rounds = draft_rounds = drafted = accepted = 0
    has_drafts = False
    while s < len(ids) - 1:
        rounds += 1
        if not has_drafts:
            s, has_drafts = s + 1, True
            continue
        drafts = found[s - 1][:k][: len(ids) - 1 - s]
        good = 0
        while good < len(drafts) and drafts[good] == ids[s + 1 + good]:
            good += 1
        draft_rounds, drafted, accepted = draft_rounds + 1, drafted + len(drafts), accepted + good
        s, has_drafts = s + good + 1, good == len(drafts)
    produced = len(ids) - 1 - seq.prompt_len
    return {
        "tokens_per_round": produced / max(rounds, 1),
        "acceptance": accepted / max(drafted, 1),
        "draft_round_share": draft_rounds / max(rounds, 1),
    }


def measure_prompt_tokens(loaded: Any, runs: Sequence[tuple[list[int], list[int]]], table: Tensor) -> dict[str, Any]:
    """Simulated chain prompt-token acceptance, tokens per round and share of rounds with drafts (the rest
    run T = 1+m) on the held-out runs, per draft length k <= m (calibration.json 'prompt_tokens')."""
    from adaptive_export.calibration.exit_adapters import is_held_out
    from adaptive_export.graphs.layers import DecoderStack

    stack = DecoderStack(loaded.hf_model, loaded.spec, range(loaded.spec.num_layers))
    held = [
        frozen_sequence(stack, ids + cont, len(ids))
        for i, (ids, cont) in enumerate(runs)
        if is_held_out(i) and len(cont) > 2
    ]
    found = [guesses(stack, seq, table) for seq in held]
    per_k = {}
    for k in range(1, table.shape[0] + 1):
        rows = [simulate_chain(seq, f, k) for seq, f in zip(held, found)]
        per_k[str(k)] = {
            key: round(sum(r[key] for r in rows) / max(len(rows), 1), 4)
            for key in ("tokens_per_round", "acceptance", "draft_round_share")
        }
    return {"prompt_tokens": int(table.shape[0]), "held_out_sequences": len(held), "per_k": per_k}


PROMPT_TOKEN_CALIB_TOKENS = (
    48  # greedy tokens per calibration prompt: the positions prompt tokens train and are measured on
)


def plan_prompt_tokens(
    option: str, loaded: Any, prompts: Sequence[str], seed: int = 0, progress: bool = True
) -> tuple[Tensor, dict[str, Any], dict[str, bytes]]:
    """`--prompt-tokens N|FILE`: train N prompt tokens (or load a previous build's file), then
    simulate them on the held-out prompts. Returns the table, calibration.json's 'prompt_tokens' entry and
    the bundle file that ships the table (a few KB of safetensors)."""
    from adaptive_export.calibration.greedy import greedy_continuations
    from adaptive_export.loading.artifacts import draft_table_bytes, load_draft_table

    runs = greedy_continuations(loaded, prompts, PROMPT_TOKEN_CALIB_TOKENS, progress=progress)
    if option.isdigit():
        fit = fit_prompt_tokens(loaded, runs, int(option), seed=seed, progress=progress)
        table, report = fit.table, fit.report
    else:
        table, report = load_draft_table(TABLE, option, loaded.spec.hidden_size), {"loaded_from": Path(option).name}
    measured = measure_prompt_tokens(loaded, runs, table)
    return table, {**measured, "fit": report}, {TABLE.file: draft_table_bytes(TABLE, table)}


class PromptTokensMeasure(MeasuredElsewhere):
    """Prompt-token drafts (runtimes/drafting/prompt_tokens.py) need the trained prompt tokens, so they are
    simulated where those are trained (measure_prompt_tokens above), into
    measured["prompt_tokens"]: tokens per round and the share of rounds that carry drafts."""

    name = "prompt_tokens"

    @staticmethod
    def cost_candidates(measured: dict[str, Any], layers: int, head: float, adapter: float) -> list[Candidate]:
        """A round is one decode pass (its width ignored by this model), as for prompt lookup."""
        return [
            {
                "source": "prompt_tokens",
                "draft_len": int(k),
                "tokens_per_round": row["tokens_per_round"],
                "expected_speedup": round(row["tokens_per_round"], 3),
            }
            for k, row in (measured.get("prompt_tokens") or {}).get("per_k", {}).items()
        ]

    @staticmethod
    def latency_candidates(
        measured: dict[str, Any], latencies: dict[str, Any], exit_layer: int | None
    ) -> list[Candidate]:
        """A round with k drafts is one decode pass at T = 1+k+m, a round without at T = 1+m."""
        rounds = measured.get("prompt_tokens") or {}
        m, step, out = int(rounds.get("prompt_tokens", 0)), latencies["decode_ms"][1], []
        for k_text, row in rounds.get("per_k", {}).items():
            k = int(k_text)
            if 1 + k + m not in latencies["decode_ms"]:
                continue
            share = row["draft_round_share"]
            round_ms = share * latencies["decode_ms"][1 + k + m] + (1 - share) * latencies["decode_ms"][1 + m]
            tokens, acceptance = row["tokens_per_round"], row["acceptance"]
            fields = {"source": "prompt_tokens", "draft_len": k, "tokens_per_round": tokens, "acceptance": acceptance}
            out.append(latency_candidate(fields, round_ms, step))
        return out

    @staticmethod
    def wide_verify_costs(measured: dict[str, Any] | None, decode_ms: dict[int, float]) -> dict[str, float] | None:
        """Its verify pass also carries the m prompt tokens: T = 1+k+m."""
        m = int((measured or {}).get("prompt_tokens", 0))
        return {
            str(k): round(decode_ms[1 + k + m] / decode_ms[1], 3)
            for k in range(1, MAX_DRAFT + 1)
            if 1 + k + m in decode_ms
        }


MEASURE = PromptTokensMeasure

HELP = (
    "prompt-token drafts (parallel prompt decoding, run --draft prompt_tokens): train N prompt-token "
    f"embeddings (1..{MAX_PROMPT_TOKENS}; 3 is a good start) on the model's own greedy continuations of "
    "the calibration prompts, model frozen, fixed --seed; "
    "the full decode engine embeds them, so every verify pass also guesses the next round's drafts. They ship "
    "as prompt_tokens.safetensors (N x hidden floats, a few KB); FILE reuses such a file. With --speculate "
    "auto, calibration measures them beside the other draft sources. Default: 0 (none)"
)


class PromptTokensBuild(BuildStep):
    """`build --prompt-tokens N|FILE`: train N prompt tokens (or load a file); they draft unless --speculate chooses."""

    option = BuildOption("--prompt-tokens", "0", "N|FILE", HELP)

    @staticmethod
    def check(value: str) -> None:
        """N in 1..MAX_PROMPT_TOKENS, or an existing file."""
        if value.isdigit():
            if not 1 <= int(value) <= MAX_PROMPT_TOKENS:
                raise UsageError(
                    f"--prompt-tokens {value} is outside 1..{MAX_PROMPT_TOKENS}",
                    "train 2 to 4 prompt tokens, e.g. --prompt-tokens 3",
                )
        elif not Path(value).is_file():
            raise UsageError(
                f"prompt tokens file {value!r} does not exist",
                "pass a number of prompt tokens to train (e.g. --prompt-tokens 3), "
                "or a prompt_tokens.safetensors file written by a previous build",
            )

    @staticmethod
    def build(value: str, loaded: Any, prompts: Sequence[str], seed: int) -> SourceBuild:
        table, rounds, files = plan_prompt_tokens(value, loaded, prompts, seed)
        count = int(table.shape[0])
        return SourceBuild(
            NAME, PromptTokensBuild.option.flag, {FIELD: count}, table, {"draft_len": count}, rounds, files
        )


BUILD = PromptTokensBuild
