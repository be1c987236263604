"""Word spans of a prompt, for `pooling="span"`: selection that keeps a number or word whole (issue 30, item 4).

Both real models spend one token per digit, so the papers' centred kernel of 7 (±3 tokens around an attention
peak) cuts a 7-digit needle. Span pooling pools as the kernel does, then raises every token of a word to the
highest pooled score in that word, so a word the pooled window touches ranks as one: kept whole, or cut only
where the budget ends inside it.

A word is what whitespace delimits: a token starts one when its text starts with whitespace (or the tokenizer's
space/newline marker: byte-level BPE's `Ġ`/`Ċ`, SentencePiece's `▁`), when it is a special token, or when it
follows a special token (chat-template tokens such as `<|im_start|>user` are not one word). A word longer than
`MAX_SPAN` tokens is cut every `MAX_SPAN` tokens, so a long run without spaces (code, base64) cannot spend the
budget. The prompt's token ids reach the cache through a forward pre-hook on the model's input embeddings (the
only place a `Cache` can see them); decoded tokens are words of their own.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core.policy import PolicyError

MAX_SPAN = 32  # a UUID is 20-30 tokens in both models; prose words are 1-4
_WORD_MARKERS = ("Ġ", "Ċ", "ĉ", "▁")  # byte-level BPE's space, newline and tab; SentencePiece's space
_tables: dict[tuple, WordTable] = {}
_tables_by_folder: dict[str, WordTable] = {}


@dataclasses.dataclass(frozen=True)
class WordTable:
    """Per vocabulary entry: `starts` a word (text led by whitespace or a marker, or special); is `special`."""

    starts: torch.Tensor
    special: torch.Tensor

    @classmethod
    def of(cls, tokenizer) -> WordTable:
        key = (tokenizer.name_or_path, len(tokenizer), type(tokenizer).__name__)
        if key not in _tables:
            texts = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
            special = torch.zeros(len(texts), dtype=torch.bool)
            special[[i for i in tokenizer.all_special_ids if i < len(texts)]] = True
            starts = torch.tensor([bool(text) and (text[0] in _WORD_MARKERS or text[0].isspace()) for text in texts])
            _tables[key] = cls(starts | special, special)
        return _tables[key]

    def spans(self, token_ids: torch.Tensor, max_span: int = MAX_SPAN) -> torch.Tensor:
        """(B, L) word index of each token of `token_ids` (B, L), from 0 in each row; words of more than `max_span`
        tokens are cut every `max_span` tokens."""
        if int(token_ids.max()) >= len(self.starts) or int(token_ids.min()) < 0:
            raise PolicyError(
                f"pooling='span': the prompt holds token ids outside the tokenizer's {len(self.starts)} entries"
            )
        starts = self.starts.to(token_ids.device)[token_ids]
        starts[:, 1:] |= self.special.to(token_ids.device)[token_ids[:, :-1]]
        starts[:, 0] = True
        positions = torch.arange(token_ids.shape[1], device=token_ids.device).expand_as(token_ids)
        word_start = torch.where(starts, positions, torch.zeros_like(positions)).cummax(dim=1).values
        starts |= (positions - word_start) % max_span == 0
        return starts.long().cumsum(dim=1) - 1


def word_table_for(config, tokenizer=None) -> WordTable:
    """The word table of `tokenizer`, or of the tokenizer saved beside the model (`config._name_or_path`; loaded
    once per folder, since every cache of a generation asks)."""
    if tokenizer is not None:
        return WordTable.of(tokenizer)
    path = getattr(config, "_name_or_path", "") or ""
    if path not in _tables_by_folder:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError) as error:
            raise PolicyError(
                f"pooling='span' needs the model's tokenizer, and none loads from {path!r} "
                f"({type(error).__name__}); pass it (PolicyCache(policy, model, tokenizer=tokenizer)) or choose "
                "pooling='centered'"
            ) from None
        _tables_by_folder[path] = WordTable.of(tokenizer)
    return _tables_by_folder[path]


class PromptTokenWatch:
    """Catches the token ids of a model's next forward pass: a pre-hook on the input embeddings records them, one on
    the model forgets the last pass's (so a pass given `inputs_embeds` finds none). `close()` removes both."""

    def __init__(self, model):
        self.ids: torch.Tensor | None = None
        self._handles = [
            model.register_forward_pre_hook(self._forget),
            model.get_input_embeddings().register_forward_pre_hook(self._record),
        ]

    def _forget(self, module, args) -> None:
        self.ids = None

    def _record(self, module, args) -> None:
        self.ids = args[0] if args else None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
