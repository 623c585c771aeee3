"""The README's own-model path on every recipe with a GGUF default (issue 58, item 7): ``model.init=pretrained
model.path=DIR`` trains DIR (the recipe's ``model.gguf`` is dropped), ``model.gguf=null`` clears it, and a
leftover GGUF setting is refused with the fix. Old code: ``model.gguf is read only with model.init=gguf`` for
the README's command, and ``model.gguf=null`` read as the file name 'null'."""

from __future__ import annotations

from pathlib import Path

import pytest

from pacs_megatron.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"
GGUF_RECIPES = sorted(p.name for p in CONFIGS.glob("*.yaml") if load_config(p).model.init == "gguf")


def test_the_recipes_with_a_gguf_default_are_found():
    assert {"cpu_smollm2.yaml", "own_data.yaml", "cpu_smollm2_tools.yaml"} <= set(GGUF_RECIPES)


@pytest.mark.parametrize("name", GGUF_RECIPES)
def test_an_explicit_pretrained_path_wins(name):
    cfg = load_config(CONFIGS / name, ["model.init=pretrained", "model.path=/models/Mine"])
    assert (cfg.model.init, cfg.model.path, cfg.model.gguf) == ("pretrained", "/models/Mine", "")
    assert load_config(CONFIGS / name, ["model.gguf=null", "model.init=pretrained"]).model.gguf == ""
    assert load_config(CONFIGS / name, ["model.init=pretrained", "model.gguf=~"]).model.gguf == ""


def test_null_clears_and_a_leftover_gguf_names_the_fix():
    with pytest.raises(ConfigError, match=r"model.init=gguf needs model.gguf .*model.init=pretrained model.path=DIR"):
        load_config(CONFIGS / "own_data.yaml", ["model.gguf=null"])  # not the file 'null'
    with pytest.raises(ConfigError, match=r"clear it with model.gguf=null"):
        load_config(None, ["model.path=/m", "model.gguf=x.gguf"])
    # a GGUF given with init=pretrained on the command line is the user's own contradiction: refused, not dropped
    with pytest.raises(ConfigError, match=r"model.gguf is read only with model.init=gguf"):
        load_config(CONFIGS / "cpu_smollm2.yaml", ["model.init=pretrained", "model.gguf=other.gguf"])
