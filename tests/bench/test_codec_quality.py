"""``aqsgd bench codecs --quality``: the rate-distortion table and its references."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from aqsgd.bench.quality import (
    BITS,
    DEFAULT_VARIANTS,
    REFERENCE_LABELS,
    bench_quality,
    gaussian_uniform_mse,
    optimal_uniform_mse,
    reference_rows,
    shannon_bound,
)
from aqsgd.cli import main


@pytest.fixture(scope="module")
def rows():
    return bench_quality(shape=(64, 1024), seed=0)


def by_label(rows):
    return {r.label: r for r in rows}


@pytest.mark.parametrize("bits,expected", [(1, 0.3634), (2, 0.1188), (3, 0.03744), (4, 0.01154)])
def test_best_uniform_quantizer_matches_max_1960(bits, expected):
    mse, step = optimal_uniform_mse(2**bits)
    assert mse == pytest.approx(expected, rel=2e-3)
    assert 0 < step < 12 / (2**bits - 1)


def test_one_bit_optimum_is_closed_form():
    mse, step = optimal_uniform_mse(2)
    assert mse == pytest.approx(1 - 2 / math.pi, abs=1e-9)
    assert step == pytest.approx(2 * math.sqrt(2 / math.pi), abs=1e-5)  # levels at +-E|x|


def test_uniform_mse_formula_against_sampling():
    x = torch.randn(2_000_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for levels, step in ((3, 1.2), (4, 1.0), (8, 0.6), (15, 0.3)):
        centers = (torch.arange(levels, dtype=torch.float64) - (levels - 1) / 2) * step
        y = centers[(x.unsqueeze(1) - centers).abs().argmin(1)]
        sampled = float((y - x).square().mean())
        assert gaussian_uniform_mse(levels, step) == pytest.approx(sampled, rel=0.01)
    assert gaussian_uniform_mse(1, 0.5) == 1.0


def test_optimum_is_a_minimum():
    for levels in (3, 4, 16, 255, 256):
        mse, step = optimal_uniform_mse(levels)
        for factor in (0.98, 1.02):
            assert mse <= gaussian_uniform_mse(levels, step * factor)


def test_table_has_every_variant_and_reference(rows):
    labels = [r.label for r in rows]
    assert labels == [v[0] for v in DEFAULT_VARIANTS] + list(REFERENCE_LABELS.values())
    for r in rows:
        assert len(r.rel_mse) == len(BITS)
        assert all(e is not None and math.isfinite(e) and e > 0 for e in r.rel_mse)
        if r.kind == "codec":
            assert r.specs[0].startswith("q1") and r.specs[-1].startswith("q8") and r.scale_bits > 0


def test_reference_columns_follow_the_formulas(rows):
    t = by_label(rows)
    for i, b in enumerate(BITS):
        assert t[REFERENCE_LABELS["shannon"]].rel_mse[i] == shannon_bound(b) == 2.0 ** (-2 * b)
        assert t[REFERENCE_LABELS["uniform_midrise"]].rel_mse[i] == optimal_uniform_mse(2**b)[0]
        assert t[REFERENCE_LABELS["uniform_midtread"]].rel_mse[i] == optimal_uniform_mse(max(2, 2**b - 1))[0]
    assert [r.rel_mse for r in reference_rows()] == [t[label].rel_mse for label in REFERENCE_LABELS.values()]


def test_codecs_against_the_references(rows):
    t = by_label(rows)
    # q1 at its default (mean |x|) scale sits on the 1-bit optimum; the max-abs scale is worse than zeros
    assert t["default"].rel_mse[0] < 1 and t["default"].rel_mse[0] == pytest.approx(1 - 2 / math.pi, abs=0.01)
    assert t["max"].rel_mse[0] > 1 and t["max"].specs[0] == "q1:max"
    # no default-rounding variant is worse than sending zeros, at any width, except an explicit q1:max
    for r in rows:
        if r.kind == "codec" and r.label != "stochastic":
            errs = r.rel_mse[1:] if r.label == "max" else r.rel_mse
            assert max(errs) < 1, r.label
    shannon = t[REFERENCE_LABELS["shannon"]].rel_mse
    for r in rows:
        if r.kind == "codec":
            assert all(e > s for e, s in zip(r.rel_mse, shannon)), r.label


def test_l2_midrise_is_the_best_uniform_quantizer():
    # one scale for many samples: l2 clipping on the mid-rise grid puts the outermost level where Max's
    # optimal uniform quantizer has it, so the measured error matches the computed optimum
    rows = bench_quality([("tensor:l2:midrise", ":tensor:l2:midrise:scale32")], bits=(1, 2, 3, 4),
                         shape=(1024, 1024))
    for b, e in zip((1, 2, 3, 4), rows[0].rel_mse):
        assert e == pytest.approx(optimal_uniform_mse(2**b)[0], rel=0.02)


def test_variant_invalid_at_some_width_is_blank():
    rows = bench_quality([("mean", ":mean")], shape=(16, 64))
    assert rows[0].rel_mse[0] is not None and rows[0].rel_mse[1:] == [None] * 7
    assert rows[0].specs == ["q1"] + [None] * 7


def test_cli_writes_table_json_and_png(tmp_path, capsys):
    out, png = tmp_path / "q.json", tmp_path / "q.png"
    assert main(["bench", "codecs", "--quality", "--shape", "32,256", "--device", "cpu", "--json", str(out),
                 "--png", str(png)]) == 0
    text = capsys.readouterr().out
    assert "Shannon bound" in text and "best uniform" in text and "b=8" in text
    data = json.loads(out.read_text())
    assert data["benchmark"] == "codecs-quality"
    assert data["command"].startswith("aqsgd bench codecs --quality")
    assert data["data"]["gaussian"]["shape"] == [32, 256] and data["bits"] == list(BITS)
    assert len(data["rows"]) == len(DEFAULT_VARIANTS) + 3
    assert {(r["source"], r["tensor"]) for r in data["rows"]} == {("gaussian", "normal")}
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_cli_quality_codecs_png_conflict_and_png_needs_quality(tmp_path):
    assert main(["bench", "codecs", "--quality", "--codecs", "q4", "--png", str(tmp_path / "x.png"),
                 "--device", "cpu"]) == 2
    assert main(["bench", "codecs", "--png", str(tmp_path / "x.png"), "--device", "cpu"]) == 2


def test_cli_quality_of_named_codecs_measures_packet_bits(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["bench", "codecs", "--quality", "--codecs", "q2:l2", "q2:rot64:l2:midrise", "q2:l2:zstd",
                 "tah", "--shape", "16,512", "--device", "cpu", "--json", str(out)]) == 0
    assert "q2:rot64:l2:midrise" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["benchmark"] == "codecs-quality-specs"
    rows = {r["spec"]: r for r in data["rows"]}
    n = 16 * 512
    assert rows["q2:l2"]["bits_per_value"] == pytest.approx(8 * (64 + 512 * 2 + n // 4) / n)
    assert rows["q2:rot64:l2:midrise"]["bits_per_value"] == pytest.approx(8 * (64 + n // 64 * 2 + n // 4) / n)
    assert rows["q2:l2:zstd"]["rel_mse"] == rows["q2:l2"]["rel_mse"]  # lossless stage
    # rotated midrise tiles on Gaussian data: near the optimal 4-level uniform quantizer (0.119)
    assert rows["q2:rot64:l2:midrise"]["rel_mse"] < 0.13 < rows["q2:l2"]["rel_mse"]


def test_quality_option_misuse_is_one_line(capsys):
    from aqsgd.cli import main

    assert main(["bench", "codecs", "--device", "cpu", "--png", "x.png"]) == 2
    assert capsys.readouterr().err.strip() == "aqsgd: error: --png: plots the --quality table; add --quality"
    assert main(["bench", "codecs", "--device", "cpu", "--quality", "--codecs", "q2", "--png", "x.png"]) == 2
    assert "leave --codecs out" in capsys.readouterr().err
    assert main(["bench", "codecs", "--device", "cpu", "--quality", "--codecs", "q2:rot63"]) == 2
    err = capsys.readouterr().err
    assert "power of two" in err and err.count("\n") == 1


# --- real boundary tensors (--data minilm smollm2), on tiny random stand-ins of the two models --------------


def tiny_llama(vocab=96):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=128))


def tiny_bert(vocab=96, labels=5):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=6, num_attention_heads=4,
                                                    max_position_embeddings=128, num_labels=labels))


def lm_batch(n, seq=16, vocab=96, seed=0):
    ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def test_boundary_tensors_of_an_even_split():
    from aqsgd.bench.boundary import collect_boundary_tensors

    model = tiny_llama()
    probe = lm_batch(3)
    bt = collect_boundary_tensors(model, probe, [lm_batch(4, seed=s) for s in (1, 2)], stages=4, lr=1e-2,
                                  progress=False)
    assert bt.boundaries == [1, 2, 3]  # 5 blocks in 4 stages: 2, 1, 1, 1
    assert set(bt.tensors) == {"activation", "delta", "gradient"}
    for xs in bt.tensors.values():
        assert [tuple(x.shape) for x in xs] == [(3, 16, 32)] * 3
    assert (all(d.norm() > 0 for d in bt.tensors["delta"])
            and all(g.norm() > 0 for g in bt.tensors["gradient"]))
    # no steps: the same weights give the same activations, a zero delta
    still = collect_boundary_tensors(tiny_llama(), probe, [], stages=4, progress=False)
    assert all(d.abs().max() == 0 for d in still.tensors["delta"])
    assert torch.equal(still.tensors["activation"][0], bt.tensors["activation"][0])


def test_boundary_gradient_is_the_loss_gradient():
    from aqsgd.bench.boundary import collect_boundary_tensors, transformer_blocks

    model = tiny_llama().double()
    probe = lm_batch(2)
    bt = collect_boundary_tensors(model, probe, [], stages=2, progress=False)
    (i,), g = bt.boundaries, bt.tensors["gradient"][0]
    v = torch.randn(g.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    eps = 1e-3  # the loss is computed in float32 (transformers upcasts the logits), so not smaller

    def loss(shift):  # the loss with the boundary's output moved by shift
        h = transformer_blocks(model)[i].register_forward_hook(lambda m, inp, out: out + shift)
        with torch.no_grad():
            value = float(model(**probe).loss)
        h.remove()
        return value

    assert (loss(eps * v) - loss(-eps * v)) / (2 * eps) == pytest.approx(float((g * v).sum()), rel=1e-2)


def test_boundary_tensors_of_an_encoder_classifier():
    from aqsgd.bench.boundary import collect_boundary_tensors

    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(0))
    probe = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 1, 2, 3])}
    bt = collect_boundary_tensors(tiny_bert(), probe, [probe], stages=4, progress=False)
    assert bt.boundaries == [1, 3, 4]  # 6 blocks: 2, 2, 1, 1
    assert (all(g.norm() > 0 for g in bt.tensors["gradient"])
            and all(d.norm() > 0 for d in bt.tensors["delta"]))


@pytest.fixture(scope="module")
def sink_tensors():
    """Boundary tensors built like a Llama's: position 0 ~100x the rest in the activations (an attention
    sink)."""
    from aqsgd.bench.boundary import BoundaryTensors

    g = torch.Generator().manual_seed(0)
    acts = [torch.randn(4, 32, 64, generator=g) for _ in range(2)]
    for a in acts:
        a[:, 0] *= 100.0
    return BoundaryTensors([3, 7], {"activation": acts,
                                    "delta": [torch.randn(4, 32, 64, generator=g) for _ in range(2)],
                                    "gradient": [torch.randn(4, 32, 64, generator=g) * 1e-4
                                                 for _ in range(2)]})


def test_boundary_table_per_kind(sink_tensors):
    from aqsgd.bench.quality import boundary_quality, kurtosis

    rows = boundary_quality(sink_tensors, "smollm2")
    assert [r.tensor for r in rows] == [k for k in ("activation", "delta", "gradient")
                                        for _ in range(len(DEFAULT_VARIANTS) + 3)]
    assert {r.source for r in rows} == {"smollm2"}
    t = {(r.tensor, r.label): r for r in rows}
    for kind in ("activation", "delta", "gradient"):
        # the references are the Gaussian ones, labelled as such
        refs = [t[kind, "N(0,1) " + label] for label in REFERENCE_LABELS.values()]
        assert [r.rel_mse for r in refs] == [r.rel_mse for r in reference_rows()]
        # max-abs scales: the error falls with every added bit
        errs = t[kind, "max"].rel_mse
        assert all(a > b for a, b in itertools.pairwise(errs)), (kind, errs)
        # the figures are the means over the boundaries
        for r in rows:
            if r.kind == "codec" and r.tensor == kind:
                assert len(r.rel_mse_by_boundary) == len(BITS)
                for e, per in zip(r.rel_mse, r.rel_mse_by_boundary):
                    assert len(per) == 2 and e == pytest.approx(sum(per) / 2)
    # Gaussian deltas sit where the N(0, 1) table has them; the scale of the gradients does not matter
    gauss = by_label(bench_quality(shape=(4, 32, 64), seed=0))
    for label in ("default", "l2", "token"):
        for e, ref in zip(t["delta", label].rel_mse[1:], gauss[label].rel_mse[1:]):
            assert e == pytest.approx(ref, rel=0.25)
    assert kurtosis(sink_tensors.tensors["activation"][0]) > 30
    assert 2.5 < kurtosis(sink_tensors.tensors["delta"][0]) < 3.5  # Gaussian: 3


@pytest.fixture
def tiny_sources(monkeypatch):
    """``--data minilm smollm2`` on tiny random models and random tokens instead of the cached ones."""
    from aqsgd.bench import boundary

    def load(source, preset, seed):
        n = preset.micro_batch + 2 * preset.batch  # 2 AdamW steps, not the preset's
        if source == "smollm2":
            batch = lm_batch(n, seq=preset.seq_len, seed=seed)
            return tiny_llama(), [{"sample_id": i, **{k: v[i] for k, v in batch.items()}} for i in range(n)]
        ids = torch.randint(0, 96, (n, preset.seq_len), generator=torch.Generator().manual_seed(seed))
        return tiny_bert(), [{"sample_id": i, "input_ids": ids[i], "attention_mask": torch.ones_like(ids[i]),
                              "labels": torch.tensor(i % 5)} for i in range(n)]

    monkeypatch.setattr(boundary, "require_sources", lambda source: None)
    monkeypatch.setattr(boundary, "_load", load)


def test_cli_quality_on_model_tensors(tiny_sources, tmp_path, capsys):
    out, png = tmp_path / "q.json", tmp_path / "q.png"
    assert main(["bench", "codecs", "--quality", "--data", "all", "--shape", "16,64", "--device", "cpu",
                 "--json", str(out), "--png", str(png)]) == 0
    text = capsys.readouterr().out
    for title in ("N(0, 1) fp32 tensor", "smollm2 activations", "smollm2 deltas", "minilm gradients",
                  "N(0,1) Shannon bound", "kurtosis"):
        assert title in text
    data = json.loads(out.read_text())
    assert list(data["data"]) == ["gaussian", "minilm", "smollm2"]
    assert (data["data"]["smollm2"]["boundaries"] == [1, 2, 3]
            and data["data"]["minilm"]["boundaries"] == [1, 3, 4])
    assert data["data"]["smollm2"]["steps"] == 2 and len(data["data"]["minilm"]["kurtosis"]["delta"]) == 3
    groups = {}
    for r in data["rows"]:
        groups.setdefault((r["source"], r["tensor"]), []).append(r)
    assert list(groups) == [("gaussian", "normal")] + [(s, k) for s in ("minilm", "smollm2")
                                                       for k in ("activation", "delta", "gradient")]
    assert all(len(g) == len(DEFAULT_VARIANTS) + 3 for g in groups.values())
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_cli_quality_data_not_cached_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AQSGD_CACHE", str(tmp_path))
    assert main(["bench", "codecs", "--quality", "--data", "smollm2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'smollm2' is not prepared" in err and "aqsgd data prepare smollm2" in err
    assert main(["bench", "codecs", "--data", "minilm", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip() == ("aqsgd: error: --data: chooses the --quality data; add "
                                               "--quality")
