"""`run`, `inspect` and `bench`: the runtime only (torch-free)."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from adaptive_export.commands import EXIT_OK
from adaptive_export.commands.options import BenchOptions, InspectOptions, RunOptions
from adaptive_export.loading.prompts import read_prompt_file
from adaptive_export.runtimes import limits
from adaptive_export.runtimes.bundle import Bundle, load_bundle
from adaptive_export.runtimes.generate import Generator


def prepack_graphs(bundle: Bundle, choice: str) -> list[str] | None:
    """Graph names whose ONNX Runtime sessions prepack their weights (None: the backend's default)."""
    if choice == "auto":
        return None
    if choice == "none":
        return []
    return [name for name, g in bundle.manifest.graphs.items() if choice == "all" or g.kind == "decode"]


def load_generator(options: RunOptions) -> Generator:
    """The bundle's Generator for the engine options (`run`'s and `serve`'s alike)."""
    backend_options: dict[str, Any] = {"threads": limits.check_threads(options.threads)}
    bundle = load_bundle(options.bundle, verify=options.verify)  # loaded (and verified) once
    if options.backend == "onnx":
        backend_options.update(provider=options.provider, prepack=prepack_graphs(bundle, options.prepack))
    return Generator(
        bundle,
        backend=options.backend,
        decode_rows=options.decode_rows,
        draft_bundle=options.draft_bundle,
        verify=options.verify,
        **backend_options,
    )


def cmd_run(options: RunOptions) -> int:
    from adaptive_export.runtimes import SamplingParams

    prompt = options.prompt if options.prompt is not None else read_prompt_file(options.prompt_file)
    sampling = SamplingParams(
        temperature=options.temperature, top_k=options.top_k, top_p=options.top_p, seed=options.seed
    )
    generator = load_generator(options)
    write = None if options.json else (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    result = generator.generate(
        prompt,
        max_new_tokens=options.max_new_tokens,
        sampling=sampling,
        stop=list(options.stop),
        raw=options.raw,
        decoding=options.decoding,
        on_text=write,
    )
    if options.json:
        print(
            json.dumps(
                {
                    "text": result.text,
                    "tokens": result.tokens,
                    "prompt_tokens": len(result.prompt_ids),
                    "stats": result.stats.to_json(),
                }
            )
        )
    else:
        sys.stdout.write("\n")
        s = result.stats
        logging.getLogger("adaptive-export").info(
            "%d tokens, prefill %.1f ms, TPOT %.2f ms, config %s (%d layers skipped%s), mode %s",
            s.new_tokens,
            s.prefill_ms,
            s.tpot_ms,
            s.config,
            s.skipped_layers,
            ", adapted" if s.skip_adapters else "",
            s.mode,
        )
    return EXIT_OK


def cmd_inspect(options: InspectOptions) -> int:
    from adaptive_export.runtimes.bundle_summary import describe, render

    info = describe(options.bundle)
    print(json.dumps(info, indent=2) if options.json else render(info))
    return EXIT_OK


def cmd_bench(options: BenchOptions) -> int:
    from adaptive_export.runtimes.bench import bench_bundle

    bundle = load_bundle(options.bundle)
    rows = bench_bundle(
        bundle,
        options.prompt,
        options.max_new_tokens,
        options.repeat,
        options.decoding,
        limits.check_threads(options.threads),
        prepack_graphs(bundle, options.prepack),
        options.provider,
    )
    if options.json:
        print(json.dumps(rows))
    else:
        for key, value in rows.items():
            print(f"{key:16} {value}")
    return EXIT_OK
