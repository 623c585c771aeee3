"""The one model-directory check every command uses (launch/model_dir.py): each damage a user's copy of a
model can have is one ConfigError naming the key and the fix, found from the files' headers alone."""

from __future__ import annotations

import json

import pytest
from _bad_inputs import broken_models, make_hf_model

from pacs_megatron.config import ConfigError
from pacs_megatron.launch.model_dir import check_model_dir, shape_mismatches


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    good = make_hf_model(root / "good")
    return {"good": good, **broken_models(good, root)}


@pytest.mark.parametrize(
    ("name", "kwargs", "words"),
    [
        ("no_weights", {}, r"--model '?.*no_weights'? holds no \*.safetensors weights: .*pacs-megatron export"),
        ("no_tokenizer", {}, r"holds no tokenizer \(none of tokenizer.json.*--tokenizer DIR"),
        ("truncated", {}, r"model.safetensors is damaged \(.*incomplete metadata.*download or export it again"),
        ("mismatch", {}, r"config.json disagrees with the weights \(hidden_size=32 but model.embed_tokens"),
        ("bad_json", {"weights": False}, r"config.json is not valid JSON \(Expecting"),
    ],
)
def test_each_damage_is_one_line_naming_the_key(models, name, kwargs, words):
    with pytest.raises(ConfigError, match=words) as info:
        check_model_dir("--model", models[name], **kwargs)
    assert "\n" not in str(info.value)


def test_a_good_model_passes_and_what_is_not_asked_for_is_not_checked(models, tmp_path):
    hf = check_model_dir("model.path", models["good"])
    assert hf["model_type"] == "qwen2"
    check_model_dir("model.path", models["no_weights"], weights=False)  # model.init=random needs no weights
    check_model_dir("model.path", models["no_tokenizer"], tokenizer=False)
    check_model_dir("--hf-model", models["no_tokenizer"], tokenizer_key="--tokenizer", tokenizer_dir=models["good"])
    with pytest.raises(ConfigError, match=r"model.path='/no/such': no such directory"):
        check_model_dir("model.path", "/no/such")
    with pytest.raises(ConfigError, match=r"is a file, not a directory"):
        check_model_dir("model.path", models["good"] / "config.json")


def test_a_run_dir_is_named_with_the_export_that_makes_a_model_of_it(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "checkpoints" / "step_00000002" / "COMPLETE").write_text("{}")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match=r"training run's output dir: export a model first \(pacs-megatron export "):
        check_model_dir("--hf-model", run)


def test_sharded_weights_need_every_shard_and_shapes_are_compared(models, tmp_path):
    d = tmp_path / "sharded"
    d.mkdir()
    for f in models["good"].iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors", "x": "model-00002.st"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"names shards that are missing \(model-00002.st\)"):
        check_model_dir("model.path", d)
    hf = {"vocab_size": 10, "hidden_size": 4, "num_hidden_layers": 2, "num_attention_heads": 2}
    shapes = {"model.embed_tokens.weight": [10, 4], "model.layers.1.self_attn.q_proj.weight": [4, 4]}
    assert shape_mismatches(hf, shapes) == []
    assert shape_mismatches({**hf, "vocab_size": 12}, shapes) == [
        "vocab_size=12 but model.embed_tokens.weight is [10, 4] (vocab_size x hidden_size)"
    ]
    assert "the weights hold 2 layers" in shape_mismatches({**hf, "num_hidden_layers": 4}, shapes)[0]


def test_pickled_weights_a_gguf_file_and_a_hub_id_are_told_the_way_forward(models, tmp_path, monkeypatch):
    """Fails on the old code, which said "download the weights", "is a file" and "no such directory"."""
    import shutil

    pickled = tmp_path / "pickled"
    shutil.copytree(models["no_weights"], pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ConfigError, match=r"holds pytorch_model.bin \(PyTorch pickle\).*save_pretrained") as e:
        check_model_dir("model.path", pickled)
    assert "\n" not in str(e.value)
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match=r"is a file, not a directory; a .gguf file .*model.init=gguf.*import-gguf"):
        check_model_dir("model.path", gguf)
    monkeypatch.chdir(tmp_path)
    hub = r"model.path='Qwen/Qwen2.5-0.5B-Instruct': no such directory; hub ids are not downloaded: .*hf download"
    with pytest.raises(ConfigError, match=hub):
        check_model_dir("model.path", "Qwen/Qwen2.5-0.5B-Instruct")
    with pytest.raises(ConfigError, match=r"no such directory; point it at a Hugging Face model directory"):
        check_model_dir("model.path", "/no/such/dir")  # an absolute path is never a hub id
