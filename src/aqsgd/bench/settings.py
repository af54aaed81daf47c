"""The named compression settings every benchmark draws from (``aqsgd bench pipeline``, ``bench netem`` and
the convergence study): one table, so a name means the same codecs everywhere. Each benchmark picks its
default list of names from it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["Setting", "SETTINGS", "setting"]


@dataclasses.dataclass(frozen=True)
class Setting:
    """The boundary codecs of one setting (``--forward`` / ``--backward``), plus ``overrides``: more training
    options by their flat names (as on the command line, e.g. ``{"cache": "lowbit4"}``), and ``lr_factor``:
    the task's learning rate times this (LoRA trains a few weights and takes larger steps)."""

    forward: str
    backward: str
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    lr_factor: float = 1.0


SETTINGS: dict[str, Setting] = {
    "fp32": Setting("none", "none"),
    "fp16": Setting("fp16", "fp16"),
    # the bits of each link chosen from its measured speed (aqsgd.train.adaptive): distributed runs only
    # (bench pipeline, bench netem), not the local runtime of the convergence studies
    "auto": Setting("auto", "auto"),
    "aqsgd fw2/bw4": Setting("delta:q2", "direct:q4"),
    "direct fw2/bw4": Setting("direct:q2", "direct:q4"),
    "aqsgd fw3/bw6": Setting("delta:q3", "direct:q6"),
    "direct fw3/bw6": Setting("direct:q3", "direct:q6"),
    "aqsgd fw4/bw8": Setting("delta:q4", "direct:q8"),
    "direct fw4/bw8": Setting("direct:q4", "direct:q8"),
    "topk10%": Setting("direct:topk0.1", "direct:topk0.1"),
    "topk10% + ef": Setting("ef:topk0.1", "ef:topk0.1"),
    "topk10% + ef21": Setting("ef21:topk0.1", "ef21:topk0.1"),
    "topk30%": Setting("direct:topk0.3", "direct:topk0.3"),
    "topk30% + ef": Setting("ef:topk0.3", "ef:topk0.3"),
    "aqsgd + topk30%": Setting("delta:topk0.3", "direct:topk0.3"),
    # ablations: one direction compressed, the other fp32
    "aqsgd fw2 only": Setting("delta:q2", "none"),
    "direct fw2 only": Setting("direct:q2", "none"),
    "bw4 only": Setting("none", "direct:q4"),
    # the same bits with one scale per token (row) instead of per channel: +16 bits per row of 384-768 values
    "aqsgd fw2/bw4 token": Setting("delta:q2:token", "direct:q4:token"),
    "direct fw2/bw4 token": Setting("direct:q2:token", "direct:q4:token"),
    # unbiased (stochastic) rounding of AQ-SGD's deltas: m follows a in expectation
    "aqsgd fw2/bw4 stochastic": Setting("delta:q2:stochastic", "direct:q4"),
    # MSE-optimal clipping of the 2-bit activations (scale = min(max-abs, 1.71 rms) per channel): the zero
    # bin shrinks from half the channel's max-abs to 0.86 rms, so more of each delta gets through
    "aqsgd fw2/bw4 l2": Setting("delta:q2:l2", "direct:q4"),
    "direct fw2/bw4 l2": Setting("direct:q2:l2", "direct:q4"),
    # the same with its warm-up epoch and AQ-SGD's first visits sent as 8-bit codes instead of fp32
    # (--warmup-codec q8): the warm-up is most of a short fine-tuning's traffic
    "aqsgd fw2/bw4 l2 warmup q8": Setting("delta:q2:l2", "direct:q4", {"warmup_codec": "q8"}),
    # ... with one scale per token: on SmolLM2 the attention-sink position sets every per-channel scale
    "aqsgd fw2/bw4 l2 warmup q8 token": Setting("delta:q2:l2", "direct:q4", {"warmup_codec": "q8:token"}),
    # all four 2-bit codes (no zero level) with a scale per token: on SmolLM2 the attention-sink position
    # (~100x the others) sets every per-channel scale, and a midrise grid then sends the other positions'
    # near-zero values of those channels as +-step/2 (benchmarks/boundary_errors.py)
    "aqsgd fw2/bw4 token l2 midrise": Setting("delta:q2:token:l2:midrise", "direct:q4"),
    # -- fewer bits (the `fewer-bits` study) --------------------------------------------------------------
    # randomized Hadamard rotation of 64-value tiles and one l2-clipped scale per tile: a sink's or a loud
    # channel's energy is spread over its tile instead of setting the scale of every value it shares it with;
    # the rotated tiles are near-Gaussian, where the 4-level midrise grid halves the 2-bit error (SmolLM2
    # activations: 0.41 for q2:l2, 0.030 rotated, 0.012 rotated midrise; `aqsgd bench codecs --quality
    # --data smollm2 --codecs ...`, docs/bench-codecs.md). Gradients rotated too (0.047 -> 0.012 at 4 bits)
    "aqsgd fw2/bw4 rot": Setting("delta:q2:rot64:l2:midrise", "direct:q4:rot64:l2"),
    # rows (tokens) whose norm is 8x the median go apart in bf16: no model-specific position
    "aqsgd fw2/bw4 l2 outlier": Setting("delta:q2:l2:outlier8", "direct:q4"),
    "aqsgd fw2/bw4 rot outlier": Setting("delta:q2:rot64:l2:midrise:outlier8", "direct:q4:rot64:l2"),
    # cache-free: rotated direct quantization at 3 and 4 bits, the gradients at 6 bits rotated (as TAH-Quant);
    # tiles of 128 at 4 bits keep the scales at 0.125 bits per value (4.13 in all, 3.7 with zstd)
    "direct fw3/bw6 rot": Setting("direct:q3:rot64:l2:midrise", "direct:q6:rot32"),
    "direct fw4/bw6 rot": Setting("direct:q4:rot128:l2", "direct:q6:rot32"),
    # the 2025 peer: TAH-Quant's compressor (3/4 bits per token by entropy forward, 6 bits backward)
    "tah-quant": Setting("direct:tah", "direct:tah6"),
    # AQ-SGD at 1 bit (sign of the delta times its mean |delta| per channel / per tile)
    "aqsgd fw1/bw4": Setting("delta:q1", "direct:q4"),
    "aqsgd fw1/bw4 rot": Setting("delta:q1:rot64", "direct:q4"),
    # the lossless zstd stage: the same training (bit for bit) as without it, fewer bytes on the wire
    "aqsgd fw2/bw4 l2 zstd": Setting("delta:q2:l2:zstd", "direct:q4:zstd"),
    "aqsgd fw2/bw4 rot zstd": Setting("delta:q2:rot64:l2:midrise:zstd", "direct:q4:rot64:l2:zstd"),
    "aqsgd fw1/bw4 rot zstd": Setting("delta:q1:rot64:zstd", "direct:q4:rot64:l2:zstd"),
    "direct fw3/bw6 rot zstd": Setting("direct:q3:rot64:l2:midrise:zstd", "direct:q6:rot32:zstd"),
    "direct fw4/bw6 rot zstd": Setting("direct:q4:rot128:l2:zstd", "direct:q6:rot32:zstd"),
    # -- LoRA (the `lora` study): adapters on the attention projections, rank 8, the frozen base; 10x the
    # full fine-tuning learning rate (Hu et al. 2021 trained RoBERTa-base's adapters on GLUE at 4e-4 to 5e-4,
    # where full fine-tuning of RoBERTa uses 1e-5 to 3e-5)
    "lora fp32": Setting("none", "none", {"lora": True}, lr_factor=10.0),
    "lora aqsgd fw2/bw4 l2": Setting("delta:q2:l2", "direct:q4", {"lora": True}, lr_factor=10.0),
    "lora aqsgd fw2/bw4 rot zstd": Setting("delta:q2:rot64:l2:midrise:zstd", "direct:q4:rot64:l2:zstd",
                                           {"lora": True}, lr_factor=10.0),
    "lora aqsgd fw2 ec/bw4 rot": Setting("delta:q4:rot128:step1:rc", "direct:q4:rot64:l2:zstd",
                                         {"lora": True}, lr_factor=10.0),
    "tah-quant zstd": Setting("direct:tah:zstd", "direct:tah6:zstd"),
    # the rotated AQ-SGD row with 3-bit deltas: what one more bit does to its training-loss gap
    "aqsgd fw3/bw4 rot zstd": Setting("delta:q3:rot64:l2:midrise:zstd", "direct:q4:rot64:l2:zstd"),
    # ablations of the rotated fw2/bw4 row: which direction its training-loss gap comes from
    "aqsgd fw2 rot only": Setting("delta:q2:rot64:l2:midrise:zstd", "none"),
    "bw4 rot only": Setting("none", "direct:q4:rot64:l2:zstd"),
    # the fw2 row's deltas entropy-coded instead of fixed-rate: rotated tiles of 128, a uniform step of one
    # rms per tile in a 4-bit field, the codes range-coded (about 2.2 bits per value: the 2-bit row's
    # budget, 2.17 with zstd and 2.26 without; relative error on the deltas about 0.7x the midrise grid's)
    "aqsgd fw2 ec/bw4 rot": Setting("delta:q4:rot128:step1:rc", "direct:q4:rot64:l2:zstd"),
    # the same at a coarser step: about 1.45 bits per value (relative error about 0.3 on Gaussian tiles)
    "aqsgd fw1.5 ec/bw4 rot": Setting("delta:q4:rot128:step1.9:rc", "direct:q4:rot64:l2:zstd"),
    # cache-free with entropy-coded steps: rotated tiles of 128, a uniform step of 0.3 (0.45) rms per tile in
    # an 8-bit field (nothing clipped), range-coded: about 4.0 (3.4) bits per activation value on SmolLM2,
    # under TAH-Quant's 4.15; the fixed-rate 4-bit row's error at 3.8 bits lies between. The gradients as in
    # the other cache-free rows
    "direct fw4 ec/bw6 rot": Setting("direct:q8:rot128:step0.3:rc", "direct:q6:rot32:zstd"),
    "direct fw3.5 ec/bw6 rot": Setting("direct:q8:rot128:step0.45:rc", "direct:q6:rot32:zstd"),
    # cache-free at TAH-Quant's bits: the fixed-rate 4-bit row on the `midrise` grid, with the rows whose norm
    # is 32x the median (SmolLM2's attention sinks, 70-137x at the study's boundaries) sent apart in bf16,
    # which take most of that row's error on SmolLM2's activations (0.0035 -> 0.0013, TAH 0.0012); with zstd
    # about 4.1 bits per value, TAH's 4.15
    "direct fw4/bw6 rot outlier zstd": Setting("direct:q4:rot128:l2:midrise:outlier32:zstd",
                                               "direct:q6:rot32:zstd"),
    # -- the subspace codec (the `subspace` study): coefficients in a basis each boundary learns -----------
    # (aqsgd.compress.subspace). Forward: AQ-SGD's deltas in a quarter (an eighth) of the row's dimensions,
    # the entropy-coded deltas' coder on the coefficients; backward: the gradients in a basis of their own,
    # with error feedback (what the basis leaves out goes with the slot's next message)
    "aqsgd pca/4 ec/ef pca/4 ec": Setting("delta:q4:rot128:step1:rc:pca/4", "ef:q4:rot128:step1:rc:pca/4"),
    "aqsgd pca/8 ec/ef pca/4 ec": Setting("delta:q4:rot128:step1:rc:pca/8", "ef:q4:rot128:step1:rc:pca/4"),
    # the refresh interval: a new basis every 8 or every 128 compressed messages (default 32)
    "aqsgd pca/4 ec/ef pca/4 ec refresh8": Setting("delta:q4:rot128:step1:rc:pca/4:refresh8",
                                                   "ef:q4:rot128:step1:rc:pca/4:refresh8"),
    "aqsgd pca/4 ec/ef pca/4 ec refresh128": Setting("delta:q4:rot128:step1:rc:pca/4:refresh128",
                                                     "ef:q4:rot128:step1:rc:pca/4:refresh128"),
    "aqsgd pca/4 q4/ef pca/4 q4": Setting("delta:q4:pca/4", "ef:q4:pca/4"),
    # the same in tiled bases (each tile of 64 values of a row a basis of its own, a quarter of its width):
    # the products cost 64 / D of the dense basis's
    "aqsgd pca/4 tile64 ec/ef pca/4 tile64 ec": Setting("delta:q4:rot128:step1:rc:pca/4:tile64",
                                                        "ef:q4:rot128:step1:rc:pca/4:tile64"),
    "aqsgd pca/4 tile64 q4/ef pca/4 tile64 q4": Setting("delta:q4:pca/4:tile64", "ef:q4:pca/4:tile64"),
    # ablations: one direction in its subspace, the other in fp32
    "aqsgd pca/4 ec only": Setting("delta:q4:rot128:step1:rc:pca/4", "none"),
    "ef pca/4 ec only": Setting("none", "ef:q4:rot128:step1:rc:pca/4"),
    "lora aqsgd pca/4 ec/ef pca/4 ec": Setting("delta:q4:rot128:step1:rc:pca/4",
                                               "ef:q4:rot128:step1:rc:pca/4", {"lora": True}, lr_factor=10.0),
    # the same with the warm-up (and AQ-SGD's first visits) sent as 8-bit codes: the whole run compressed
    "aqsgd pca/4 ec/ef pca/4 ec warmup q8": Setting("delta:q4:rot128:step1:rc:pca/4",
                                                    "ef:q4:rot128:step1:rc:pca/4", {"warmup_codec": "q8"}),
    # ... and as the entropy-coded 4-bit grid (about 2.2 bits a value on activations and gradients alike): the
    # setting that sends 16x less than fp32 over a run whose first half is the warm-up
    "aqsgd pca/4 ec/ef pca/4 ec warmup ec": Setting("delta:q4:rot128:step1:rc:pca/4",
                                                    "ef:q4:rot128:step1:rc:pca/4",
                                                    {"warmup_codec": "q4:rot128:step1:rc"}),
    # -- the replicas' sync (the `diloco` study; its tasks are data parallel, the boundaries stay fp32) ------
    # per step: every step's gradients averaged as 8-bit codes with error feedback (`fp32`: all-reduce)
    "sync q8": Setting("none", "none", {"grad_sync": "q8"}),
    # DiLoCo: H inner AdamW steps alone, then the outer Nesterov step (lr 0.7, momentum 0.9) on the averaged
    # pseudo-gradient, sent in fp32, as 8-bit codes, or as the top 3 % of each block with 2-bit values
    # (SparseLoCo's recipe), the last two with error feedback
    "diloco10": Setting("none", "none", {"grad_sync": "diloco:10"}),
    "diloco10 q8": Setting("none", "none", {"grad_sync": "diloco:10:q8"}),
    "diloco10 topk3% q2": Setting("none", "none", {"grad_sync": "diloco:10:topk3%:q2"}),
    "diloco50": Setting("none", "none", {"grad_sync": "diloco:50"}),
    "diloco50 q8": Setting("none", "none", {"grad_sync": "diloco:50:q8"}),
    "diloco50 topk3% q2": Setting("none", "none", {"grad_sync": "diloco:50:topk3%:q2"}),
    # the outer step as plain averaging (lr 1, no momentum: every replica to the mean of their weights, Local
    # SGD / FedAvg): fine-tuning a pretrained model for a few rounds, where the paper's Nesterov step (tuned
    # for pre-training over thousands of rounds) may overshoot
    "diloco50 avg q8": Setting("none", "none", {"grad_sync": "diloco:50:lr1:momentum0:q8"}),
    "diloco50 avg topk3% q2": Setting("none", "none", {"grad_sync": "diloco:50:lr1:momentum0:topk3%:q2"}),
    "diloco10 avg q8": Setting("none", "none", {"grad_sync": "diloco:10:lr1:momentum0:q8"}),
    # ... and past the mean: averaging two replicas' rounds shrinks what they moved (their steps partly
    # disagree), which an outer lr above 1, or a little Nesterov momentum, might give back over a few rounds
    # (tried on seed 0, with the larger top-k below: convergence.md, "The outer step's size")
    "diloco50 lr1.5 topk3% q2": Setting("none", "none", {"grad_sync": "diloco:50:lr1.5:momentum0:topk3%:q2"}),
    "diloco50 lr2 topk3% q2": Setting("none", "none", {"grad_sync": "diloco:50:lr2:momentum0:topk3%:q2"}),
    "diloco50 nesterov0.5 topk3% q2": Setting("none", "none",
                                              {"grad_sync": "diloco:50:lr1:momentum0.5:topk3%:q2"}),
    # ... and a larger share of each block (10 %, ~120x fewer bytes than per-step q8 at 2 replicas): with a
    # few rounds only, what error feedback holds back at 3 % is never all sent
    "diloco50 avg topk10% q2": Setting("none", "none", {"grad_sync": "diloco:50:lr1:momentum0:topk10%:q2"}),
    "diloco50 lr2 topk10% q2": Setting("none", "none", {"grad_sync": "diloco:50:lr2:momentum0:topk10%:q2"}),
    # streamed (Streaming DiLoCo): the stage in 2 fragments whose rounds end 25 steps apart, each averaging
    # overlapped with the next steps' compute (delay: the steps its bytes take over a 30 Mbit/s link, with a
    # margin: MiniLM's larger fragment ~3 s in 8-bit codes, ~0.4 s as the top-k) and mixed half and half with
    # the weights trained meanwhile
    "diloco50 avg q8 stream": Setting("none", "none",
                                      {"grad_sync": "diloco:50:lr1:momentum0:fragments2:delay12:q8"}),
    "diloco50 avg topk3% q2 stream": Setting("none", "none", {
        "grad_sync": "diloco:50:lr1:momentum0:fragments2:delay5:topk3%:q2"}),
}


def setting(name: str) -> Setting:
    """The setting called ``name``; ValueError listing the names there are."""
    try:
        return SETTINGS[name]
    except KeyError:
        raise ValueError(f"unknown setting {name!r}; settings are: {', '.join(SETTINGS)}") from None
