"""`IncrementalDetokenizer`: one request's output token ids -> streamed text, with stop strings.

Owns: turning output tokens into text a few at a time, finding `SamplingParams.stop` strings in that
text (also across token boundaries), and holding back text that is not yet safe to stream.
Does not know: why a request finished (EOS, stop token ids and max_tokens are the scheduler's), how
tokens were sampled, or how text reaches the client.

Algorithm (the prefix/read offset technique). The detokenizer keeps a short window of token ids,

    ids:  ... | prefix_offset ........ read_offset ........ len(ids)
                 already emitted,       not yet emitted
                 kept as context

and after each new token decodes two slices: `prefix = decode(ids[prefix_offset:read_offset])` and
`full = decode(ids[prefix_offset:])`. The new text is `full[len(prefix):]`. Decoding with a little
already-emitted context, rather than each token alone, keeps what decoders do at the start of a
string (a sentencepiece "▁" becoming a space, a first-token strip) from leaking into the middle of
the output. When `full` ends in U+FFFD the last tokens hold an incomplete UTF-8 character (byte-level
BPE, or sentencepiece byte fallback); nothing is emitted and the window grows until the character
completes. Otherwise both offsets move forward, so each update decodes only a few tokens: O(new
tokens), not O(output). The first window starts with the last few prompt tokens, so the first
output token decodes as the continuation of the prompt.

The concatenated text equals `tokenizer.decode(output_ids)`, with two exceptions: a decoder that
strips the first token's leading space (Metaspace with a prepend scheme) keeps it here, because the
output continues the prompt; and an invalid byte-fallback run that follows a valid character decoded
from the same run keeps the valid character here (the HF decoder replaces the whole run with U+FFFD).
"""

from __future__ import annotations

from collections.abc import Sequence

from llmserve.sampling_params import SamplingParams
from llmserve.tokenizer.tokenizer import Tokenizer

# Prompt tokens decoded as context before the first output token.
_NUM_CONTEXT_TOKENS = 5
# Emitted tokens before the window are dropped once there are this many, bounding memory.
_MAX_DEAD_TOKENS = 64
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Detokenizes one request's output incrementally and applies its stop strings."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._backend = tokenizer.backend
        self._skip_special_tokens = params.skip_special_tokens
        # `spaces_between_special_tokens` is not applied: the HF fast decoder has no such option, and
        # the text must match `Tokenizer.decode`.
        self._stop: tuple[str, ...] = tuple(params.stop)
        self._include_stop_str = params.include_stop_str_in_output
        # the longest text that could be the unfinished start of a stop string
        self._num_holdback_chars = max((len(s) for s in self._stop), default=1) - 1

        self.output_text: str = ""
        """The text of all output tokens so far, cut at a matched stop string."""
        self._num_delta_chars = 0  # characters of output_text already returned by delta calls
        self._stopped = False  # a stop string matched: output_text is final

        context = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            # the prompt ends inside a UTF-8 character; slicing by its text length would then
            # swallow the bytes that complete it, so decode the output on its own
            context = []
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool) -> str | None:
        """Append newly sampled tokens; return the stop string they completed, or None.

        `stop_terminated`: the last of `new_token_ids` is the EOS / stop token that ended the request;
        its text is never added, and characters held back waiting for more bytes are flushed.
        Tokens are taken one at a time, so a stop string completed by an early token of the chunk
        ends the text there, exactly as if the tokens had come one per step. A no-op once a stop
        string has matched.
        """
        if self._stopped:
            return None
        ids = new_token_ids[:-1] if stop_terminated else new_token_ids
        for token_id in ids:
            self._ids.append(token_id)
            text = self._decode_new_text(flush=False)
            if text and (stop := self._append(text)) is not None:
                return stop
        return self._flush() if stop_terminated else None

    @property
    def num_tokens(self) -> int:
        """Tokens taken so far (those after a stop string's are never taken)."""
        return len(self._ids)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text safe to stream now.

        While the request runs, the last `max(len(stop)) - 1` characters are held back: they could
        be the start of a stop string, which must never be streamed, even in part. `finished` also
        flushes characters waiting for bytes that will now never come (they decode as U+FFFD).
        `delta`: only the text not returned by an earlier delta call; otherwise all safe text.
        """
        if finished:
            self._flush()
        num_safe_chars = len(self.output_text)
        if not (finished or self._stopped):
            num_safe_chars = max(0, num_safe_chars - self._num_holdback_chars)
        if not delta:
            return self.output_text[:num_safe_chars]
        # a stop string cuts output_text only inside the held-back tail, so this never moves back
        text = self.output_text[self._num_delta_chars : num_safe_chars]
        self._num_delta_chars = max(self._num_delta_chars, num_safe_chars)
        return text

    # ---- internals -------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_new_text(self, flush: bool) -> str:
        """The text the tokens after `read_offset` add, or "" while it ends in an incomplete
        character (unless `flush`); moves the window forward when text is returned."""
        ids = self._ids
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(ids[self._prefix_offset :])
        if not flush and (len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR)):
            # nothing yet (a skipped special token), or a character still missing bytes: keep the
            # tokens in the window and try again with the next one
            return ""
        if full_text.startswith(prefix_text):
            new_text = full_text[len(prefix_text) :]
        else:
            # the decoder re-read emitted text (byte fallback replaces a whole byte run once an
            # invalid byte joins it); what was streamed stands, so decode the new tokens alone
            new_text = self._decode(ids[self._read_offset :])
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        if self._prefix_offset > _MAX_DEAD_TOKENS:
            del ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text

    def _flush(self) -> str | None:
        """Add the text of tokens still held back for missing bytes; the stop string it completes."""
        if self._stopped or self._read_offset == len(self._ids):
            return None
        text = self._decode_new_text(flush=True)
        return self._append(text) if text else None

    def _append(self, text: str) -> str | None:
        """Add `text` to the output and look for a stop string in what it could have completed."""
        # a match must end inside `text` (an earlier one would have stopped us before), so it starts
        # at most `longest stop - 1` characters before it
        search_start = max(0, len(self.output_text) - self._num_holdback_chars)
        self.output_text += text
        if not self._stop:
            return None
        best_index, best_stop = -1, ""
        for stop in self._stop:
            index = self.output_text.find(stop, search_start)
            # the earliest match wins; at the same start the shorter one, which a token-by-token
            # stream would have completed first
            if index >= 0 and (best_index < 0 or (index, len(stop)) < (best_index, len(best_stop))):
                best_index, best_stop = index, stop
        if best_index < 0:
            return None
        cut = best_index + len(best_stop) if self._include_stop_str else best_index
        self.output_text = self.output_text[:cut]
        self._stopped = True
        return best_stop
