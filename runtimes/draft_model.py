"""A smaller bundle drafting for a larger one (issue #37 item 3): `run --draft-bundle DIR`.

The draft bundle (Qwen2.5-Coder-0.5B's for the 1.5B) runs its own engines on its own KV arena and
reads only the target's tokens, never its KV: before each round it catches its arena up with the
tokens the target emitted since (the last draft and the bonus token after a round that accepted
everything, one corrected token otherwise), then writes k drafts with T=1 steps. It reads a
window of the context (the prompt's last DRAFT_WINDOW tokens onward). Its draft source
(runtimes/drafting/draft_model.py) is verified by the target's decode engine over
[pending, d1, .., dk] in one pass (a bonus row: a round emits accepted + 1 tokens), so greedy
output is the target's own; sampling keeps the draft's logits for the rejection rule. The two
bundles must name every token alike (`check_pairing`), else drafts would be other tokens. The
draft arena keeps the rows of the last request too, so a prompt that repeats the last one's
opening (a system prompt) reuses them.

It is a run-time pairing, not a technique a build puts into a bundle: a run-time source (no
manifest field, graph piece or calibration module; runtimes/draft_registry.py lists those). Opt-in because it holds a
second bundle's weights and arena: +41% peak RSS for the 0.5B beside the 1.5B (docs/draft-bundle.md).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from adaptive_export.runtimes.backends import Backend, make_backend
from adaptive_export.runtimes.bundle import Bundle, load_bundle
from adaptive_export.runtimes.drafting.base import Proposal, engine_drafts
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.kv_arena import KVArena
from adaptive_export.runtimes.sampling import Sampler
from adaptive_export.runtimes.text import TextCodec

# At most this many drafts a round, ended early after a draft whose own top-1 probability is below
# DRAFT_STOP_BELOW: the 0.5B for the 1.5B, chat prompts, 2-core Zen 4 (docs/draft-bundle.md): a fixed
# k = 3 took 46.6 ms a token, stopped rounds of up to 4-8 took 41.0-42.7, k = 6 below 0.6 the least.
DRAFT_MODEL_K = 6
DRAFT_STOP_BELOW = 0.6
# The draft prefills at most the last this-many tokens of a prompt: a draft needs no more to guess
# the next few, and the 0.5B's prefill of a 300-token edit prompt cost 10 ms of the 1.5B's TPOT over
# a 64-token answer. Copies from earlier in the prompt are `sure_lookup`'s, the link before it.
DRAFT_WINDOW = 64
MAX_CATCH_UP_ROWS = 64  # a longer catch-up (a new prompt after a shared opening) starts a new window instead
PAIRING_FIX = "pass a draft bundle built from a model with the same tokenizer (Qwen2.5-Coder-0.5B for the 1.5B)"


def check_pairing(target: Bundle, draft: Bundle, target_codec: TextCodec, draft_codec: TextCodec) -> None:
    """Refuse a draft bundle whose tokens are not the target's, id for id."""
    if draft.model.vocab_size != target.model.vocab_size:
        raise UsageError(
            f"the draft bundle's vocabulary has {draft.model.vocab_size} tokens, the target's"
            f" {target.model.vocab_size}",
            PAIRING_FIX,
        )
    if draft_codec.tokenizer.get_vocab(with_added_tokens=True) != target_codec.tokenizer.get_vocab(
        with_added_tokens=True
    ):
        raise UsageError("the draft bundle's tokenizer names its tokens differently from the target's", PAIRING_FIX)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens the two lists share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftModel:
    """The draft bundle's engines and KV arena, and which tokens the arena holds rows for."""

    def __init__(self, bundle: Bundle, backend: Backend) -> None:
        self.bundle, self.backend = bundle, backend
        model = bundle.model
        self.arena = KVArena(
            bundle.num_layers, bundle.max_len, model.num_kv_heads, model.head_dim, layout=backend.kv_layout
        )
        self.decode = bundle.config("full").decode
        self.window = DRAFT_WINDOW
        self.stop_below = DRAFT_STOP_BELOW
        self.skipped: list[int] = []  # the context's tokens before the draft's window: not in its arena
        self.written: list[int] = []  # the tokens whose KV rows the arena holds, from the window's start

    @classmethod
    def load(
        cls,
        directory: str | os.PathLike[str],
        target: Bundle,
        target_codec: TextCodec,
        backend: str,
        verify: str = "full",
        **backend_options: Any,
    ) -> DraftModel:
        """Load and verify the draft bundle like any bundle, check it pairs with the target, create its sessions."""
        bundle = load_bundle(directory, verify=verify)
        check_pairing(target, bundle, target_codec, TextCodec(bundle))
        draft = cls(bundle, make_backend(bundle, backend, **backend_options))
        draft.backend.alternate()  # the target's engines run between the draft's
        draft.backend.prepare("prefill")
        draft.backend.prepare(draft.decode)
        return draft

    def draft(self, context: list[int], k: int, sampler: Sampler) -> Proposal:
        """Up to k tokens after `context` (its last token is the target's pending one): none where
        the draft arena cannot hold them. The tokens the arena lacks run in the first step's pass."""
        view, kept = self._window(context)
        if len(view) + k > self.bundle.max_len:
            return Proposal([])
        start, lead = len(view) - 1, view[kept:-1]
        if kept == 0 and lead:  # a new window: its prefill, then the drafts from the pending token
            self.backend.run("prefill", np.asarray([lead], dtype=np.int64), self.arena, 0)
            lead = []
        proposal = engine_drafts(
            self.backend, self.decode, view[-1], k, start, self.arena, sampler, lead=lead, stop_below=self.stop_below
        )
        self.written = view + proposal.tokens[:-1]  # the last draft is not run: no row of it
        self.arena.length = len(self.written)
        return proposal

    def _window(self, context: list[int]) -> tuple[list[int], int]:
        """The context from the draft's window start and how many of its tokens the arena holds
        (all but the last at most), kept while one short pass catches up; else (a new request) a new
        window of the last `window` tokens, none of them held."""
        skip = len(self.skipped)
        view = context[skip:]
        kept = min(common_prefix(self.written, view), len(view) - 1) if context[:skip] == self.skipped else 0
        if kept == 0 or len(view) - kept > MAX_CATCH_UP_ROWS:
            skip, kept = max(0, len(context) - self.window), 0
            self.skipped, self.written = context[:skip], []
            view = context[skip:]
        return view, kept
