"""Partitioning tests: a pipelined step without compression equals the unsplit model's step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from aqsgd.compress import Packet
from aqsgd.models.resnet import ResNet
from aqsgd.pipeline.compression import BACKWARD_CHANNEL, FORWARD_CHANNEL, CompressionConfig
from aqsgd.pipeline.partition import balanced_counts, partition_model, shared_parameters
from aqsgd.pipeline.local import LocalPipeline
from aqsgd.models.stage import Batch
from aqsgd.schemes import ids_tag

transformers = pytest.importorskip("transformers")

BATCH = 8
SEQ = 12
VOCAB = 100


@dataclass
class Case:
    """A model, a full batch, and how the unsplit model computes its loss on a batch."""

    model: nn.Module
    batch: dict[str, torch.Tensor]
    loss: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]


def _hf_loss(keys: tuple[str, ...]) -> Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]:
    return lambda model, batch: model(**{k: batch[k] for k in keys if k in batch}).loss


def _lm_batch(padded: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    labels = input_ids.clone()
    if padded:
        # Left-pad every odd row by 3 tokens: each 2-row micro-batch has the same number of real tokens.
        attention_mask[1::2, :3] = 0
        input_ids[1::2, :3] = 0
        labels[1::2, :3] = -100
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "sample_ids": torch.arange(BATCH),
    }


def gpt2_case(attn: str = "eager") -> Case:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=4,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation=attn,
    )
    model = transformers.GPT2LMHeadModel(config)
    return Case(model, _lm_batch(padded=False), _hf_loss(("input_ids", "attention_mask", "labels")))


def llama_case(padded: bool = False, attn: str = "eager") -> Case:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation=attn,
    )
    model = transformers.LlamaForCausalLM(config)
    return Case(model, _lm_batch(padded), _hf_loss(("input_ids", "attention_mask", "labels")))


def bert_case(attn: str = "eager", family: str = "bert") -> Case:
    torch.manual_seed(0)
    config_cls = transformers.RobertaConfig if family == "roberta" else transformers.BertConfig
    model_cls = (
        transformers.RobertaForSequenceClassification
        if family == "roberta"
        else transformers.BertForSequenceClassification
    )
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        type_vocab_size=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
        attn_implementation=attn,
    )
    model = model_cls(config)
    gen = torch.Generator().manual_seed(2)
    input_ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[::3, -4:] = 0  # right padding on some rows
    token_type_ids = torch.zeros_like(input_ids)
    token_type_ids[:, SEQ // 2 :] = 1
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "token_type_ids": token_type_ids,
        "labels": torch.randint(0, 3, (BATCH,), generator=gen),
        "sample_ids": torch.arange(BATCH),
    }
    return Case(model, batch, _hf_loss(("input_ids", "attention_mask", "token_type_ids", "labels")))


def mlp_case() -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(10, 32),
        nn.Tanh(),
        nn.Linear(32, 32),
        nn.GELU(),
        nn.Linear(32, 16),
        nn.ReLU(),
        nn.Linear(16, 5),
    )
    gen = torch.Generator().manual_seed(3)
    batch = {
        "input": torch.randn(BATCH, 10, generator=gen),
        "labels": torch.randint(0, 5, (BATCH,), generator=gen),
    }
    return Case(model, batch, lambda m, b: F.cross_entropy(m(b["input"]), b["labels"]))


def resnet_case(norm: str = "group") -> Case:
    torch.manual_seed(0)
    model = ResNet(in_channels=1, num_classes=10, widths=(4, 8), blocks_per_group=2, norm=norm)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(4)
    batch = {
        "pixel_values": torch.randn(BATCH, 1, 28, 28, generator=gen),
        "labels": torch.randint(0, 10, (BATCH,), generator=gen),
    }
    return Case(model, batch, lambda m, b: F.cross_entropy(m(b["pixel_values"]), b["labels"]))


CASES: dict[str, Callable[[], Case]] = {
    "gpt2": gpt2_case,
    "gpt2-sdpa": lambda: gpt2_case(attn="sdpa"),
    "llama": llama_case,
    "llama-padded": lambda: llama_case(padded=True),
    "llama-padded-sdpa": lambda: llama_case(padded=True, attn="sdpa"),
    "bert": bert_case,
    "bert-sdpa": lambda: bert_case(attn="sdpa"),
    "roberta": lambda: bert_case(family="roberta"),
    "mlp": mlp_case,
    "resnet": resnet_case,
}


def split_batch(batch: Batch, num_microbatches: int) -> list[dict[str, torch.Tensor]]:
    size = BATCH // num_microbatches
    return [{k: v[i * size : (i + 1) * size] for k, v in batch.items()} for i in range(num_microbatches)]


def reference_step(case: Case) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    case.model.zero_grad(set_to_none=True)
    loss = case.loss(case.model, case.batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in case.model.named_parameters() if p.grad is not None}
    case.model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def run_pipeline(
    stages: list[nn.Module], schedule: str, microbatches: list[dict[str, torch.Tensor]]
) -> torch.Tensor:
    """One training step of the stages as an uncompressed local pipeline: the gradients of the mean
    micro-batch loss accumulate in the parameters (no optimizer step); returns that mean loss."""
    return LocalPipeline(stages, CompressionConfig(), schedule=schedule).step(microbatches)


def assert_matches_reference(
    case: Case, stages: list[nn.Module], schedule: str, num_microbatches: int
) -> None:
    ref_loss, ref_grads = reference_step(case)
    loss = run_pipeline(stages, schedule, split_batch(case.batch, num_microbatches))
    torch.testing.assert_close(loss, ref_loss)
    got = {n: p.grad for n, p in case.model.named_parameters() if p.grad is not None}
    assert got.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(got[name], grad, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_microbatches", [1, 4])
@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_pipeline_matches_unsplit_model(
    name: str, num_stages: int, num_microbatches: int, schedule: str
) -> None:
    case = CASES[name]()
    stages = partition_model(case.model, num_stages)
    assert_matches_reference(case, stages, schedule, num_microbatches)


@pytest.mark.parametrize("name", sorted(CASES))
def test_single_stage_and_params_balance(name: str) -> None:
    case = CASES[name]()
    assert_matches_reference(case, partition_model(case.model, 1), "1f1b", 2)
    assert_matches_reference(case, partition_model(case.model, 3, balance="params"), "gpipe", 2)


def test_resnet_batchnorm_eval_mode() -> None:
    # BatchNorm in training mode normalises per micro-batch, so only eval mode is exactly equivalent.
    case = resnet_case(norm="batch")
    case.model.eval()
    assert_matches_reference(case, partition_model(case.model, 2), "1f1b", 4)


def test_padding_mask_matters() -> None:
    case = llama_case(padded=True)
    unmasked = dict(case.batch, attention_mask=torch.ones_like(case.batch["attention_mask"]))
    stages = partition_model(case.model, 2)
    with torch.no_grad():
        masked_loss = stages[1](stages[0](None, case.batch), case.batch)
        unmasked_loss = stages[1](stages[0](None, unmasked), unmasked)
    assert not torch.allclose(masked_loss, unmasked_loss)


def test_every_boundary_transfer_goes_through_the_transport() -> None:
    """Each stage but the last sends its output forward, and each but the first its input's gradient backward,
    once per micro-batch (named by the packet's tag), with the boundary tensor's shape."""
    case = gpt2_case()
    microbatches = split_batch(case.batch, 2)
    slot_of_tag = {ids_tag(mb["sample_ids"], m): m for m, mb in enumerate(microbatches)}
    log: list[tuple[str, int, int, tuple[int, ...]]] = []

    class Recorder:
        def __init__(self, view, stage: int) -> None:
            self.view, self.stage = view, stage

        def isend(self, packets: list[Packet], dst: int, channel: int):
            assert channel in (FORWARD_CHANNEL, BACKWARD_CHANNEL)
            kind = "a" if channel == FORWARD_CHANNEL else "g"
            log.append((kind, self.stage, slot_of_tag[packets[0].tag], tuple(packets[0].shape)))
            return self.view.isend(packets, dst, channel)

        def irecv(self, src: int, channel: int):
            return self.view.irecv(src, channel)

    pipe = LocalPipeline(partition_model(case.model, 3), CompressionConfig(), schedule="gpipe")
    for i, runner in enumerate(pipe.runners):
        runner.transport = Recorder(runner.transport, i)
    pipe.step(microbatches)
    hidden = (BATCH // 2, SEQ, 32)
    assert sorted(log) == sorted(
        [("a", s, m, hidden) for s in (0, 1) for m in (0, 1)]
        + [("g", s, m, hidden) for s in (1, 2) for m in (0, 1)]
    )


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "mlp", "resnet"])
def test_stages_share_parameters(name: str) -> None:
    case = CASES[name]()
    stages = partition_model(case.model, 2)
    model_params = {id(p) for p in case.model.parameters()}
    stage_params = [{id(p) for p in stage.parameters()} for stage in stages]
    assert set().union(*stage_params) == model_params
    assert stages[0].is_first and stages[-1].is_last
    assert [s.layer_range for s in stages][0][0] == 0


def test_stage_outputs() -> None:
    case = llama_case()
    stages = partition_model(case.model, 3, layers=[1, 2, 1])
    assert [s.layer_range for s in stages] == [(0, 1), (1, 3), (3, 4)]
    with torch.no_grad():
        h = stages[0](None, case.batch)
        assert h.shape == (BATCH, SEQ, 32)
        h = stages[1](h, case.batch)
        loss = stages[2](h, case.batch)
    assert loss.ndim == 0
    with pytest.raises(ValueError, match="needs a boundary tensor"):
        stages[1](None, case.batch)
    with pytest.raises(KeyError, match="labels"):
        stages[2](h, {k: v for k, v in case.batch.items() if k != "labels"})


def test_partition_on_meta_device() -> None:
    with torch.device("meta"):
        gpt2 = gpt2_case().model
        llama = llama_case().model
        bert = bert_case().model
        resnet = ResNet(in_channels=3, widths=(4, 8), blocks_per_group=2, norm="batch")
    for model in (gpt2, llama, bert, resnet):
        stages = partition_model(model, 2, balance="params")
        assert all(p.is_meta for s in stages for p in s.parameters())
        assert {id(p) for s in stages for p in s.parameters()} == {id(p) for p in model.parameters()}


def test_params_balance() -> None:
    assert balanced_counts([1, 1, 1, 1, 8], 2) == [4, 1]
    assert balanced_counts([1] * 6, 2, first_extra=3) == [2, 4]
    assert balanced_counts([1] * 6, 3, last_extra=4) == [3, 2, 1]
    assert balanced_counts([5, 1, 1, 1], 4) == [1, 1, 1, 1]
    # A wide first layer pulls the cut forward; the parameter-free ReLU stays with it (ties favour
    # earlier stages).
    model = nn.Sequential(
        nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2), nn.ReLU(), nn.Linear(2, 2), nn.Linear(2, 2)
    )
    stages = partition_model(model, 2, balance="params")
    assert [s.layer_range for s in stages] == [(0, 2), (2, 6)]
    assert [s.layer_range for s in partition_model(model, 2)] == [(0, 3), (3, 6)]


def test_partition_errors() -> None:
    model = gpt2_case().model
    with pytest.raises(ValueError, match="4 layers into 5 stages"):
        partition_model(model, 5)
    with pytest.raises(ValueError, match=r"adds up to 3 but the model has 4 layers"):
        partition_model(model, 2, layers=[2, 1])
    with pytest.raises(ValueError, match="stage 1 has 0 layers"):
        partition_model(model, 2, layers=[4, 0])
    with pytest.raises(ValueError, match="has 3 entries but num_stages=2"):
        partition_model(model, 2, layers=[1, 1, 2])
    with pytest.raises(ValueError, match="num_stages must be >= 1"):
        partition_model(model, 0)
    with pytest.raises(ValueError, match="unknown balance 'flops'"):
        partition_model(model, 2, balance="flops")
    with pytest.raises(ValueError, match="computes its own loss"):
        partition_model(model, 2, loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match=r"unsupported model type Linear; supported: .*GPT2LMHeadModel"):
        partition_model(nn.Linear(2, 2), 1)
    with pytest.raises(ValueError, match="unsupported model type GPT2Model"):
        partition_model(model.transformer, 2)


def test_shared_parameters() -> None:
    gpt2 = gpt2_case().model  # lm_head is tied to the token embedding
    assert shared_parameters(partition_model(gpt2, 2)) == [{0: "wte.weight", 1: "lm_head.weight"}]
    assert shared_parameters(partition_model(gpt2, 1)) == []
    assert shared_parameters(partition_model(llama_case().model, 2)) == []


def test_package_does_not_import_transformers_eagerly() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    import aqsgd

    src = str(Path(aqsgd.__file__).resolve().parents[1])
    code = "import sys, aqsgd.pipeline; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": src})
