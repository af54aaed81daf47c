"""Fixtures of the training tests: a small tokenizer trained offline, for the tiny model folders they save."""

from __future__ import annotations

import pytest

from test_own_data import _sentences


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level-free word-piece-ish BPE tokenizer of ~100 tokens, trained here on the test sentences."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=100,
                                  special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[EOS]"])
    tok.train_from_iterator(_sentences(200, 0), trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", eos_token="[EOS]")
    out = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(str(out))
    return out
