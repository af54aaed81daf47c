"""Shared fixtures for the data tests: a tiny in-memory tokenizer (no download needed)."""

from __future__ import annotations

import pytest

WORDS = [chr(c) for c in range(ord("a"), ord("z") + 1)]


@pytest.fixture(scope="session")
def word_tokenizer():
    """A real fast tokenizer over single letters: [PAD]=0, [UNK]=1, [EOS]=2, [CLS]=3, [SEP]=4, a=5, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[EOS]", "[CLS]", "[SEP]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 3), ("[SEP]", 4)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   eos_token="[EOS]", cls_token="[CLS]", sep_token="[SEP]",
                                   model_input_names=["input_ids", "token_type_ids", "attention_mask"])

