"""Would an EAGLE-form draft pay on this CPU? Measured before any graph holds one (issue #24).

    python -m benchmarks.eagle_draft --bundle DIR [--model smollm2] [--requests 60] [--docstrings 300]
                                     [--epochs 4] [--max-seconds 240] [--vocab 2048]

The EAGLE form drafts the token after next from the verifier's own last hidden state h_L(t) and
the embedding of token t+1, the token that same pass just chose. In this runtime's two-row step
(`run --decode-rows 2`: every decode pass is [pending, guess], T=2) that is a draft of k=1 whose
input is always the verifier's true state, so its teacher-forced agreement on the model's own
greedy text IS its acceptance rate; a round yields 1 + (guess accepted) tokens and costs one T=2
pass plus the draft. Both the pass ratio T=2 / T=1 (calibration/verify_cost.py, on the bundle's
own decode engine) and the draft (exported to ONNX, timed in ONNX Runtime) are measured here, so
the expected speed-up over plain decoding needs no cost model:

    exact speed-up over T=1 plain decoding = (1 + acceptance) / (T2 / T1 + draft / T1)

Every pass is two rows there, as exactness on an accuracy-4 bundle needs (its T=1 and T=2 passes
round differently; docs/speculation.md "Exact speculation at accuracy 4"). The last columns price
the same draft where a round whose draft is unsure runs T=1 instead (best confidence threshold):
exact only where T=1 and T=2 passes agree, as on fp32 bundles. Two blocks, each one decoder
layer's parameters or fewer (calibration/draft_training.py's gated form), trained by
self-distillation (KL to the teacher's top-k over a VocabTrim head) on calibration/draft_data.py's
text (self-written requests and answers, stdlib docstrings; whole documents held out):
  "eagle": gated MLP over [norm(h_L(t)), norm(embed(x_{t+1}))] (EAGLE's feature + token input);
  "medusa": the same over norm(h_L(t)) alone (a Medusa head: it must guess x_{t+1} too).
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from tqdm import tqdm

from adaptive_export.calibration.draft_length import THRESHOLDS
from adaptive_export.calibration.draft_training import (
    TOP_K,
    TrainSettings,
    TrimmedDraft,
    layer_params,
    predictions,
    row_of,
    train_block,
    trimmed_ids,
    vocabulary_order,
)
from adaptive_export.calibration.drafts.eagle import first_sight
from adaptive_export.calibration.verify_cost import measure_verify_costs
from adaptive_export.graphs.layers import Head
from benchmarks.common import bench_parser, cpu_model, median_of, parse_and_pin, print_table

DRAFT_TIMING_REPEATS = 200


@dataclass(frozen=True)
class Pairs:
    """Teacher-forced positions t of one split: [h_L(t) | embed(x_{t+1})], the teacher's top-k at t+1
    (the distribution of x_{t+2}), and whether x_{t+1} and x_{t+2} are the model's own greedy tokens."""

    features: Tensor  # [N, 2H]
    top_ids: Tensor  # [N, TOP_K]; column 0 is the teacher's argmax
    top_logp: Tensor  # [N, TOP_K]
    own: Tensor  # [N] bool


def teacher_pairs(loaded: Any, docs: Any, seen: set[int]) -> Pairs:
    """One frozen pass per document; positions whose prefix was seen before are dropped (the chat
    template's shared system prompt would dominate and leak into the held-out split)."""
    embed = loaded.hf_model.get_input_embeddings()
    features, ids, logp, own = [], [], [], []
    with torch.no_grad():
        for doc in tqdm(docs, desc="teacher pass", unit="doc"):
            fresh = [t for t in range(len(doc.ids) - 2) if first_sight(doc.ids[: t + 2], seen)]
            if not fresh:
                continue
            tokens = torch.tensor([doc.ids])
            out = loaded.hf_model(tokens, output_hidden_states=True)
            at, nxt = torch.tensor(fresh), torch.tensor(fresh) + 1
            features.append(torch.cat([out.hidden_states[-1][0, at], embed(tokens[0, nxt])], -1).float())
            top = torch.log_softmax(out.logits[0, nxt].float(), -1).topk(TOP_K, -1)
            ids.append(top.indices)
            logp.append(top.values)
            own.append(torch.tensor([doc.answer_start <= t + 1 for t in fresh]))
    return Pairs(torch.cat(features), torch.cat(ids), torch.cat(logp), torch.cat(own))


class NextNextBlock(nn.Module):
    """h_L(t) (+ embed(x_{t+1})) -> a residual state the shared final norm and trimmed head read."""

    def __init__(self, hidden_size: int, width: int, eps: float, with_token: bool) -> None:
        super().__init__()
        self.hidden_size, self.eps, self.with_token = hidden_size, eps, with_token
        inputs = 2 * hidden_size if with_token else hidden_size
        self.gate = nn.Linear(inputs, width, bias=False)
        self.up = nn.Linear(inputs, width, bias=False)
        self.down = nn.Linear(width, hidden_size, bias=False)
        nn.init.zeros_(self.down.weight)

    def _norm(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, pair: Tensor) -> Tensor:
        h, token = pair[..., : self.hidden_size], pair[..., self.hidden_size :]
        n = torch.cat([self._norm(h), self._norm(token)], -1) if self.with_token else self._norm(h)
        return h + self.down(nn.functional.silu(self.gate(n)) * self.up(n))


def make_block(loaded: Any, with_token: bool) -> NextNextBlock:
    """The widest block within one decoder layer's parameters (gate, up: inputs x width; down)."""
    spec = loaded.spec
    inputs = (2 if with_token else 1) * spec.hidden_size
    width = min(layer_params(loaded) // (2 * inputs + spec.hidden_size), (8 * spec.hidden_size) // 3)
    return NextNextBlock(spec.hidden_size, width, spec.rms_norm_eps, with_token)


def draft_ms(draft: TrimmedDraft, width: int, threads: int) -> float:
    """Median ms of one draft (block, final norm, trimmed head) at T=1 in ONNX Runtime, fp32."""
    import onnxruntime as ort

    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        logging.getLogger("torch").setLevel(logging.ERROR)
        program = torch.onnx.export(draft, (torch.zeros(1, width),), dynamo=True, verbose=False)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(program.model_proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: np.random.default_rng(0).standard_normal((1, width)).astype(np.float32)}
    for _ in range(10):
        session.run(None, feed)
    samples = []
    for _ in range(DRAFT_TIMING_REPEATS):
        started = time.perf_counter()
        session.run(None, feed)
        samples.append((time.perf_counter() - started) * 1e3)
    return median_of(samples)


@dataclass(frozen=True)
class Measured:
    form: str
    params: int
    acceptance: float  # held-out, the model's own greedy text
    all_text: float  # held-out, every position
    draft_ms: float
    best: dict[str, float]  # the threshold with the best expected speed-up, and what it gives


def expected_speedup(correct: Tensor, confidence: Tensor, t2: float, draft: float) -> dict[str, float]:
    """Over T=1 plain decoding, costs in T=1 passes: every pass two rows (exact at accuracy 4), and the
    best threshold where a round drafts only when the draft's top-1 probability reaches it."""
    exact = (1 + float(correct.float().mean())) / (t2 + draft)
    best: dict[str, float] = {}
    for threshold in THRESHOLDS:
        drafted = confidence >= threshold
        tokens = 1 + float((drafted & correct).float().mean())
        cost = float(drafted.float().mean()) * t2 + float((~drafted).float().mean()) + draft
        if not best or tokens / cost > best["speed-up, T=1 where unsure"]:
            best = {"threshold": threshold, "drafted": float(drafted.float().mean()), "tokens/pass": tokens,
                    "speed-up, T=1 where unsure": tokens / cost}  # fmt: skip
    return {"exact two-row speed-up": exact, **best}


@dataclass(frozen=True)
class Trained:
    """One block after training: its draft and, per held-out position, the guess's hit and confidence."""

    form: str
    draft: TrimmedDraft
    correct: Tensor
    confidence: Tensor


def train_form(loaded: Any, splits: tuple[Pairs, Pairs], ids: Tensor, with_token: bool, settings: TrainSettings
               ) -> Trained:  # fmt: skip
    train, held = splits
    draft = TrimmedDraft(make_block(loaded, with_token), Head(loaded.hf_model, loaded.spec), ids)
    top_index = row_of(ids, loaded.spec.vocab_size)[train.top_ids]
    form = "eagle" if with_token else "medusa"
    train_block(draft, train.features, top_index, train.top_logp, settings, form)
    tokens, confidence = predictions(draft, held.features, ids)
    return Trained(form, draft.eval(), tokens == held.top_ids[:, 0], confidence)


def measured(trained: Trained, held: Pairs, pass_ms: dict[int, float], threads: int) -> Measured:
    """Time the draft (after every training, on a machine doing nothing else) and price its rounds."""
    ms = draft_ms(trained.draft, held.features.shape[1], threads)
    own = held.own
    return Measured(
        trained.form,
        sum(p.numel() for p in trained.draft.block.parameters()),
        float(trained.correct[own].float().mean()),
        float(trained.correct.float().mean()),
        ms,
        expected_speedup(trained.correct[own], trained.confidence[own], pass_ms[2] / pass_ms[1], ms / pass_ms[1]),
    )


def main() -> None:
    parser = bench_parser(__doc__, threads_help="threads of the bundle's engine and of the draft (default: 2)")
    parser.add_argument("--bundle", type=Path, required=True, help="a built bundle of the same model (its T=2 cost)")
    parser.add_argument("--model", default="smollm2", help="a packaged model name or a model path")
    parser.add_argument("--requests", type=int, default=60, help="requests the model writes itself, then answers")
    parser.add_argument("--answer-tokens", type=int, default=96, help="tokens of each self-written answer")
    parser.add_argument("--docstrings", type=int, default=300, help="standard-library docstrings")
    parser.add_argument("--epochs", type=int, default=4, help="passes over the training positions")
    parser.add_argument("--max-seconds", type=float, default=240.0, help="training time cap per form")
    parser.add_argument("--vocab", type=int, default=2048, help="token ids the trimmed head scores")
    args = parse_and_pin(parser)
    run(args)


def run(args: Any) -> None:
    from adaptive_export.calibration.draft_data import training_text
    from adaptive_export.loading.model import load_model

    loaded = load_model(args.model)
    loaded.hf_model.eval().requires_grad_(False)
    wall = time.perf_counter()
    text = training_text(loaded, requests=args.requests, answer_tokens=args.answer_tokens,
                         docstrings=args.docstrings, seed=0)  # fmt: skip
    seen: set[int] = set()
    splits = (teacher_pairs(loaded, text.train, seen), teacher_pairs(loaded, text.held_out, seen))
    order = vocabulary_order(loaded, text, splits[0])  # type: ignore[arg-type]  # it reads .top_ids only
    ids = trimmed_ids(order, min(args.vocab, loaded.spec.vocab_size))
    settings = TrainSettings(epochs=args.epochs, max_seconds=args.max_seconds)
    trained = [train_form(loaded, splits, ids, with_token, settings) for with_token in (True, False)]
    minutes = (time.perf_counter() - wall) / 60
    print(f"timing from {time.strftime('%H:%M:%S')}")  # nothing else may run on the machine from here
    verify = measure_verify_costs(args.bundle, max_k=1, threads=args.threads)
    rows = [measured(t, splits[1], dict(verify.pass_ms), args.threads) for t in trained]
    print(f"\n{args.model}: text {text.summary()}")
    print(f"positions: train {len(splits[0].own)}, held-out {len(splits[1].own)} ({int(splits[1].own.sum())} greedy)")
    print(f"T=1 {verify.pass_ms[1]:.2f} ms, T=2 {verify.pass_ms[2]:.2f} ms on {args.bundle} ({verify.engine})")
    print(f"{cpu_model()}, {args.threads} threads, text and training {minutes:.1f} min\n")
    table = [
        {"form": r.form, "params": r.params, "acceptance (own text)": f"{r.acceptance:.3f}",
         "all held-out": f"{r.all_text:.3f}", "draft ms": f"{r.draft_ms:.3f}",
         **{k: f"{v:.3f}" for k, v in r.best.items()}}
        for r in rows
    ]  # fmt: skip
    print_table(table, list(table[0]))


if __name__ == "__main__":
    main()
