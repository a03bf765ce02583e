"""Where an EAGLE head's acceptance goes between its training text and the prompts it serves.

    python -m benchmarks.head_acceptance --model qwen2.5-coder-0.5b --bundle DIR [--head FILE]
                                         [--prompts 16] [--tokens 64]

A head's build records its acceptance on held-out text like its training text (the model's own
answers to self-written requests). Per prompt set (samples/coder_chat_prompts.jsonl and
coder_edit_prompts.jsonl), this measures the same head on the answers those prompts get:
  fp32: teacher-forced on the fp32 model's greedy answers (the training's measure), with the
        head's trimmed vocabulary and with every token id scored (what trimming costs);
  bundle: `--mode spec --draft eagle` on the bundle, every round drafting the head's guess: the
        accepted share of its drafts, as the 4-bit engines compute the hidden state it reads.
No timing: acceptance only, so the machine's load does not matter.
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import ROOT, bench_parser, cpu_model, load_prompts, parse_and_pin, print_table

SETS = ("chat", "edit")


def fp32_acceptance(loaded: Any, head_file: str, prompts: list[str], tokens: int) -> dict[str, float]:
    """Teacher-forced share of answer positions whose next-but-one token the head names."""
    import torch

    from adaptive_export.calibration.draft_data import Document
    from adaptive_export.calibration.draft_training import TrimmedDraft, predictions
    from adaptive_export.calibration.drafts.eagle import load_eagle, teacher_pairs
    from adaptive_export.calibration.greedy import greedy_sequences
    from adaptive_export.graphs.drafts.eagle import PairBlock, unpack
    from adaptive_export.graphs.layers import Head

    fit = load_eagle(head_file, loaded)
    spec = loaded.spec
    docs = [Document(tuple(ids), "self", start) for ids, start in greedy_sequences(loaded, prompts, tokens)]
    pairs = teacher_pairs(loaded, docs, set(), progress=True)
    answers, target = pairs.own, pairs.top_ids[:, 0]
    result = {"positions": float(answers.sum())}
    for name, ids in (("trimmed", fit.ids), ("all ids", torch.arange(spec.vocab_size))):
        block = PairBlock(unpack(fit.table.float(), spec.rms_norm_eps), spec.hidden_size)
        draft = TrimmedDraft(block, Head(loaded.hf_model, spec), ids)
        guessed, _ = predictions(draft, pairs.features, ids)
        result[name] = float((guessed == target)[answers].float().mean())
    result["in vocabulary"] = float(torch.isin(target, fit.ids)[answers].float().mean())
    return result


def bundle_acceptance(bundle: str, prompts: list[str], tokens: int, threads: int) -> tuple[float, int]:
    """(accepted / drafted, drafted) of the head's drafts in the bundle, every round drafting."""
    from adaptive_export.runtimes import Generator

    generator = Generator(bundle, threads=threads)
    drafted = accepted = 0
    for prompt in prompts:
        stats = generator.generate(prompt, max_new_tokens=tokens, mode="spec", draft="eagle").stats
        drafted, accepted = drafted + stats.speculation["drafted"], accepted + stats.speculation["accepted"]
    return accepted / max(drafted, 1), drafted


def main() -> None:
    parser = bench_parser(__doc__, bundle="a bundle with the head (default build of a packaged coder model)")
    parser.add_argument("--model", required=True, help="the bundle's model (packaged name or path)")
    parser.add_argument("--head", default=None, help="the head file (default: the bundle's eagle_head.safetensors)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per set")
    parser.add_argument("--tokens", type=int, default=64, help="greedy answer tokens per prompt")
    args = parse_and_pin(parser)
    from adaptive_export.loading.model import load_model

    head = args.head or f"{args.bundle}/eagle_head.safetensors"
    loaded = load_model(args.model)
    loaded.hf_model.eval().requires_grad_(False)
    rows = []
    for kind in SETS:
        prompts = load_prompts(ROOT / "samples" / f"coder_{kind}_prompts.jsonl", args.prompts)
        fp32 = fp32_acceptance(loaded, head, prompts, args.tokens)
        in_bundle, drafted = bundle_acceptance(args.bundle, prompts, args.tokens, args.threads)
        rows.append(
            {
                "prompts": f"{kind} x {len(prompts)}",
                "fp32 trimmed": f"{fp32['trimmed']:.3f}",
                "fp32 all ids": f"{fp32['all ids']:.3f}",
                "answer tokens in vocabulary": f"{fp32['in vocabulary']:.3f}",
                "positions": int(fp32["positions"]),
                "bundle --draft eagle": f"{in_bundle:.3f}",
                "drafts": drafted,
            }
        )
    print(f"\n{args.model}, head {head}: {args.tokens} greedy tokens per prompt, {cpu_model()}")
    print_table(rows, list(rows[0]))


if __name__ == "__main__":
    main()
