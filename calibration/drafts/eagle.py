"""The EAGLE head's calibration (Li et al. 2024, k = 1; docs/eagle.md): its
build option (`BUILD`, `--eagle-head N`), its training, and its measure (`MEASURE`). Torch is
imported where used: the command line reads `BUILD`'s option without it.

The head guesses token t+2 from the model's last hidden state at t (before the final norm) and
the embedding of token t+1, the token that same pass chose (graphs/drafts/eagle.py). Trained by
self-distillation as benchmarks/eagle_draft.py measured it: text the model writes itself
(requests and greedy answers) plus standard-library docstrings (calibration/draft_data.py, whole
documents held out); one frozen teacher pass per document caches the features and the teacher's
top-k at t+1; only the block trains (KL to that top-k over the N ids the teacher chooses most,
VocabTrim), seeded, AdamW under `accelerate` (one process here, `accelerate launch` on GPUs),
with a progress bar and a time cap. Its held-out agreement on the model's own text is the
acceptance of its drafts in two-row rounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adaptive_export.calibration.draft_builds import BuildOption, BuildStep, SourceBuild
from adaptive_export.calibration.draft_sources import Candidate, MeasuredElsewhere, latency_candidate
from adaptive_export.calibration.drafts.precision import precision_asked
from adaptive_export.runtimes.drafting.eagle import FIELD, Eagle
from adaptive_export.runtimes.errors import UsageError

if TYPE_CHECKING:
    from torch import Tensor

NAME = Eagle.name
TABLE = Eagle.table
assert TABLE is not None  # the source ships its table

MIN_VOCAB, MAX_VOCAB = 16, 65536
REQUESTS, ANSWER_TOKENS, DOCSTRINGS = 48, 96, 240  # the training text (calibration/draft_data.py)
EPOCHS, MAX_SECONDS = 4, 900.0  # 2-core CPU: the whole 0.5B recipe stays within about 30 minutes
AUTO = "auto"
HELP = (
    "train an EAGLE head that guesses the token after next in every decode pass, scoring the N token ids "
    "the model writes most (e.g. 4096; 0 = none), or take a bundle's eagle_head.safetensors (FILE): "
    "the guess of every two-row pass, and `run --draft eagle`. auto (default): the head shipped for a "
    "packaged model (samples/heads/; built without training), none for other models or with options "
    "it does not combine with (another backend, --speculate, --routers, draft options)"
)


@dataclass(frozen=True)
class Pairs:
    """Teacher-forced positions t of one split: [h_L(t) | embed(x_{t+1})], the teacher's top-k at t+1
    (the distribution of x_{t+2}), and whether x_{t+2} is the model's own greedy token."""

    features: Tensor  # [N, 2H]
    top_ids: Tensor  # [N, TOP_K]; column 0 is the teacher's argmax
    top_logp: Tensor  # [N, TOP_K]
    own: Tensor  # [N] bool


def teacher_pairs(loaded: Any, docs: Sequence[Any], seen: set[int], progress: bool) -> Pairs:
    """One frozen pass per document, the last hidden state read before the final norm (what the
    decode graph hands its head); positions whose prefix was seen before are dropped."""
    import torch
    from tqdm import tqdm

    from adaptive_export.calibration.draft_training import TOP_K
    from adaptive_export.graphs.architectures import architecture

    hf = loaded.hf_model
    embed = architecture(loaded.spec.model_type).embed(hf)
    captured: list[Tensor] = []
    hook = (
        architecture(loaded.spec.model_type)
        .final_norm(hf)
        .register_forward_pre_hook(lambda _, inputs: captured.append(inputs[0]))
    )
    features, ids, logp, own = [], [], [], []
    try:
        with torch.no_grad():
            for doc in tqdm(docs, desc="eagle teacher pass", unit="doc", disable=not progress):
                fresh = [t for t in range(len(doc.ids) - 2) if first_sight(doc.ids[: t + 2], seen)]
                if not fresh:
                    continue
                captured.clear()
                tokens = torch.tensor([doc.ids])
                logits = hf(tokens).logits
                at, nxt = torch.tensor(fresh), torch.tensor(fresh) + 1
                features.append(torch.cat([captured[-1][0, at], embed(tokens[0, nxt])], -1).float())
                top = torch.log_softmax(logits[0, nxt].float(), -1).topk(TOP_K, -1)
                ids.append(top.indices)
                logp.append(top.values)
                own.append(torch.tensor([doc.answer_start <= t + 2 for t in fresh]))
    finally:
        hook.remove()
    if not features:
        raise UsageError("the EAGLE head's training text has no positions", "train on a model with a tokenizer")
    return Pairs(torch.cat(features), torch.cat(ids), torch.cat(logp), torch.cat(own))


def first_sight(prefix: tuple[int, ...], seen: set[int]) -> bool:
    """Whether this prefix is new (and now seen): a prefix two documents share is trained on once."""
    key = hash(prefix)
    if key in seen:
        return False
    seen.add(key)
    return True


@dataclass(frozen=True)
class EagleFit:
    table: Tensor  # graphs/drafts/eagle.py pack(block)
    ids: Tensor  # the draft vocabulary, ascending
    report: dict[str, Any]


def fit_eagle(loaded: Any, vocab: int, seed: int, progress: bool = True) -> EagleFit:
    """Text, one teacher pass, training, held-out acceptance: the head and what it measured."""
    import time

    import torch

    from adaptive_export.calibration.draft_data import training_text
    from adaptive_export.calibration.draft_training import (
        TrainSettings,
        TrimmedDraft,
        predictions,
        row_of,
        train_block,
        trimmed_ids,
        vocabulary_order,
    )
    from adaptive_export.graphs.drafts.eagle import EagleBlock, PairBlock, pack
    from adaptive_export.graphs.layers import Head

    wall, cpu = time.perf_counter(), time.process_time()
    loaded.hf_model.eval().requires_grad_(False)
    text = training_text(
        loaded, requests=REQUESTS, answer_tokens=ANSWER_TOKENS, docstrings=DOCSTRINGS, seed=seed, progress=progress
    )
    seen: set[int] = set()
    train, held = (teacher_pairs(loaded, docs, seen, progress) for docs in (text.train, text.held_out))
    ids = trimmed_ids(vocabulary_order(loaded, text, train), min(vocab, loaded.spec.vocab_size - 1))  # type: ignore[arg-type]
    width = min(2 * loaded.spec.hidden_size, 16384)
    torch.manual_seed(seed)
    hidden = loaded.spec.hidden_size
    block = PairBlock(EagleBlock(hidden, width, loaded.spec.rms_norm_eps), hidden)
    draft = TrimmedDraft(block, Head(loaded.hf_model, loaded.spec), ids)  # block -> final norm -> trimmed rows
    settings = TrainSettings(epochs=EPOCHS, max_seconds=MAX_SECONDS, seed=seed, progress=progress)
    top_index = row_of(ids, loaded.spec.vocab_size)[train.top_ids]
    trained = train_block(draft, train.features, top_index, train.top_logp, settings, "eagle head")
    guessed, _ = predictions(draft, held.features, ids)
    hit = guessed == held.top_ids[:, 0]
    report = {
        "text": text.summary(),
        "positions": {"train": int(train.own.numel()), "held_out": int(held.own.numel())},
        "acceptance_own_text": round(float(hit[held.own].float().mean()), 4) if bool(held.own.any()) else None,
        "agreement_all_text": round(float(hit.float().mean()), 4),
        "vocab": int(ids.numel()),
        "width": width,
        "training": trained,
        "minutes": round((time.perf_counter() - wall) / 60, 2),
        "cpu_minutes": round((time.process_time() - cpu) / 60, 2),
    }
    return EagleFit(pack(block.block), ids, report)


class EagleMeasure(MeasuredElsewhere):
    """The head's drafts need the trained head, so they are measured where it is trained (`fit_eagle`:
    its held-out acceptance on the model's own text, measured[NAME]); a round is one T=2 decode pass
    that emits 1 + acceptance tokens."""

    name = NAME

    @staticmethod
    def cost_candidates(measured: dict[str, Any], layers: int, head: float, adapter: float) -> list[Candidate]:
        """A round is one decode pass (its width ignored by this model), as for prompt lookup."""
        accepted = _acceptance(measured)
        if accepted is None:
            return []
        tokens = round(1 + accepted, 4)
        return [{"source": NAME, "draft_len": 1, "tokens_per_round": tokens, "expected_speedup": round(tokens, 3)}]

    @staticmethod
    def latency_candidates(
        measured: dict[str, Any], latencies: dict[str, Any], exit_layer: int | None
    ) -> list[Candidate]:
        """A round is one decode pass at T = 2."""
        accepted, decode_ms = _acceptance(measured), latencies["decode_ms"]
        if accepted is None or 2 not in decode_ms:
            return []
        fields = {"source": NAME, "draft_len": 1, "tokens_per_round": round(1 + accepted, 4), "acceptance": accepted}
        return [latency_candidate(fields, decode_ms[2], decode_ms[1])]


def _acceptance(measured: dict[str, Any]) -> float | None:
    value = (measured.get(NAME) or {}).get("acceptance_own_text")
    return float(value) if value is not None else None


class EagleBuild(BuildStep):
    """`build --eagle-head N|FILE`: train the head over N token ids (or load one); it guesses in every decode pass."""

    option = BuildOption("--eagle-head", AUTO, "N|FILE|auto", HELP)

    @classmethod
    def resolve(cls, value: str, options: Any) -> str:
        """auto: the packaged model's shipped head where this build is plain ONNX Runtime
        decoding, else none (an explicit N or FILE is checked with the options, as before)."""
        from adaptive_export.loading.shipped_heads import shipped_head

        if value != AUTO:
            return value
        head = shipped_head(options.model)
        plain = (
            tuple(options.backends) == ("onnx",)
            and not (options.speculate or options.routers or options.draft_vocab)
            and (options.draft_head or "none") == "none"
            and not precision_asked(options)
        )
        return str(head) if head is not None and plain else "0"

    @classmethod
    def trains(cls, value: str) -> bool:
        return value.isdigit()

    @classmethod
    def streams(cls, value: str) -> bool:
        """Its graph piece reads the embedding (streamed like the model's) and the draft
        vocabulary's LM head rows, which a streamed build reads from the .gguf row by row."""
        return True

    @staticmethod
    def check(value: str) -> None:
        if value.isdigit() and not MIN_VOCAB <= int(value) <= MAX_VOCAB:
            raise UsageError(
                f"--eagle-head {value} is not a vocabulary size in {MIN_VOCAB}..{MAX_VOCAB}",
                "pass the token ids the head scores, e.g. --eagle-head 4096",
            )
        if not value.isdigit() and not Path(value).is_file():
            raise UsageError(
                f"EAGLE head file {value!r} does not exist",
                f"pass a vocabulary size to train one (e.g. --eagle-head 4096), or the {TABLE.file} of a bundle",
            )

    @staticmethod
    def build(value: str, loaded: Any, prompts: Sequence[str], seed: int) -> SourceBuild:
        fit = fit_eagle(loaded, int(value), seed) if value.isdigit() else load_eagle(value, loaded)
        width = int(fit.table.shape[0]) // 5
        section = {"draft_len": 1, "acceptance": fit.report.get("acceptance_own_text")}
        files = {TABLE.file: eagle_bytes(fit)}
        return SourceBuild(NAME, EagleBuild.option.flag, {FIELD: width}, fit.table, section, fit.report, files, fit.ids)


def eagle_bytes(fit: EagleFit) -> bytes:
    """The head as its bundle file: the packed table (`check` reads it back), its vocabulary's ids
    (int32) and its measured acceptance, so `--eagle-head FILE` rebuilds without training. A table
    that fp16 holds exactly (a shipped head) is stored as fp16: the same values at half the bytes."""
    import torch
    from safetensors.torch import save

    table = fit.table.detach().contiguous()
    if table.dtype == torch.float32 and torch.equal(table.half().float(), table):
        table = table.half()
    tensors = {TABLE.key: table, "ids": fit.ids.to(torch.int32).contiguous()}
    return save(tensors, metadata={"acceptance_own_text": repr(fit.report.get("acceptance_own_text"))})


def load_eagle(path: str, loaded: Any) -> EagleFit:
    """`--eagle-head FILE`: a head eagle_bytes wrote, checked against the model."""
    from safetensors import SafetensorError, safe_open

    from adaptive_export.loading.artifacts import load_draft_table

    fix = "train an EAGLE head for this model with --eagle-head N"
    table = load_draft_table(TABLE, path, loaded.spec.hidden_size)
    try:
        with safe_open(path, framework="pt") as reader:
            ids, metadata = reader.get_tensor("ids").long(), reader.metadata() or {}
    except (SafetensorError, OSError, ValueError) as exc:
        raise UsageError(f"EAGLE head file {path!r} holds no token ids ({exc})", fix) from exc
    vocab = loaded.spec.vocab_size
    good = ids.dim() == 1 and 0 < ids.numel() < vocab and int(ids.min()) >= 0 and int(ids.max()) < vocab
    if not good or not bool((ids[1:] > ids[:-1]).all()) or table.shape[0] % 5:
        raise UsageError(f"EAGLE head file {path!r} is no head of this model (ids or table shape)", fix)
    report = {"loaded_from": Path(path).name, "acceptance_own_text": _rate(metadata.get("acceptance_own_text"))}
    return EagleFit(table, ids, report)


def _rate(text: str | None) -> float | None:
    """A file's recorded acceptance: a number in [0, 1], else unknown (a hostile file's is only text)."""
    try:
        value = float(text) if text is not None and len(text) < 32 else None
    except ValueError:
        return None
    return value if value is not None and 0.0 <= value <= 1.0 else None


def check_options(options: Any, quantize: str) -> None:
    """The head runs in ONNX Runtime engines and owns the bundle's one draft vocabulary."""
    if not EagleBuild.asked(dict(options.draft_options).get(NAME)):
        return
    if tuple(options.backends) != ("onnx",):
        raise UsageError(
            "--eagle-head runs in ONNX Runtime engines only", "build with --backend onnx, or drop --eagle-head"
        )
    if options.draft_vocab or (options.draft_head or "none") != "none" or precision_asked(options):
        raise UsageError(
            "--eagle-head trims the bundle's one draft vocabulary itself",
            "drop --draft-vocab, --draft-head and --draft-precision, or drop --eagle-head",
        )


MEASURE = EagleMeasure
BUILD = EagleBuild
