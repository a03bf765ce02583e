"""A new draft source is one class and one registration (runtimes/drafting/base.py
`register_source`): this file adds one, touching no runtime file, and runs it chained after
prompt lookup (`--draft prompt_lookup,repeat_ngram`) on a real bundle: exact, and drafting."""

from __future__ import annotations

from adaptive_export.runtimes import Generator
from adaptive_export.runtimes.backends import StepOutputs
from adaptive_export.runtimes.drafting import DraftSource, Proposal, register_source
from adaptive_export.runtimes.drafting.base import decode_engine_verify
from adaptive_export.runtimes.kv_arena import KVArena
from adaptive_export.runtimes.sampling import Sampler


@register_source
class RepeatNgram(DraftSource):
    """Repeat the context's last two tokens: a draft prompt lookup never makes on a fresh bigram."""

    name = "repeat_ngram"
    bonus = True

    def propose(
        self, pending: int, context: list[int], k: int, start: int, arena: KVArena, sampler: Sampler
    ) -> Proposal:
        tail = context[-2:]
        return Proposal((tail * k)[:k])

    def verify(self, pending: int, proposal: Proposal, start: int, arena: KVArena) -> StepOutputs:
        return decode_engine_verify(self.backend, self.config, pending, proposal.tokens, start, arena)


def test_a_source_from_this_file_runs_chained_after_prompt_lookup(tiny_bundle) -> None:
    gen = Generator(tiny_bundle)
    prompt = [3, 9, 14, 27, 31]  # no n-gram repeats: prompt lookup has nothing at first
    plain = gen.generate(prompt, max_new_tokens=24, mode="ar")
    chained = gen.generate(prompt, max_new_tokens=24, mode="spec", draft="prompt_lookup,repeat_ngram", draft_len=2)
    assert chained.tokens == plain.tokens
    spec = chained.stats.speculation
    assert spec["draft_source"] == "prompt_lookup,repeat_ngram"
    by_source = spec["rounds_by_source"]
    assert by_source.get("repeat_ngram", {}).get("rounds", 0) >= 1, spec
    assert sum(t["rounds"] for t in by_source.values()) <= spec["rounds"]
