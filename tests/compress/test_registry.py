import pytest
import torch

from aqsgd.compress import CastCodec, QuantCodec, RawCodec, TopKCodec, make_codec
from aqsgd.errors import SpecError


@pytest.mark.parametrize(
    "spec,cls,canonical",
    [
        ("none", RawCodec, "none"),
        ("fp16", CastCodec, "fp16"),
        ("bf16", CastCodec, "bf16"),
        ("fp32", CastCodec, "fp32"),
        ("q4", QuantCodec, "q4"),
        ("q2:token", QuantCodec, "q2:token"),
        ("q3:block64:stochastic", QuantCodec, "q3:block64:stochastic"),
        ("q3:stochastic:block64", QuantCodec, "q3:block64:stochastic"),
        ("q8:channel:nearest:max:scale16", QuantCodec, "q8"),
        ("q5:tensor:l2:scale32", QuantCodec, "q5:tensor:l2:scale32"),
        ("topk0.1", TopKCodec, "topk0.1"),
        ("topk0.1+q8", TopKCodec, "topk0.1+q8:token"),
        ("topk0.3:tensor+bf16", TopKCodec, "topk0.3:tensor+bf16"),
    ],
)
def test_specs_parse_and_roundtrip(spec, cls, canonical):
    codec = make_codec(spec)
    assert isinstance(codec, cls) and codec.spec == canonical
    assert make_codec(codec.spec) == codec and make_codec(codec.spec).fingerprint == codec.fingerprint


def test_every_bit_width_exists():
    for b in range(1, 9):
        assert make_codec(f"q{b}").bits == b


@pytest.mark.parametrize("bad", ["", "q", "q0", "q9", "q4:foo", "q4:token:channel", "q4:block0", "q4:blockx",
                                 "topk", "topk0", "topk1.5", "topk0.1:foo", "topk0.1+none", "topk0.1+topk0.2",
                                 "int8", "fp8", "q4:nearest:stochastic"])
def test_invalid_specs_name_valid_choices(bad):
    with pytest.raises(ValueError) as info:
        make_codec(bad)
    assert isinstance(info.value, SpecError)
    assert "Valid:" in str(info.value) and "q<bits" in str(info.value)


def test_non_string_spec():
    with pytest.raises(SpecError):
        make_codec(4)  # type: ignore[arg-type]


def test_cuda_like_device_argument_roundtrip_cpu():
    x = torch.randn(2, 3, dtype=torch.float16)
    assert make_codec("q8").roundtrip(x).dtype == torch.float16


def test_unhashable_spec_is_a_spec_error():
    with pytest.raises(SpecError):
        make_codec(["q2"])  # type: ignore[arg-type]


@pytest.mark.parametrize("build", [lambda: QuantCodec(9), lambda: QuantCodec(4, granularity="row"),
                                   lambda: CastCodec("fp8"), lambda: TopKCodec(1.5),
                                   lambda: TopKCodec(0.1, values=RawCodec())])
def test_bad_codec_arguments_are_spec_errors(build):
    with pytest.raises(SpecError):
        build()
