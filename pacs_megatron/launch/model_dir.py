"""Is this a usable Hugging Face model directory? One check, used by every command that reads one.

``train`` (launch/checks/preflight.py: ``model.path``, ``model.tokenizer``, ``critic.init``), ``eval --model``,
``parity --hf-model`` and ``export --model-dir`` all call :func:`check_model_dir` before any rank starts
or any model loads, and get the same answer in the same words: a :class:`ConfigError` naming the key
(a config key or a flag) and the fix.

What it checks, cheapest first, all without reading a tensor:

- the directory exists (and is not a training run's output dir: that one is named, with the export
  command that makes a model of it); a ``.gguf`` file is pointed to ``model.init=gguf`` / ``import-gguf``, and
  a Hugging Face hub id (``Qwen/Qwen2.5-0.5B-Instruct``), which nothing here downloads, to ``hf download``;
- ``config.json`` parses and has a ``model_type``;
- weights (when asked for): ``model.safetensors`` or an index whose shards all exist (a directory with only
  ``pytorch_model.bin`` is told how to convert it once: pickled weights are not loaded); each file's
  header is read with safetensors' ``safe_open`` (~ms per file: it maps the file, reads no data), which
  refuses a truncated file ("incomplete metadata, file not fully covered"); the shapes in the headers
  must agree with ``config.json`` (vocabulary, width, layers, heads, MLP width) wherever the tensor names
  follow the Qwen / Llama layout (``model.embed_tokens``, ``model.layers.N.*``);
- a tokenizer (when asked for): one of :data:`TOKENIZER_FILES`.

It lives in utils/ because its callers span launch/, tools/ and the ranks; hf/io.py (the reader of
the same files) imports megatron through its package, which a command must not need for a check.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pacs_megatron.config.base import ConfigError
from pacs_megatron.run.layout import RunLayout
from pacs_megatron.utils.paths import named

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Any one of these makes a directory loadable by ``AutoTokenizer`` (fast, sentencepiece or BPE files)."""
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""``owner/name`` as the Hugging Face hub spells a model (a relative path of two parts looks the same: it is
only taken for a hub id when no such path exists)."""


def missing_dir_hint(directory: str | Path) -> str:
    """Why a model path that is not a directory is not one, and the way forward ('' when nothing is known).

    Example:
        >>> missing_dir_hint("Qwen/Qwen2.5-0.5B-Instruct").split(":")[0]
        'hub ids are not downloaded'
    """
    d = Path(directory)
    if d.suffix.lower() == ".gguf":
        return (
            "a .gguf file is not a model directory: train from it with model.init=gguf model.gguf="
            f"{d} model.path=DIR (imported into DIR on the first start), or convert it once with pacs-megatron "
            f"import-gguf --gguf {d} --out DIR and point at DIR"
        )
    if not d.exists() and _HUB_ID.match(str(directory)):
        local = f"models/{d.name}"
        return (
            f"hub ids are not downloaded: fetch it once with hf download {directory} --local-dir {local} "
            f"(pip install huggingface_hub), then point at {local}"
        )
    return ""


def run_dir_hint(directory: str | Path) -> str:
    """For a training run's output dir given as a model: how to make a model of it ('' otherwise)."""
    run = RunLayout(Path(directory))
    if not run.has_run():
        return ""
    if (run.export / "config.json").is_file():
        return f"; this is a training run's output dir: its exported model is {run.export}"
    ckpts = run.checkpoint_steps()
    step = ckpts[-1][1].path if ckpts else run.step_example
    return f"; this is a training run's output dir: export a model first (pacs-megatron export {step} {run.export})"


def read_hf_config(key: str, directory: str | Path) -> dict:
    """``directory/config.json`` parsed, or ConfigError naming ``key`` and what is wrong."""
    d, where = Path(directory), named(key, directory)
    if not d.is_dir():
        hint = missing_dir_hint(d)
        what = "is a file, not a directory" if d.exists() else "no such directory"
        fix = hint or "point it at a Hugging Face model directory (config.json, weights)"
        raise ConfigError(f"{where}: {what}; {fix}")
    path = d / "config.json"
    if not path.is_file():
        raise ConfigError(f"{where} has no config.json: point it at a Hugging Face model directory{run_dir_hint(d)}")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: {path} is not valid JSON ({e}): restore it from the model's source") from None
    if not isinstance(hf, dict) or "model_type" not in hf:
        raise ConfigError(f"{where}: {path} has no model_type: not a Hugging Face model config")
    return hf


def weight_files(key: str, directory: str | Path) -> list[Path]:
    """The safetensors files of ``directory`` (one, or the index's shards), or ConfigError."""
    d, where = Path(directory), named(key, directory)
    if (d / INDEX).is_file():
        try:
            weight_map = json.loads((d / INDEX).read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{where}: {d / INDEX} is not a safetensors index ({e}): restore it") from None
        files = [d / f for f in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError(
                f"{where}: {INDEX} names shards that are missing ({', '.join(missing[:3])}): download them"
            )
        return files
    files = sorted(d.glob("*.safetensors"))
    pickled = sorted(p.name for p in d.glob("pytorch_model*.bin"))
    if not files and pickled:
        raise ConfigError(
            f"{where} holds {pickled[0]} (PyTorch pickle) but no *.safetensors: pickled weights are not loaded "
            '(unpickling can run code); convert them once with python -c "from transformers import '
            f"AutoModelForCausalLM as M; M.from_pretrained('{d}').save_pretrained('{d}')\" (writes "
            "model.safetensors beside them)"
        )
    if not files:
        raise ConfigError(
            f"{where} holds no *.safetensors weights: download the model's weights there (a training run's "
            f"model folder has none: export a checkpoint with pacs-megatron export){run_dir_hint(d)}"
        )
    return files


def weight_shapes(key: str, directory: str | Path) -> dict[str, list[int]]:
    """Tensor name -> shape from the safetensors headers (no data read); ConfigError for an unreadable file."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for f in weight_files(key, directory):
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    shapes[name] = list(handle.get_slice(name).get_shape())
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for damaged files
            raise ConfigError(
                f"{named(key, directory)}: {f.name} is damaged ({str(e).splitlines()[0]}; {f.stat().st_size} bytes): "
                "download or export it again"
            ) from None
    return shapes


def shape_mismatches(hf: dict, shapes: dict[str, list[int]]) -> list[str]:
    """Where config.json and the weights disagree (checked for the Qwen / Llama tensor names present).

    Example:
        >>> hf = {"vocab_size": 16, "hidden_size": 8, "num_hidden_layers": 1}
        >>> shape_mismatches(hf, {"model.embed_tokens.weight": [16, 4], "model.layers.0.mlp.up_proj.weight": [8, 4]})
        ['hidden_size=8 but model.embed_tokens.weight is [16, 4] (vocab_size x hidden_size)']
    """
    out = []
    vocab, hidden = hf.get("vocab_size"), hf.get("hidden_size")
    embed = shapes.get("model.embed_tokens.weight")
    if embed and len(embed) == 2:
        if vocab is not None and embed[0] != vocab:
            out.append(f"vocab_size={vocab} but model.embed_tokens.weight is {embed} (vocab_size x hidden_size)")
        if hidden is not None and embed[1] != hidden:
            out.append(f"hidden_size={hidden} but model.embed_tokens.weight is {embed} (vocab_size x hidden_size)")
    layers = {int(m.group(1)) for m in map(_LAYER.match, shapes) if m}
    if layers and hf.get("num_hidden_layers") is not None and max(layers) + 1 != hf["num_hidden_layers"]:
        out.append(f"num_hidden_layers={hf['num_hidden_layers']} but the weights hold {max(layers) + 1} layers")
    heads = hf.get("num_attention_heads")
    head_dim = hf.get("head_dim") or (hidden // heads if hidden and heads else None)
    for proj, n_heads in (("q_proj", heads), ("k_proj", hf.get("num_key_value_heads") or heads)):
        got = shapes.get(f"model.layers.0.self_attn.{proj}.weight")
        if got and n_heads and head_dim and got[0] != n_heads * head_dim:
            out.append(f"{proj} of layer 0 is {got} but config.json gives {n_heads} heads x head_dim {head_dim}")
    gate = shapes.get("model.layers.0.mlp.gate_proj.weight")
    if gate and hf.get("intermediate_size") and gate[0] != hf["intermediate_size"]:
        out.append(f"intermediate_size={hf['intermediate_size']} but model.layers.0.mlp.gate_proj.weight is {gate}")
    return out


def check_tokenizer(key: str, directory: str | Path) -> None:
    """``directory`` holds a tokenizer (one of :data:`TOKENIZER_FILES`), or ConfigError naming ``key``."""
    d, where = Path(directory), named(key, directory)
    if not d.is_dir():
        raise ConfigError(f"{where}: no such tokenizer directory")
    if not any((d / f).is_file() for f in TOKENIZER_FILES):
        flag = "--tokenizer DIR" if key.startswith("--") else "model.tokenizer=DIR"
        raise ConfigError(
            f"{where} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): copy the model's tokenizer files "
            f"there, or name the directory that holds them ({flag})"
        )


def check_model_dir(
    key: str,
    directory: str | Path,
    weights: bool = True,
    tokenizer: bool = True,
    tokenizer_key: str = "",
    tokenizer_dir: str | Path | None = None,
) -> dict:
    """Validate a model directory (see the module docstring); return its parsed config.json.

    ``tokenizer_dir`` (named by ``tokenizer_key``) replaces ``directory`` as the tokenizer's home when given.
    """
    hf = read_hf_config(key, directory)
    if weights:
        problems = shape_mismatches(hf, weight_shapes(key, directory))
        if problems:
            raise ConfigError(
                f"{named(key, directory)}: config.json disagrees with the weights ({'; '.join(problems[:2])}): "
                "use the config.json that came with these weights"
            )
    if tokenizer:
        if tokenizer_dir:
            check_tokenizer(tokenizer_key or key, tokenizer_dir)
        else:
            check_tokenizer(key, directory)
    return hf
