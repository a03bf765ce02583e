"""Training text for a draft exit, made without any download (calibration/draft_training.py).

Two kinds of documents, each a list of token ids:
- self-written: the model, asked through its own chat template to write a user request about
  a topic in a style (TOPICS x STYLES and, as much, CODE_TOPICS x CODE_STYLES: a coding
  assistant is the typical edge deployment; shuffled with the seed), writes the request; the request
  is then put to it and its greedy answer is the continuation. A draft must predict exactly
  these tokens to be accepted, so they are the text that matters most.
- shipped: docstrings of Python's own standard library (the .py files under
  `sysconfig.get_paths()["stdlib"]`, read with `ast`, never imported), for breadth of English
  and code the self-written answers lack.

Whole documents are held out (every HELD_OUT_EVERY-th of each kind), so no held-out position
shares a document with a training one.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HELD_OUT_EVERY = 5
REQUEST_TOKENS = 40
MIN_DOCSTRING_CHARS = 200
TOPICS = (
    "cooking", "python programming", "world history", "travel planning", "physics", "personal finance",
    "gardening", "music theory", "healthy habits", "algebra", "writing a work email", "football",
    "astronomy", "classic films", "job interviews", "chemistry", "linux shell commands", "poetry",
    "climate", "board games",
)  # fmt: skip
STYLES = (
    "a direct question", "a how-to request", "a request for a very short story", "a request to explain a concept",
    "a request for a list of ideas",
)  # fmt: skip
CODE_TOPICS = (
    "Python lists and dictionaries", "JavaScript promises", "SQL joins", "bash scripting", "git branches",
    "regular expressions", "C pointers", "Rust ownership", "Docker images", "REST APIs", "unit testing",
    "sorting algorithms", "TypeScript types", "Go goroutines", "Java classes", "CSS flexbox",
    "pandas dataframes", "recursion", "exception handling", "Python decorators",
)  # fmt: skip
CODE_STYLES = (
    "a direct question", "a request to write a short function", "a request to explain a concept",
    "a request to compare two approaches", "a how-to request",
)  # fmt: skip


@dataclass(frozen=True)
class Document:
    """Token ids of one document; positions from `answer_start` on are the model's own greedy tokens."""

    ids: tuple[int, ...]
    kind: str  # "self" | "stdlib"
    answer_start: int  # len(ids) for text the model did not write


@dataclass(frozen=True)
class TrainingText:
    train: tuple[Document, ...]
    held_out: tuple[Document, ...]

    def summary(self) -> dict[str, Any]:
        """How many documents and tokens of each kind each split holds (for the report)."""

        def count(docs: tuple[Document, ...], kind: str) -> dict[str, int]:
            own = [d for d in docs if d.kind == kind]
            return {"documents": len(own), "tokens": sum(len(d.ids) for d in own)}

        return {
            split: {kind: count(docs, kind) for kind in ("self", "stdlib")}
            for split, docs in (("train", self.train), ("held_out", self.held_out))
        }


def self_written_requests(loaded: Any, count: int, seed: int, progress: bool = True) -> list[str]:
    """`count` user requests the model writes itself, one per (topic, style) pair, in seeded order."""
    from adaptive_export.calibration.greedy import greedy_sequences

    pairs = [(t, s) for t in TOPICS for s in STYLES] + [(t, s) for t in CODE_TOPICS for s in CODE_STYLES]
    asks = [
        f"Write {style} that a user might send to an AI assistant about {topic}. Reply with the request only."
        for topic, style in pairs
    ]
    random.Random(seed).shuffle(asks)
    requests = []
    for ask, (ids, start) in zip(
        asks[:count], greedy_sequences(loaded, asks[:count], REQUEST_TOKENS, "self-written requests", progress)
    ):
        text = loaded.tokenizer.decode(ids[start:], skip_special_tokens=True).strip().strip('"').strip()
        requests.append(text or ask)
    return requests


def self_written_documents(loaded: Any, requests: list[str], new_tokens: int, progress: bool = True) -> list[Document]:
    """Each request in the chat template, followed by the model's greedy answer."""
    from adaptive_export.calibration.greedy import greedy_sequences

    runs = greedy_sequences(loaded, requests, new_tokens, "self-written answers", progress)
    return [Document(tuple(ids), "self", start) for ids, start in runs]


def stdlib_docstrings(count: int, seed: int) -> list[str]:
    """`count` long docstrings from the standard library's sources, files in seeded order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))
    random.Random(seed).shuffle(files)
    found: list[str] = []
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef))]
        for node in nodes:
            text = ast.get_docstring(node)
            if text and len(text) >= MIN_DOCSTRING_CHARS:
                found.append(text)
                if len(found) >= count:
                    return found
    return found


def stdlib_documents(loaded: Any, count: int, max_tokens: int, seed: int) -> list[Document]:
    docs = []
    for text in stdlib_docstrings(count, seed):
        ids = loaded.tokenizer(text, add_special_tokens=True)["input_ids"][:max_tokens]
        docs.append(Document(tuple(int(t) for t in ids), "stdlib", len(ids)))
    return docs


def training_text(
    loaded: Any, *, requests: int, answer_tokens: int, docstrings: int, seed: int, progress: bool = True
) -> TrainingText:
    """Both kinds of documents, each distinct document once, every HELD_OUT_EVERY-th of each kind held out."""
    own = self_written_documents(
        loaded, self_written_requests(loaded, requests, seed, progress), answer_tokens, progress
    )
    shipped = stdlib_documents(loaded, docstrings, answer_tokens * 2, seed)
    train, held = [], []
    for docs in (own, shipped):
        distinct = list({doc.ids: doc for doc in docs}.values())  # a repeated document would sit in both splits
        for index, doc in enumerate(distinct):
            (held if index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).append(doc)
    return TrainingText(tuple(train), tuple(held))
