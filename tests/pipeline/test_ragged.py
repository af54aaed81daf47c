"""Examples of their own lengths through the pipeline: bucketed and packed micro-batches compute what the
unsplit model computes on each example alone, and only real tokens cross a boundary."""

from __future__ import annotations

import pytest
import torch
import transformers

from aqsgd.data.datasets.ragged import (
    IGNORE_INDEX,
    RaggedDataset,
    bucketed_order,
    collate_ragged,
    micro_batches,
    pack_rows,
)
from aqsgd.errors import SpecError
from aqsgd.pipeline.compression import CompressionConfig
from aqsgd.pipeline.local import LocalPipeline
from aqsgd.pipeline.partition import partition_model

from .test_partition import VOCAB, bert_case, gpt2_case, llama_case


def _lm_examples(n: int = 8, seed: int = 0, lo: int = 3, hi: int = 14) -> RaggedDataset:
    """``n`` examples of lengths in [lo, hi), the first half of each a prompt (no loss)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g)
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    ids = torch.randint(3, VOCAB, (int(offsets[-1]),), generator=g)
    labels = ids.clone()
    for i in range(n):
        labels[offsets[i]: offsets[i] + lengths[i] // 2] = IGNORE_INDEX
    return RaggedDataset({"input_ids": ids, "labels": labels}, offsets, info={"pad_token_id": 0})


def _classification_examples(n: int = 8) -> RaggedDataset:
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(2, 12, (n,), generator=g)
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    ids = torch.randint(2, VOCAB, (int(offsets[-1]),), generator=g)
    labels = torch.randint(0, 3, (n,), generator=g)
    return RaggedDataset({"input_ids": ids}, offsets, values={"labels": labels}, info={"pad_token_id": 0})


def _reference(model: torch.nn.Module, data: RaggedDataset) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The unsplit model on every example alone (no padding, no packing): the mean over all loss tokens (LM)
    or over the examples (classification), and its gradients."""
    model.zero_grad(set_to_none=True)
    total, count = 0.0, 0
    for i in range(len(data)):
        item = data[i]
        if "labels" in data.tokens:
            n = int((item["labels"][1:] != IGNORE_INDEX).sum())
            out = model(input_ids=item["input_ids"][None], labels=item["labels"][None])
            total, count = total + out.loss * n, count + n
        else:
            out = model(input_ids=item["input_ids"][None], labels=item["labels"][None])
            total, count = total + out.loss, count + 1
    loss = total / count
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


CASES = {"gpt2": gpt2_case, "llama": llama_case, "llama-sdpa": lambda: llama_case(attn="sdpa")}


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("batching", ["bucket", "pack"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_variable_lengths_match_each_example_alone(name, batching, stages):
    """A pass of bucketed (padded per micro-batch) or packed examples gives the unsplit model's mean over the
    loss tokens of the examples, each computed alone, and its gradients."""
    case = CASES[name]()
    data = _lm_examples()
    ref_loss, ref_grads = _reference(case.model, data)
    micro = micro_batches(data, torch.arange(len(data)), batching, 2, 16)
    if batching == "pack":
        assert sum(mb["input_ids"].shape[0] for mb in micro) < len(data)  # several examples share a row
    pipe = LocalPipeline(partition_model(case.model, stages), CompressionConfig.simple("none", "none"))
    loss = pipe.step(micro)
    torch.testing.assert_close(loss, ref_loss)
    for n, p in case.model.named_parameters():
        if n in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[n], msg=lambda m, n=n: f"{n}: {m}")


def test_classification_buckets_match_each_example_alone():
    case = bert_case()
    data = _classification_examples()
    ref_loss, ref_grads = _reference(case.model, data)
    micro = micro_batches(data, torch.arange(len(data)), "bucket", 2, 16)
    pipe = LocalPipeline(partition_model(case.model, 2), CompressionConfig.simple("none", "none"))
    torch.testing.assert_close(pipe.step(micro), ref_loss)
    for n, p in case.model.named_parameters():
        if n in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[n], msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("batching", ["bucket", "pack", "max-length"])
def test_only_real_tokens_cross_a_boundary(batching):
    """The packets of bucketed and packed micro-batches hold one row per real token: no pad position is sent
    forward or backward (counted); padding to --max-length sends the pads and counts them."""
    case = llama_case()
    data = _lm_examples()
    micro = micro_batches(data, torch.arange(len(data)), batching, 2, 16)
    pipe = LocalPipeline(partition_model(case.model, 3), CompressionConfig.simple("none", "none"))
    pipe.step(micro)
    sent = {"forward": 0, "backward": 0}
    pads = {"forward": 0, "backward": 0}
    for runner in pipe.runners:
        for k in sent:
            sent[k] += runner.stats.tokens_sent[k]
            pads[k] += runner.stats.pad_tokens_sent[k]
    real = data.num_tokens
    if batching == "max-length":
        assert pads == {k: 2 * (len(data) * 16 - real) for k in pads}  # 2 boundaries, pads included
        assert sent == {k: 2 * len(data) * 16 for k in sent}
    else:
        assert pads == {"forward": 0, "backward": 0}
        assert sent == {k: 2 * real for k in sent}


def test_aqsgd_cache_holds_each_example_at_its_own_length():
    """The AQ-SGD cache of a bucketed run is keyed by token: one row per real token of the data set (memory by
    real tokens), and both sides of a boundary hold the same rows."""
    case = llama_case()
    data = _lm_examples()
    comp = CompressionConfig.simple("delta:q2", "direct:q4", num_samples=data.num_tokens)
    pipe = LocalPipeline(partition_model(case.model, 2), comp)
    order = torch.arange(len(data))
    for _ in range(2):  # the first visit fills the rows, the second sends deltas against them
        pipe.step(micro_batches(data, order, "bucket", 2, 16), "warmup")
        pipe.step(micro_batches(data, order, "bucket", 2, 16))
    sender = pipe.runners[0].schemes[(0, 0, "sender")]
    receiver = pipe.runners[1].schemes[(0, 0, "receiver")]
    assert sender.cache.row_shape == (32,) and sender.cache.capacity == data.num_tokens
    every = torch.arange(data.num_tokens)
    assert bool(sender.cache.visited(every).all())
    assert torch.equal(sender.cache.get(every), receiver.cache.get(every))


def test_pack_rows_first_fit_decreasing():
    assert pack_rows([5, 3, 8, 2, 4], 10) == [[2, 3], [0, 4], [1]]
    assert pack_rows([12, 1], 10) == [[0], [1]]  # a longer example gets a row of its own


def test_collate_pack_positions_labels_and_ids():
    """Packed rows: positions restart at each example, each example's first label is masked (it would be
    predicted from the previous example), token ids are the examples' own, pads get a segment of their own."""
    data = _lm_examples(n=3, lo=3, hi=6)
    mb = collate_ragged(data, torch.arange(3), "pack", 16)
    lens = data.lengths.tolist()
    assert mb["input_ids"].shape == (1, sum(lens))
    order = sorted(range(3), key=lambda k: (-lens[k], k))
    expect_pos, expect_ids, expect_labels = [], [], []
    for k in order:
        a = int(data.offsets[k])
        expect_pos += list(range(lens[k]))
        expect_ids += list(range(a, a + lens[k]))
        labels = data.tokens["labels"][a:a + lens[k]].tolist()
        expect_labels += [IGNORE_INDEX] + labels[1:]
    assert mb["position_ids"][0].tolist() == expect_pos
    assert mb["token_ids"].tolist() == expect_ids
    assert mb["labels"][0].tolist() == expect_labels
    assert "attention_mask" not in mb and mb["real_tokens"] == sum(lens)


def test_collate_bucket_pads_to_the_longest():
    data = _lm_examples(n=4)
    mb = collate_ragged(data, torch.arange(4), "bucket", 64)
    longest = int(data.lengths.max())
    assert mb["input_ids"].shape == (4, longest)
    assert mb["attention_mask"].sum().item() == data.num_tokens == mb["real_tokens"]
    assert mb["token_positions"].numel() == data.num_tokens
    assert (mb["labels"][mb["attention_mask"] == 0] == IGNORE_INDEX).all()


def test_bucketed_order_is_a_seeded_permutation_of_similar_lengths():
    lengths = torch.randint(1, 500, (1000,), generator=torch.Generator().manual_seed(0))
    base = torch.randperm(1000, generator=torch.Generator().manual_seed(1))
    order = bucketed_order(lengths, 8, base, seed=0, epoch=0)
    assert sorted(order.tolist()) == list(range(1000))
    assert torch.equal(order, bucketed_order(lengths, 8, base, seed=0, epoch=0))
    assert not torch.equal(order, bucketed_order(lengths, 8, base, seed=0, epoch=1))
    spread = lengths[order[:1000 // 8 * 8]].view(-1, 8)
    # within a batch the lengths are close: far below the spread of a random batch
    assert float((spread.max(1).values - spread.min(1).values).float().mean()) < 50


def test_from_padded_keeps_the_tokens():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    mask = (ids != 0).long()
    data = RaggedDataset.from_padded({"input_ids": ids, "attention_mask": mask,
                                      "labels": torch.tensor([1, 0])})
    assert data.lengths.tolist() == [3, 2]
    assert data[1]["input_ids"].tolist() == [8, 9] and int(data[1]["labels"]) == 0


def test_bad_ragged_data_is_one_line():
    with pytest.raises(SpecError, match="every example needs >= 1 token"):
        RaggedDataset({"input_ids": torch.arange(3)}, torch.tensor([0, 3, 3]))
    with pytest.raises(SpecError, match="must be 1-D with 3 tokens"):
        RaggedDataset({"input_ids": torch.arange(3), "labels": torch.arange(2)}, torch.tensor([0, 3]))
    with pytest.raises(SpecError, match="longer than --max-length 4"):
        collate_ragged(_lm_examples(n=2, lo=6, hi=7), torch.arange(2), "max-length", 4)


def test_transformers_builds_block_diagonal_masks_from_restarting_positions():
    """What packing relies on: with no attention mask, restarting position ids make transformers' mask keep
    each example to itself (the floor version included)."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config).eval()
    a, b = torch.randint(3, VOCAB, (1, 5)), torch.randint(3, VOCAB, (1, 4))
    packed = model(input_ids=torch.cat([a, b], 1),
                   position_ids=torch.cat([torch.arange(5), torch.arange(4)])[None], use_cache=False).logits
    torch.testing.assert_close(packed[:, 5:], model(input_ids=b).logits)
    torch.testing.assert_close(packed[:, :5], model(input_ids=a).logits)
