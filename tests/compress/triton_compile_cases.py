"""Every Triton kernel compiled for an H100 (``sm_90``) on this machine, no GPU needed: Triton's compiler and
its ``ptxas`` run on the CPU. The interpreter runs the kernels' Python, not their compilation, so a kernel it
accepts may still fail to compile for a device (Triton 3.2 did not resolve ``tl`` in kernels defined inside
a function). Run in a process of its own without ``TRITON_INTERPRET`` (``test_triton_kernels.py``). Checked in
the PTX as well: the quantizer's one rounding (``fma.rn``), the scales' correctly rounded divisions
(``div.rn``), and no contraction elsewhere (the cache update rounds twice, as the CPU does)."""

from __future__ import annotations

import inspect
import os

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip("compiles for a device: run without TRITON_INTERPRET", allow_module_level=True)

from aqsgd.compress.kernels._triton_jit import HIST_MASKED, KERNELS  # noqa: E402

F32, F16, U8, I32, I64 = "*fp32", "*fp16", "*u8", "*i32", "*i64"
MAX = {"x_ptr": F32, "out_ptr": F32, "stored_ptr": F16, "flag_ptr": I32, "R": "i32", "K": "i32",
       "qmax": "fp32"}
DELTA = {"x_ptr": F32, "st_ptr": F16, "ids_ptr": I64, "out_ptr": F32, "R": "i32", "K": "i32", "rpb": "i32"}
TOPK_HIST = {"x_ptr": I32, "phist_ptr": I32, "pprev_ptr": I32, "state_ptr": I32, "hist_ptr": I32, "n": "i32",
             "chunk": "i32", "k": "i32"}
# (kernel, argument types, constexprs): every kernel, the variants the library launches where they differ
CASES = [
    ("scales", {"s_ptr": F32, "stored_ptr": F16, "inv_ptr": F32, "step_ptr": F32, "flag_ptr": I32, "G": "i32",
                "qmax": "fp32", "divisor": "fp32"}, {"HALF": True, "STEP": True, "BLOCK": 1024}),
    ("scales", {"s_ptr": F32, "stored_ptr": F32, "inv_ptr": F32, "step_ptr": F32, "flag_ptr": I32, "G": "i32",
                "qmax": "fp32", "divisor": "fp32"}, {"HALF": False, "STEP": False, "BLOCK": 1024}),
    ("steps", {"stored_ptr": F16, "step_ptr": F32, "flag_ptr": I32, "G": "i32", "divisor": "fp32"},
     {"BLOCK": 1024}),
    ("rowmax", MAX, {"SCALES": True, "HALF": True, "BLOCK_R": 16, "BLOCK_K": 128}),
    ("rowmax_partial", {"x_ptr": F32, "out_ptr": F32, "R": "i32", "K": "i32", "CHUNK": "i32"},
     {"BLOCK_R": 16, "BLOCK_K": 128}),
    ("row_max_quant_pack", {"x_ptr": F32, "stored_ptr": F16, "flag_ptr": I32, "out_ptr": U8, "R": "i32",
                            "K": "i32", "offset": "fp32", "qmax": "fp32"},
     {"HALF": True, "BITS": 4, "BLOCK_R": 16, "BLOCK_K": 128, "BLOCK_G": 16}),
    ("colmax", {**MAX, "CHUNK": "i32"}, {"SCALES": True, "HALF": True, "PARTIAL": False, "BLOCK_R": 16,
                                         "BLOCK_K": 128}),
    ("colmax", {**MAX, "stored_ptr": F32, "CHUNK": "i32"}, {"SCALES": False, "HALF": False, "PARTIAL": True,
                                                            "BLOCK_R": 16, "BLOCK_K": 128}),
    ("colmax_finish", {"part_ptr": F32, "out_ptr": F32, "stored_ptr": F16, "flag_ptr": I32, "S": "i32",
                       "K": "i32", "qmax": "fp32"}, {"SCALES": True, "HALF": True, "BLOCK_K": 128}),
    ("quant_pack", {"x_ptr": F32, "inv_ptr": F32, "noise_ptr": F32, "out_ptr": U8, "R": "i32", "K": "i32",
                    "offset": "fp32", "qmax": "fp32"},
     {"BY_COL": True, "BITS": 3, "NOISE": False, "BLOCK_R": 16, "BLOCK_G": 16}),
    ("unpack_dequant", {"p_ptr": U8, "step_ptr": F16, "out_ptr": F32, "flag_ptr": I32, "R": "i32", "K": "i32",
                        "mul": "fp32", "low": "fp32", "divisor": "fp32"},
     {"BY_COL": False, "BITS": 4, "SCALES": True, "BLOCK_R": 16, "BLOCK_G": 16}),
    ("delta_rowmax", DELTA, {"BF16": False, "BLOCK_R": 16, "BLOCK_K": 128}),
    ("delta_colmax", {**DELTA, "st_ptr": "*i16", "CHUNK": "i32"}, {"BF16": True, "BLOCK_R": 16,
                                                                   "BLOCK_K": 128}),
    ("delta_into", DELTA, {"BF16": False, "BLOCK_R": 16, "BLOCK_K": 128}),
    ("delta_quant_update", {"x_ptr": F32, "st_ptr": F32, "ids_ptr": I64, "inv_ptr": F32, "step_ptr": F32,
                            "out_ptr": U8, "R": "i32", "K": "i32", "rpb": "i32", "offset": "fp32",
                            "qmax": "fp32", "mul": "fp32", "low": "fp32"},
     {"BY_COL": True, "BITS": 2, "BF16": False, "BLOCK_R": 16, "BLOCK_G": 16}),
    ("delta_dequant_update", {"p_ptr": U8, "st_ptr": F32, "ids_ptr": I64, "step_ptr": F32, "out_ptr": F32,
                              "R": "i32", "K": "i32", "rpb": "i32", "mul": "fp32", "low": "fp32"},
     {"BY_COL": False, "BITS": 4, "BF16": False, "BLOCK_R": 16, "BLOCK_G": 16}),
    ("fwht_rows", {"x_ptr": F32, "s_ptr": F32, "out_ptr": F32, "c": "fp32", "R": "i32"},
     {"G": 64, "LOG_G": 6, "INVERSE": False, "BLOCK_R": 64}),
    ("topk_hist", TOPK_HIST, {"SHIFT": 20, "NB": 2048, "HIGH": 0, "PICK": False, "PSHIFT": 20, "PNB": 2048,
                              "PFIRST": False, "MASKED": False, "BLOCK": 1024}),
    ("topk_hist", TOPK_HIST, {"SHIFT": 9, "NB": 2048, "HIGH": 0x7FF00000, "PICK": True, "PSHIFT": 20,
                              "PNB": 2048, "PFIRST": True, "MASKED": HIST_MASKED, "BLOCK": 1024}),
    ("topk_hist", TOPK_HIST, {"SHIFT": 0, "NB": 512, "HIGH": 0x7FFFFE00, "PICK": True, "PSHIFT": 9,
                              "PNB": 2048, "PFIRST": False, "MASKED": HIST_MASKED, "BLOCK": 1024}),
    # 8-bit digits (the default): the first pass and a later one
    ("topk_hist", TOPK_HIST, {"SHIFT": 23, "NB": 256, "HIGH": 0, "PICK": False, "PSHIFT": 23, "PNB": 256,
                              "PFIRST": False, "MASKED": False, "BLOCK": 1024}),
    ("topk_hist", TOPK_HIST, {"SHIFT": 7, "NB": 256, "HIGH": 0x7FFF8000, "PICK": True, "PSHIFT": 15,
                              "PNB": 256, "PFIRST": False, "MASKED": HIST_MASKED, "BLOCK": 1024}),
    ("topk_count", {"x_ptr": I32, "phist_ptr": I32, "pprev_ptr": I32, "state_ptr": I32, "counts_ptr": I32,
                    "n": "i32", "chunk": "i32", "nchunk": "i32", "k": "i32"},
     {"PSHIFT": 0, "PNB": 512, "BLOCK": 1024}),
    ("topk_count", {"x_ptr": I32, "phist_ptr": I32, "pprev_ptr": I32, "state_ptr": I32, "counts_ptr": I32,
                    "n": "i32", "chunk": "i32", "nchunk": "i32", "k": "i32"},
     {"PSHIFT": 0, "PNB": 128, "BLOCK": 1024}),  # the last of the 8-bit digits has 7 bits
    ("topk_write", {"x_ptr": I32, "state_ptr": I32, "counts_ptr": I32, "idx_ptr": I64, "vals_ptr": F16,
                    "ib_ptr": U8, "bad_ptr": I32, "n": "i32", "k": "i32", "chunk": "i32", "nchunk": "i32"},
     {"PACK": True, "FMT": 1, "WIDTH": 2, "BLOCK": 1024, "CBLOCK": 128}),
    ("cast_checked", {"x_ptr": F32, "y_ptr": F16, "flag_ptr": I32, "N": "i32"},
     {"BF16": False, "BLOCK": 4096}),
    ("cast_checked", {"x_ptr": F32, "y_ptr": "*i16", "flag_ptr": I32, "N": "i32"},
     {"BF16": True, "BLOCK": 4096}),
    ("row_sumsq", {"x_ptr": F32, "out_ptr": F32, "R": "i32", "D": "i32"}, {"BLOCK_R": 16, "BLOCK_K": 128}),
    ("split_rows", {"x_ptr": F32, "idx_ptr": I64, "rest_ptr": F32, "apart_ptr": "*i16", "D": "i32",
                    "k": "i32"}, {"BLOCK_D": 128, "BLOCK_I": 16}),
]


def _ptx(name: str, types: dict, consts: dict) -> str:
    kernel = KERNELS[name]
    assert set(inspect.signature(kernel.fn).parameters) == set(types) | set(consts), name  # table up to date
    signature = {**types, **{k: "constexpr" for k in consts}}
    if "constexprs" in inspect.signature(ASTSource.__init__).parameters:  # Triton >= 3.3
        source = ASTSource(fn=kernel, signature=signature, constexprs=consts)
    else:
        source = ASTSource(fn=kernel, signature=signature, constants=consts)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
    return compiled.asm["ptx"]


def test_the_table_names_every_kernel():
    assert {name for name, _, _ in CASES} == set(KERNELS)


@pytest.mark.parametrize("name, types, consts", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_the_kernel_compiles_for_sm90(name, types, consts):
    ptx = _ptx(name, types, consts)
    assert ".target sm_90" in ptx
    if name in ("quant_pack", "delta_quant_update", "row_max_quant_pack"):
        assert "fma.rn.f32" in ptx  # tl.fma: one rounding, as the CPU's addcmul
    if name == "delta_dequant_update":  # m + level * step rounds twice, as the CPU's add of the decode
        assert "fma" not in ptx and ("mul.rn.f32" in ptx or "mul.f32" in ptx)
    scaled = name in ("scales", "steps", "unpack_dequant", "row_max_quant_pack") or (
        name in ("rowmax", "colmax", "colmax_finish") and consts["SCALES"])
    if scaled:
        assert "div.rn" in ptx  # correctly rounded, as PyTorch divides
