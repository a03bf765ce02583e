"""What a smaller bundle drafting for a larger one would buy (issue #37 item 3), before building it.

    python -m benchmarks.draft_model_ceiling --target-bundle B15 --draft-bundle B05 \
        --reference peers-cache-qwen2.5-coder-1.5b/reference-*.json [--max-draft 6] [--json F]

Greedy speculation accepts a drafted token iff it equals the target's. A draft model writes its
i-th token from the accepted prefix, so a round starting at position p accepts exactly the run of
positions p, p+1, ... at which the draft's argmax over the target's own text is the target's next
token. This measures that teacher-forced agreement with the draft bundle's own engines (prefill,
then decode passes of up to 8 rows over the target's greedy answers from benchmarks/peers.py's HF
fp32 reference), and prices rounds of k drafts with both bundles' measured passes on this CPU
(calibration/verify_cost.py, interleaved medians): k draft steps (a T=2 first step after a round
that accepted everything, which leaves the last draft and the bonus token unread), then one target
pass of T = k + 1. The result is an upper bound of what the source can earn here: it counts no
Python overhead, no rollback work and no draft-length control. The vocabularies must be equal.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmarks.common import bench_parser, cpu_model, parse_and_pin, print_table

CHUNK = 8  # rows per teacher-forced decode pass (a verify pass's width at k = 7)


@dataclass(frozen=True)
class Ceiling:
    """One prompt set at one draft length: tokens per round and the priced TPOT against plain."""

    prompts: str
    draft_len: int
    agreement: float
    tokens_per_round: float
    tpot_ms: float
    vs_target_plain: float


def teacher_forced_hits(generator, prompt_ids: list[int], answer: list[int]) -> list[bool]:
    """hits[i]: the draft's argmax after prompt + answer[:i] is answer[i]."""
    backend, arena = generator.backend, generator.arena
    decode = generator.bundle.config("full").decode
    logits = backend.run("prefill", np.asarray([prompt_ids], dtype=np.int64), arena, 0).logits
    guesses = [int(np.argmax(logits[0, -1]))]
    for start in range(0, len(answer) - 1, CHUNK):
        rows = answer[start : min(start + CHUNK, len(answer) - 1)]
        out = backend.run(decode, np.asarray([rows], dtype=np.int64), arena, len(prompt_ids) + start).logits
        guesses.extend(int(t) for t in np.argmax(out[0, : len(rows)], axis=-1))
    return [g == t for g, t in zip(guesses, answer, strict=True)]


def priced_rounds(
    hits: list[list[bool]], k: int, draft_ms: dict[int, float], target_ms: dict[int, float]
) -> tuple[float, float]:
    """(tokens per round, ms per token) of rounds of k drafts over every answer."""
    tokens = rounds = 0
    cost = 0.0
    for answer in hits:
        position, caught_up = 0, True
        while position < len(answer):
            run = 0
            while run < k and position + run < len(answer) and answer[position + run]:
                run += 1
            emitted = min(run + 1, len(answer) - position)
            cost += draft_ms[1 if caught_up else 2] + (k - 1) * draft_ms[1] + target_ms[k + 1]
            caught_up = run < k
            tokens, rounds, position = tokens + emitted, rounds + 1, position + emitted
    return tokens / rounds, cost / tokens


def measure(target: Path, draft: Path, references: list[Path], max_draft: int, threads: int) -> list[Ceiling]:
    from adaptive_export.calibration.verify_cost import time_decode_passes
    from adaptive_export.runtimes.bundle import load_bundle
    from adaptive_export.runtimes.draft_model import check_pairing
    from adaptive_export.runtimes.errors import UsageError
    from adaptive_export.runtimes.generate import Generator

    drafting = Generator(load_bundle(draft, verify="size"), threads=threads)
    verifying = Generator(load_bundle(target, verify="size"), threads=threads)
    try:  # the runtime's own pairing rule (`run --draft-bundle`): the same tokens, id for id
        check_pairing(verifying.bundle, drafting.bundle, verifying.codec, drafting.codec)
    except UsageError as exc:
        raise SystemExit(exc.one_line()) from None
    target_ms = dict(time_decode_passes(verifying, max_draft).pass_ms)
    draft_ms = dict(time_decode_passes(drafting, 1).pass_ms)  # T = 1 and 2
    rows = []
    for path in references:
        reference = json.loads(path.read_text())
        pairs = zip(reference["ids"], reference["tokens"], strict=True)
        hits = [teacher_forced_hits(drafting, ids, answer) for ids, answer in pairs]
        agreement = float(np.mean([h for answer in hits for h in answer]))
        name = f"{len(hits)} prompts: {reference['prompts'][0][:32]}..."
        for k in range(1, max_draft + 1):
            per_round, ms = priced_rounds(hits, k, draft_ms, target_ms)
            ratio = round(ms / target_ms[1], 3)
            rows.append(Ceiling(name, k, round(agreement, 4), round(per_round, 3), round(ms, 2), ratio))
    print(f"target T=1..{max_draft + 1} ms: {target_ms}; draft T=1,2 ms: {draft_ms}")
    return rows


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--target-bundle", required=True, help="the bundle that verifies (e.g. the 1.5B's)")
    parser.add_argument("--draft-bundle", required=True, help="the bundle that drafts (e.g. the 0.5B's)")
    parser.add_argument("--reference", nargs="+", required=True, help="peers.py reference JSON files of the target")
    parser.add_argument("--max-draft", type=int, default=6, help="draft lengths 1..N are priced (default: 6)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parse_and_pin(parser)
    references = [Path(p) for p in args.reference]
    rows = measure(Path(args.target_bundle), Path(args.draft_bundle), references, args.max_draft, args.threads)
    print(f"CPU: {cpu_model()}, {args.threads} threads")
    print_table([asdict(r) for r in rows], list(Ceiling.__dataclass_fields__))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
