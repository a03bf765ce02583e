"""tokenizer.json is hostile input: every section is checked here before `tokenizers` sees it.

`tokenizers` trusts its file: a garbage `Precompiled` charsmap or a truncation stride >= its
max length panics in Rust, and fixed padding of 1e9, chains of growing Replace steps,
WordPiece over a long word or millions of duplicate merges take minutes and gigabytes.
So the runtime (runtimes/text.py) and the build (exporter/tokenizer_export.py) parse the
file with the json module (bounded size, item count and nesting), check each section
against an allow-list of the component types real tokenizers use and the bounds in
runtimes/limits.py, and only then hand the same text to `tokenizers`, inside
`tokenizers_guard`, which turns a Rust panic into a UsageError. docs/hardening.md.
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import re
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from adaptive_export.runtimes import limits
from adaptive_export.runtimes.bundle import parse_manifest
from adaptive_export.runtimes.errors import UsageError

TOP_LEVEL_KEYS = frozenset(
    {"version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer", "post_processor", "decoder"}
    | {"model"}
)
SPLIT_BEHAVIORS = ("Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous")


@dataclass(frozen=True)
class TokenizerRules:
    """The bounds one tokenizer.json is held to: the model's vocabulary and the fix to print."""

    vocab_size: int
    fix: str = "rebuild the bundle with `adaptive-export build` from a model you trust"

    def refuse(self, section: str, problem: str) -> UsageError:
        return UsageError(f"tokenizer.json {section}: {problem}", self.fix)

    def need(self, condition: bool, section: str, problem: str) -> None:
        if not condition:
            raise self.refuse(section, problem)


# ---- Rust panics ----------------------------------------------------------------------------
def is_rust_panic(exc: BaseException) -> bool:
    """pyo3's PanicException derives from BaseException, so `except Exception` misses it."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        return False
    return any(cls.__name__ == "PanicException" for cls in type(exc).__mro__)


@contextmanager
def tokenizers_guard(what: str, fix: str) -> Iterator[None]:
    """Every call into `tokenizers` runs inside this: an error or a Rust panic is bad input."""
    try:
        with rust_stderr_quiet():
            yield
    except UsageError:
        raise
    except BaseException as exc:
        if not isinstance(exc, Exception) and not is_rust_panic(exc):
            raise  # KeyboardInterrupt, SystemExit
        text = (str(exc).strip().splitlines() or [""])[0][:200]
        kind = "panicked" if is_rust_panic(exc) else "failed"
        raise UsageError(f"the tokenizer {kind} while {what}: {text or type(exc).__name__}", fix) from None


_devnull_fd: list[int] = []  # opened once, on the first call
_FD2_LOCK = threading.RLock()  # held while fd 2 is redirected (rust_stderr_quiet)


@contextmanager
def rust_stderr_quiet(keep_output: bool = False) -> Iterator[None]:
    """Rust's panic hook writes its message (and backtrace) straight to file descriptor 2, which
    would break the one-line error rule, so fd 2 is redirected for the call: to /dev/null for the
    runtime's calls (`tokenizers` writes nothing else there), or with keep_output to a temporary
    file replayed afterwards unless the call panicked (transformers' warnings at build).

    fd 2 is one per process, so the save, the redirect and the restore happen under one lock held
    for the whole call: two threads that interleaved them (A saves fd 2, B saves A's /dev/null, A
    restores, B restores /dev/null) left fd 2 pointing at /dev/null for the rest of the process.
    Reentrant: a quieted call may quiet again on its own thread."""
    with _FD2_LOCK, _redirected_stderr(keep_output):
        yield


@contextmanager
def _redirected_stderr(keep_output: bool) -> Iterator[None]:
    """rust_stderr_quiet's redirect, without the lock."""
    try:
        sys.stderr.flush()
        target = tempfile.TemporaryFile() if keep_output else None
        if target is None and not _devnull_fd:
            _devnull_fd.append(os.open(os.devnull, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)))
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no fd 2 (a closed or replaced stderr): nothing to quiet
        yield
        return
    panicked = False
    try:
        os.dup2(target.fileno() if target is not None else _devnull_fd[0], 2)
        yield
    except BaseException as exc:
        panicked = is_rust_panic(exc)
        raise
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if target is not None:
            target.seek(0)
            if not panicked:
                os.write(2, target.read())
            target.close()


def check_tokenizer_file(path: Path, rules: TokenizerRules) -> None:
    """A model's tokenizer.json, checked before transformers parses it (build). Resolved first:
    a Hugging Face cache snapshot links its files to blobs, and the user chose the model."""
    data = limits.read_regular(path.resolve(), "the model's tokenizer.json", limits.MAX_TOKENIZER_JSON_BYTES)
    check_tokenizer_json(data, rules)


# ---- the whole file -------------------------------------------------------------------------
def check_tokenizer_json(data: bytes, rules: TokenizerRules) -> None:
    """Refuse a tokenizer.json the runtime must not hand to `tokenizers` (one section, one rule)."""
    rules.need(
        len(data) <= limits.MAX_TOKENIZER_JSON_BYTES,
        "file",
        f"{len(data)} bytes, more than the {limits.MAX_TOKENIZER_JSON_BYTES} allowed",
    )
    max_items = min(limits.MAX_TOKENIZER_JSON_ITEMS, limits.TOKENIZER_ITEMS_PER_TOKEN * rules.vocab_size + (1 << 16))
    items = data.count(b",")
    rules.need(items <= max_items, "file", f"{items} JSON items, more than the {max_items} allowed for this vocabulary")
    try:
        doc = parse_manifest(data, "tokenizer.json")
    except UsageError as exc:
        raise UsageError(exc.problem, rules.fix) from None
    rules.need(isinstance(doc, dict), "file", "the top level is not a JSON object")
    unknown = sorted(set(doc) - TOP_LEVEL_KEYS)
    rules.need(not unknown, "file", f"unknown sections {unknown[:4]}")
    rules.need("model" in doc, "file", "there is no model section")
    check_truncation(doc.get("truncation"), rules)
    check_padding(doc.get("padding"), rules)
    check_added_tokens(doc.get("added_tokens", []), rules)
    for section, kinds in COMPONENTS.items():
        check_component(doc.get(section), section, kinds, rules)
    check_model(doc["model"], rules)


def check_truncation(value: Any, rules: TokenizerRules) -> None:
    """Null, or a max length within the KV bound and a stride below it (stride >= max panics)."""
    if value is None:
        return
    section = "truncation"
    _fields(value, {"direction", "max_length", "strategy", "stride"}, section, rules)
    max_length = value.get("max_length")
    rules.need(_int_in(max_length, 1, limits.MAX_LEN), section, f"max_length must be in 1..{limits.MAX_LEN}")
    rules.need(_int_in(value.get("stride", 0), 0, max_length - 1), section, "stride must be below max_length")
    rules.need(
        value.get("strategy", "LongestFirst") in ("LongestFirst", "OnlyFirst", "OnlySecond"),
        section,
        "unknown strategy",
    )
    rules.need(value.get("direction", "Right") in ("Left", "Right"), section, "direction must be Left or Right")


def check_padding(value: Any, rules: TokenizerRules) -> None:
    """Null, or BatchLongest (no effect on one prompt); Fixed padding would pad every prompt."""
    if value is None:
        return
    section = "padding"
    keys = {"strategy", "direction", "pad_to_multiple_of", "pad_id", "pad_type_id", "pad_token"}
    _fields(value, keys, section, rules)
    rules.need(value.get("strategy") == "BatchLongest", section, "only BatchLongest is allowed (Fixed is refused)")
    multiple = value.get("pad_to_multiple_of")
    rules.need(
        multiple is None or _int_in(multiple, 1, limits.MAX_PAD_MULTIPLE),
        section,
        f"pad_to_multiple_of must be null or 1..{limits.MAX_PAD_MULTIPLE}",
    )
    rules.need(_int_in(value.get("pad_id", 0), 0, rules.vocab_size - 1), section, "pad_id is outside the vocabulary")
    rules.need(_int_in(value.get("pad_type_id", 0), 0, 255), section, "pad_type_id must be in 0..255")
    rules.need(_short_str(value.get("pad_token", ""), limits.MAX_TOKEN_CHARS), section, "bad pad_token")
    rules.need(value.get("direction", "Right") in ("Left", "Right"), section, "direction must be Left or Right")


def check_added_tokens(value: Any, rules: TokenizerRules) -> None:
    """At most MAX_ADDED_TOKENS (and the vocabulary), each a short string with an id in the vocabulary."""
    section = "added_tokens"
    bound = min(limits.MAX_ADDED_TOKENS, rules.vocab_size)
    rules.need(isinstance(value, list) and len(value) <= bound, section, f"must be a list of at most {bound} tokens")
    flags = {"single_word", "lstrip", "rstrip", "normalized", "special"}
    ids = set()
    for token in value:
        _fields(token, {"id", "content"} | flags, section, rules)
        rules.need(_int_in(token.get("id"), 0, rules.vocab_size - 1), section, "a token id is outside the vocabulary")
        rules.need(
            _short_str(token.get("content"), limits.MAX_TOKEN_CHARS, 1),
            section,
            f"a token's content must be 1..{limits.MAX_TOKEN_CHARS} characters",
        )
        rules.need(all(isinstance(token.get(f, False), bool) for f in flags), section, "a token flag is not a bool")
        ids.add(token["id"])
    rules.need(len(ids) == len(value), section, "two added tokens share an id")


# ---- normalizer, pre-tokenizer, post-processor, decoder ---------------------------------------
FieldCheck = Callable[[Any], bool]


def _bool(value: Any) -> bool:
    return isinstance(value, bool)


def _opt_bool(value: Any) -> bool:
    return value is None or isinstance(value, bool)


def _affix(value: object) -> TypeGuard[str]:
    return _short_str(value, limits.MAX_TOKENIZER_AFFIX_CHARS)


def _char(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 1


def _choice(*allowed: str) -> FieldCheck:
    return lambda value: value in allowed


def _small_int(value: Any) -> bool:
    return _int_in(value, 0, limits.MAX_TOKENIZER_AFFIX_CHARS)


def _token_and_id(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and _affix(value[0]) and _int_in(value[1], 0, limits.MAX_VOCAB)


_BYTE_LEVEL: dict[str, FieldCheck] = {"add_prefix_space": _bool, "trim_offsets": _bool, "use_regex": _bool}
_METASPACE: dict[str, FieldCheck] = {
    "replacement": _char,
    "prepend_scheme": _choice("always", "never", "first"),
    "split": _bool,
    "add_prefix_space": _bool,
    "str_rep": _affix,
}
# type -> {field: check}; "pattern", "content", sequences, charsmap and templates have their own rules
NORMALIZERS: dict[str, dict[str, FieldCheck]] = {
    "BertNormalizer": {
        "clean_text": _bool,
        "handle_chinese_chars": _bool,
        "strip_accents": _opt_bool,
        "lowercase": _bool,
    },
    "Strip": {"strip_left": _bool, "strip_right": _bool},
    **{name: {} for name in ("StripAccents", "NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Nmt", "ByteLevel")},
    "Replace": {"pattern": lambda _: True, "content": _affix},
    "Prepend": {"prepend": _affix},
    "Precompiled": {"precompiled_charsmap": lambda _: True},
    "Sequence": {"normalizers": lambda _: True},
}
PRE_TOKENIZERS: dict[str, dict[str, FieldCheck]] = {
    **{name: {} for name in ("BertPreTokenizer", "Whitespace", "WhitespaceSplit", "UnicodeScripts")},
    "ByteLevel": _BYTE_LEVEL,
    "Metaspace": _METASPACE,
    "CharDelimiterSplit": {"delimiter": _char},
    "Split": {"pattern": lambda _: True, "behavior": _choice(*SPLIT_BEHAVIORS), "invert": _bool},
    "Punctuation": {"behavior": _choice(*SPLIT_BEHAVIORS)},
    "Digits": {"individual_digits": _bool},
    "Sequence": {"pretokenizers": lambda _: True},
}
POST_PROCESSORS: dict[str, dict[str, FieldCheck]] = {
    "TemplateProcessing": {"single": lambda _: True, "pair": lambda _: True, "special_tokens": lambda _: True},
    "ByteLevel": _BYTE_LEVEL,
    "RobertaProcessing": {"sep": _token_and_id, "cls": _token_and_id, "trim_offsets": _bool, "add_prefix_space": _bool},
    "BertProcessing": {"sep": _token_and_id, "cls": _token_and_id},
    "Sequence": {"processors": lambda _: True},
}
DECODERS: dict[str, dict[str, FieldCheck]] = {
    "ByteLevel": _BYTE_LEVEL,
    "Metaspace": _METASPACE,
    "WordPiece": {"prefix": _affix, "cleanup": _bool},
    "BPEDecoder": {"suffix": _affix},
    "CTC": {"pad_token": _affix, "word_delimiter_token": _affix, "cleanup": _bool},
    "Replace": {"pattern": lambda _: True, "content": _affix},
    "Fuse": {},
    "ByteFallback": {},
    "Strip": {"content": _char, "start": _small_int, "stop": _small_int},
    "Sequence": {"decoders": lambda _: True},
}
COMPONENTS = {
    "normalizer": NORMALIZERS,
    "pre_tokenizer": PRE_TOKENIZERS,
    "post_processor": POST_PROCESSORS,
    "decoder": DECODERS,
}
SEQUENCE_KEYS = {"normalizer": "normalizers", "pre_tokenizer": "pretokenizers", "post_processor": "processors"}


def check_component(value: Any, section: str, kinds: dict[str, dict[str, FieldCheck]], rules: TokenizerRules) -> None:
    """Null or a tree of allowed steps: at most MAX_TOKENIZER_STEPS nodes, MAX_TOKENIZER_NESTING deep,
    and (normalizer, decoder) lengthening text at most MAX_TEXT_GROWTH times along the chain."""
    if value is None:
        return
    steps = list(_walk(value, section, kinds, rules, depth=1))
    rules.need(
        len(steps) <= limits.MAX_TOKENIZER_STEPS,
        section,
        f"{len(steps)} steps, more than the {limits.MAX_TOKENIZER_STEPS} allowed",
    )
    growth = math.prod(_growth(step, section, rules) for step in steps)
    rules.need(
        growth <= limits.MAX_TEXT_GROWTH,
        section,
        f"its Replace steps may lengthen text {growth} times, more than the {limits.MAX_TEXT_GROWTH} allowed",
    )
    for step in steps:
        _check_step_details(step, section, rules)


def _walk(
    node: Any, section: str, kinds: dict[str, dict[str, FieldCheck]], rules: TokenizerRules, depth: int
) -> Iterator[Mapping[str, object]]:
    """Yield every step of the tree after checking its type and plain fields."""
    rules.need(depth <= limits.MAX_TOKENIZER_NESTING, section, f"nested deeper than {limits.MAX_TOKENIZER_NESTING}")
    rules.need(isinstance(node, dict), section, "a step is not a JSON object")
    kind = node.get("type")
    rules.need(isinstance(kind, str) and kind in kinds, section, f"type {str(kind)[:40]!r} is not allowed")
    checks = kinds[kind]
    _fields(node, set(checks) | {"type"}, f"{section} {kind}", rules)
    for field, value in node.items():
        if field != "type":
            rules.need(checks[field](value), f"{section} {kind}", f"bad value for {field!r}")
    yield node
    if kind == "Sequence":
        children = node.get(SEQUENCE_KEYS.get(section, "decoders"))
        rules.need(
            isinstance(children, list) and len(children) <= limits.MAX_TOKENIZER_STEPS,
            f"{section} Sequence",
            f"must list at most {limits.MAX_TOKENIZER_STEPS} steps",
        )
        for child in children:
            yield from _walk(child, section, kinds, rules, depth + 1)


def _growth(step: Mapping[str, object], section: str, rules: TokenizerRules) -> int:
    """How many times one step may lengthen text: a Replace of a string by a longer content,
    or of a regex that may match the empty string between every two characters."""
    if step["type"] != "Replace":
        return 1
    pattern = _pattern(step.get("pattern"), f"{section} Replace", rules)
    content = str(step.get("content", ""))  # a short string: _walk checked it (_affix)
    if "String" in pattern:
        rules.need(len(pattern["String"]) >= 1, f"{section} Replace", "the pattern is empty")
        return max(1, -(-len(content) // len(pattern["String"])))
    return len(content) + 1


def _check_step_details(step: Mapping[str, object], section: str, rules: TokenizerRules) -> None:
    kind = step["type"]
    where = f"{section} {kind}"
    if kind in ("Replace", "Split"):
        _pattern(step.get("pattern"), where, rules)
    elif kind == "Precompiled":
        check_charsmap(step.get("precompiled_charsmap"), where, rules)
    elif kind == "TemplateProcessing":
        check_template(step, where, rules)


def _pattern(value: Any, where: str, rules: TokenizerRules) -> dict[str, str]:
    """{"String": s} or {"Regex": r}: bounded length; a regex without backreferences or nested
    quantifiers (Oniguruma backtracks exponentially on `(a+)+`)."""
    rules.need(
        isinstance(value, dict) and len(value) == 1 and set(value) <= {"String", "Regex"},
        where,
        'the pattern must be {"String": ...} or {"Regex": ...}',
    )
    text = next(iter(value.values()))
    rules.need(
        _short_str(text, limits.MAX_TOKENIZER_PATTERN_CHARS),
        where,
        f"the pattern must be text of at most {limits.MAX_TOKENIZER_PATTERN_CHARS} characters",
    )
    if "Regex" in value:
        problem = regex_problem(text)
        rules.need(problem is None, where, f"the regex {text[:40]!r} {problem}")
    return value


_BACKREFERENCE = re.compile(r"\\(?:[1-9]|k<|k'|g<|g')")
_QUANTIFIER = re.compile(r"[*+]|\{\d*,")


def regex_problem(pattern: str) -> str | None:
    """Why Oniguruma might backtrack without bound on this regex, or None. A repeated group
    that holds a repetition or an alternation (`(a+)+`, `(a|aa)*`) is refused, as are
    backreferences and subexpression calls. Bracket expressions are skipped: their `*+|` are literal."""
    if _BACKREFERENCE.search(pattern):
        return "uses a backreference or subexpression call"
    stack: list[bool] = [False]  # per open group: does it hold a repetition or an alternation?
    index = 0
    while index < len(pattern):
        char = pattern[index]
        if char == "\\":
            index += 2
            continue
        if char == "[":
            index = _skip_bracket(pattern, index)
            continue
        if char == "(":
            stack.append(False)
        elif char == ")" and len(stack) > 1:
            inner = stack.pop()
            if inner and _QUANTIFIER.match(pattern, index + 1):
                return "repeats a group that holds a repetition or an alternation (exponential backtracking)"
            stack[-1] = stack[-1] or inner or _QUANTIFIER.match(pattern, index + 1) is not None
        elif _QUANTIFIER.match(pattern, index) or (char == "|" and len(stack) > 1):
            stack[-1] = True
        index += 1
    return None


def _skip_bracket(pattern: str, start: int) -> int:
    """Index after the bracket expression opening at start (nested brackets counted)."""
    depth, index = 0, start
    while index < len(pattern):
        char = pattern[index]
        if char == "\\":
            index += 2
            continue
        depth += {"[": 1, "]": -1}.get(char, 0)
        index += 1
        if depth == 0:
            return index
    return index


def check_charsmap(value: Any, where: str, rules: TokenizerRules) -> None:
    """A SentencePiece charsmap: bounded base64 of [u32 trie size][trie][normalized strings]."""
    rules.need(
        _short_str(value, limits.MAX_PRECOMPILED_CHARSMAP_CHARS, 8),
        where,
        f"precompiled_charsmap must be base64 text of at most {limits.MAX_PRECOMPILED_CHARSMAP_CHARS} characters",
    )
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise rules.refuse(where, "precompiled_charsmap is not base64") from None
    trie = int.from_bytes(raw[:4], "little") if len(raw) >= 4 else -1
    rules.need(
        0 < trie <= len(raw) - 4 and trie % 4 == 0,
        where,
        "precompiled_charsmap's trie size does not fit the charsmap",
    )


def check_template(step: Mapping[str, object], where: str, rules: TokenizerRules) -> None:
    """single / pair: at most MAX_TEMPLATE_PIECES pieces; special_tokens: ids in the vocabulary."""
    for key in ("single", "pair"):
        pieces = step.get(key, [])
        rules.need(
            isinstance(pieces, list) and len(pieces) <= limits.MAX_TEMPLATE_PIECES and all(map(_piece_ok, pieces)),
            where,
            f"{key} must be at most {limits.MAX_TEMPLATE_PIECES} Sequence / SpecialToken pieces",
        )
    specials = step.get("special_tokens", {})
    if not (isinstance(specials, dict) and len(specials) <= limits.MAX_TEMPLATE_PIECES):
        raise rules.refuse(where, f"special_tokens must map at most {limits.MAX_TEMPLATE_PIECES} tokens")
    for name, special in specials.items():
        _fields(special, {"id", "ids", "tokens"}, where, rules)
        ids, tokens = special.get("ids"), special.get("tokens")
        rules.need(
            special.get("id") == name
            and isinstance(ids, list)
            and isinstance(tokens, list)
            and 0 < len(ids) == len(tokens) <= limits.MAX_TEMPLATE_PIECES
            and all(_int_in(i, 0, rules.vocab_size - 1) for i in ids)
            and all(_short_str(t, limits.MAX_TOKEN_CHARS, 1) for t in tokens),
            where,
            f"special token {name[:40]!r} must list ids in the vocabulary and as many tokens",
        )


def _piece_ok(piece: Any) -> bool:
    if not isinstance(piece, dict) or len(piece) != 1:
        return False
    kind, body = next(iter(piece.items()))
    if kind not in ("Sequence", "SpecialToken") or not isinstance(body, dict) or set(body) != {"id", "type_id"}:
        return False
    allowed_id = body["id"] in ("A", "B") if kind == "Sequence" else _short_str(body["id"], limits.MAX_TOKEN_CHARS, 1)
    return allowed_id and _int_in(body["type_id"], 0, 255)


# ---- the model ----------------------------------------------------------------------------------
def check_model(model: Any, rules: TokenizerRules) -> None:
    """BPE, WordPiece, WordLevel or Unigram, with at most the model's vocabulary."""
    section = "model"
    rules.need(isinstance(model, dict), section, "is not a JSON object")
    kind = model.get("type")
    models: dict[str, Callable[[Mapping[str, object], TokenizerRules], None]] = {
        "BPE": _check_bpe,
        "WordPiece": _check_wordpiece,
        "WordLevel": _check_wordlevel,
        "Unigram": _check_unigram,
    }
    rules.need(isinstance(kind, str) and kind in models, section, f"type {str(kind)[:40]!r} is not allowed")
    models[kind](model, rules)


def _check_bpe(model: Mapping[str, object], rules: TokenizerRules) -> None:
    where = "model BPE"
    keys = {"dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk", "byte_fallback"}
    _fields(model, keys | {"type", "ignore_merges", "vocab", "merges"}, where, rules)
    dropout = model.get("dropout")
    rules.need(dropout is None or (_is_number(dropout) and 0 <= dropout <= 1), where, "dropout must be null or 0..1")
    for key in ("unk_token", "continuing_subword_prefix", "end_of_word_suffix"):
        rules.need(model.get(key) is None or _affix(model[key]), where, f"bad {key}")
    for key in ("fuse_unk", "byte_fallback", "ignore_merges"):
        rules.need(isinstance(model.get(key, False), bool), where, f"{key} is not a bool")
    _check_vocab_map(model.get("vocab"), where, rules)
    _check_merges(model.get("merges"), where, rules)


def _check_merges(merges: Any, where: str, rules: TokenizerRules) -> None:
    """At most MAX_MERGES_PER_TOKEN per vocabulary entry, each two short parts, none twice."""
    bound = limits.MAX_MERGES_PER_TOKEN * rules.vocab_size
    rules.need(isinstance(merges, list) and len(merges) <= bound, where, f"merges must be a list of at most {bound}")
    pairs = {_merge_pair(merge) for merge in merges}  # a flat loop: Gemma 3 has 514,906 merges
    rules.need(None not in pairs, where, f"a merge must be two tokens of 1..{limits.MAX_TOKEN_CHARS} characters")
    rules.need(len(pairs) == len(merges), where, f"{len(merges) - len(pairs)} merges appear more than once")


def _merge_pair(merge: Any) -> tuple[str, str] | None:
    """("a", "b") from "a b" or ["a", "b"]; None unless two strings of 1..MAX_TOKEN_CHARS."""
    parts = merge.split(" ") if type(merge) is str else merge
    if type(parts) is not list or len(parts) != 2:
        return None
    first, second = parts
    if type(first) is not str or type(second) is not str:
        return None
    if not (0 < len(first) <= limits.MAX_TOKEN_CHARS and 0 < len(second) <= limits.MAX_TOKEN_CHARS):
        return None
    return first, second


def _check_vocab_map(vocab: Any, where: str, rules: TokenizerRules) -> None:
    """token -> id: at most the model's vocabulary, short tokens, distinct ids inside it."""
    rules.need(
        isinstance(vocab, dict) and len(vocab) <= rules.vocab_size,
        where,
        f"vocab must map at most the model's {rules.vocab_size} tokens",
    )
    rules.need(
        all(len(token) <= limits.MAX_TOKEN_CHARS for token in vocab),
        where,
        f"a vocab token is longer than {limits.MAX_TOKEN_CHARS} characters",
    )
    ids = set(vocab.values())
    rules.need(
        len(ids) == len(vocab) and all(_int_in(i, 0, rules.vocab_size - 1) for i in ids),
        where,
        "vocab ids must be distinct and inside the model's vocabulary",
    )


def _check_wordpiece(model: Mapping[str, object], rules: TokenizerRules) -> None:
    where = "model WordPiece"
    _fields(
        model, {"type", "unk_token", "continuing_subword_prefix", "max_input_chars_per_word", "vocab"}, where, rules
    )
    rules.need(_affix(model.get("unk_token")), where, "bad unk_token")
    rules.need(_affix(model.get("continuing_subword_prefix", "##")), where, "bad continuing_subword_prefix")
    rules.need(
        _int_in(model.get("max_input_chars_per_word", 100), 1, limits.MAX_WORDPIECE_WORD_CHARS),
        where,
        f"max_input_chars_per_word must be in 1..{limits.MAX_WORDPIECE_WORD_CHARS} (matching is quadratic in it)",
    )
    _check_vocab_map(model.get("vocab"), where, rules)


def _check_wordlevel(model: Mapping[str, object], rules: TokenizerRules) -> None:
    where = "model WordLevel"
    _fields(model, {"type", "vocab", "unk_token"}, where, rules)
    rules.need(_affix(model.get("unk_token")), where, "bad unk_token")
    _check_vocab_map(model.get("vocab"), where, rules)


def _check_unigram(model: Mapping[str, object], rules: TokenizerRules) -> None:
    where = "model Unigram"
    _fields(model, {"type", "unk_id", "vocab", "byte_fallback"}, where, rules)
    vocab: Any = model.get("vocab")
    rules.need(
        isinstance(vocab, list) and 0 < len(vocab) <= rules.vocab_size,
        where,
        f"vocab must list 1..{rules.vocab_size} pieces",
    )
    rules.need(
        all(
            isinstance(entry, list)
            and len(entry) == 2
            and _short_str(entry[0], limits.MAX_TOKEN_CHARS)
            and _is_number(entry[1])
            for entry in vocab
        ),
        where,
        f"each piece must be [text of at most {limits.MAX_TOKEN_CHARS} characters, finite score]",
    )
    unk = model.get("unk_id")
    rules.need(unk is None or _int_in(unk, 0, len(vocab) - 1), where, "unk_id is outside the vocab")
    rules.need(isinstance(model.get("byte_fallback", False), bool), where, "byte_fallback is not a bool")


# ---- typed helpers ------------------------------------------------------------------------------
def _fields(value: Any, allowed: set[str], where: str, rules: TokenizerRules) -> None:
    rules.need(isinstance(value, dict), where, "is not a JSON object")
    unknown = sorted(set(value) - allowed)
    rules.need(not unknown, where, f"unknown fields {[str(k)[:40] for k in unknown[:4]]}")


def _int_in(value: object, low: int, high: int) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _short_str(value: object, max_chars: int, min_chars: int = 0) -> TypeGuard[str]:
    return isinstance(value, str) and min_chars <= len(value) <= max_chars
