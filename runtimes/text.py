"""Tokenizer, chat formatting and streaming detokenization for the runtime (tokenizers only)."""

from __future__ import annotations

from adaptive_export.runtimes.bundle import Bundle, read_listed
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.limits import MAX_TOKENIZER_BYTES
from adaptive_export.runtimes.tokenizer_policy import TokenizerRules, check_tokenizer_json, tokenizers_guard

_REBUILD = "rebuild the bundle with `adaptive-export build`"


class TextCodec:
    """The bundle's tokenizer.json: checked by runtimes/tokenizer_policy.py before `tokenizers`
    loads it, and every call into `tokenizers` guarded (an error or a Rust panic is bad input)."""

    def __init__(self, bundle: Bundle) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise UsageError("the runtime needs the tokenizers package", "run `pip install tokenizers`") from exc
        info = bundle.manifest.tokenizer
        data = read_listed(bundle, info.file, MAX_TOKENIZER_BYTES)
        check_tokenizer_json(data, TokenizerRules(bundle.model.vocab_size))  # before tokenizers sees it
        with tokenizers_guard(f"loading the bundle's {info.file!r}", _REBUILD):  # an error or a Rust panic
            self.tokenizer = Tokenizer.from_str(data.decode("utf-8"))
            vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        if vocab > bundle.model.vocab_size:
            raise UsageError(
                f"the bundle's tokenizer has {vocab} tokens, more than the model's vocabulary"
                f" of {bundle.model.vocab_size}",
                _REBUILD,
            )
        self.chat = info.chat
        self.eos_ids = set(info.eos_token_ids)
        self.prefix_ids = list(info.prefix_token_ids)

    def encode(self, prompt: str, raw: bool = False) -> list[int]:
        if not isinstance(prompt, str):
            raise UsageError(
                f"the prompt is {type(prompt).__name__}, not text",
                "pass a str (decode bytes first), or a list of token ids",
            )
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError(
                "the prompt holds a lone surrogate, which is not valid Unicode text", "pass valid UTF-8 text"
            ) from None
        if not prompt.strip():
            raise UsageError("the prompt is empty", "pass a non-empty prompt with -p TEXT or --prompt-file FILE")
        text = prompt if raw or not self.chat else self.chat.prefix + prompt + self.chat.suffix
        with tokenizers_guard("encoding the prompt", _REBUILD):
            ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        return self.prefix_ids + ids

    def decode(self, ids: list[int]) -> str:
        with tokenizers_guard("decoding tokens", _REBUILD):
            text: str = self.tokenizer.decode(ids, skip_special_tokens=True)
        return text


class StreamDecoder:
    """Turns generated ids into text deltas, holding back incomplete UTF-8 and stop-string prefixes.

    Detokenization is incremental (constant work per token, not the whole sequence again):
    only the ids since the last complete piece are decoded, with one token of left context so
    that decoders which drop a leading space at the start of a decode (SentencePiece) still
    produce it; the piece is committed once it is not an incomplete UTF-8 sequence.
    """

    def __init__(self, codec: TextCodec, stop: list[str]) -> None:
        self.codec = codec
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.emitted = 0
        self.text = ""
        self.stopped = False
        self.committed = ""  # text of ids[:read]
        self.context = 0  # ids[context:read] are decoded again as left context of the next piece
        self.read = 0

    def _decode_tail(self) -> str:
        prefix = self.codec.decode(self.ids[self.context : self.read])
        window = self.codec.decode(self.ids[self.context :])
        if window.startswith(prefix) and not window.endswith("\ufffd"):
            self.committed += window[len(prefix) :]
            self.context, self.read = self.read, len(self.ids)
            return self.committed
        return self.committed + window[len(prefix) :] if window.startswith(prefix) else self.committed + window

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self._decode_tail()
        for stop in self.stop:
            at = text.find(stop)
            if at >= 0:
                text, self.stopped = text[:at], True
        self.text = text
        if self.stopped:
            return self._take(len(text))
        safe = len(text)
        if text.endswith("\ufffd"):
            safe = len(text.rstrip("\ufffd"))
        for stop in self.stop:  # hold back a tail that might become a stop string
            for size in range(min(len(stop) - 1, safe), 0, -1):
                if text[:safe].endswith(stop[:size]):
                    safe -= size
                    break
        return self._take(safe)

    def flush(self) -> str:
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        delta = self.text[self.emitted : upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return delta
