"""build_prompt_dataset: the trainer's view of data for the math and the synthetic task."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pacs_megatron.config import RunConfig, load_config
from pacs_megatron.data import PromptDataset, build_prompt_dataset, load_tokenizer
from pacs_megatron.data.synthetic import write_tiny_model_dir
from pacs_megatron.loop.build import prompt_records, prompt_run, train_dataset, val_datasets

CPU_TINY = Path(__file__).resolve().parents[2] / "examples" / "configs" / "cpu_tiny.yaml"


@pytest.fixture(scope="module")
def qwen_tok(data_root):
    return load_tokenizer(data_root / "tokenizers" / "qwen2.5", "qwen2.5")


def test_math_train_and_val(qwen_tok, tmp_path, data_root):
    extra = tmp_path / "mine.parquet"
    pq.write_table(pa.table({"problem": ["What is 2+2?"], "answer": ["4"]}), extra)
    cfg = load_config(
        None,
        [
            f"data.data_root={data_root}",
            f"data.train_files=[amc23,aime2024,{extra}]",
            "data.val_files=[aime2025,amc23]",
            "data.max_prompt_length=1024",
            "trainer.val_max_problems=7",
        ],
    )
    train = build_prompt_dataset(cfg.data, qwen_tok, "train", prompt_run(cfg))
    assert isinstance(train, PromptDataset) and len(train) == 71
    assert {r.source for r in train.records} == {"amc23", "aime2024", "mine"}
    batch = train.next_batch(100)
    assert len(batch) == 100 and all(r.prompt_text.endswith("<|im_start|>assistant\n") for r in batch)
    assert all("Please reason step by step" in r.prompt_text for r in batch)
    val = build_prompt_dataset(cfg.data, qwen_tok, "val", prompt_run(cfg))
    assert list(val) == ["aime2025", "amc23"] and [len(v) for v in val.values()] == [7, 7]
    assert [r.id for r in val["amc23"][:2]] == ["amc23-00", "amc23-01"]
    with pytest.raises(ValueError, match="split='test'"):
        build_prompt_dataset(cfg.data, qwen_tok, "test", prompt_run(cfg))


def test_arith_task_matches_the_cpu_default(tmp_path):
    cfg = load_config(CPU_TINY, [f"model.path={tmp_path}/m"])
    write_tiny_model_dir(cfg.model.path, cfg.model.tiny)
    tok = load_tokenizer(cfg.model.path, cfg.data.chat_template)
    train = build_prompt_dataset(cfg.data, tok, "train", prompt_run(cfg))
    assert len(train) == 25
    batch = train.next_batch(cfg.trainer.train_batch_size)  # 50: every problem twice
    assert sorted(r.id for r in batch[:25]) == sorted(r.id for r in batch[25:])
    rec = next(r for r in batch if r.problem == "3+4=")
    assert (rec.prompt_text, rec.answer, len(rec.prompt_ids)) == ("3+4=", "7", 4)
    assert tok.decode(list(rec.prompt_ids)) == "3+4="
    state = train.state_dict()
    nxt = [r.id for r in train.next_batch(50)]
    again = build_prompt_dataset(cfg.data, tok, "train", prompt_run(cfg))
    again.load_state_dict(state)
    assert [r.id for r in again.next_batch(50)] == nxt
    val = build_prompt_dataset(cfg.data, tok, "val", prompt_run(cfg))
    assert list(val) == ["arith"] and len(val["arith"]) == 25


def test_default_runconfig_resolves_shared_sets(qwen_tok, data_root, monkeypatch):
    monkeypatch.setenv("PACS_DATA_ROOT", str(data_root))
    cfg = RunConfig()
    # deepscaler_subset803, max_prompt_length 512
    train = build_prompt_dataset(cfg.data, qwen_tok, "train", prompt_run(cfg))
    assert 700 <= len(train) <= 803


def test_arith_prompts_go_through_the_same_length_check():
    from pacs_megatron.data.records import DataFormatError
    from pacs_megatron.data.synthetic import build_arith_tokenizer

    tok = build_arith_tokenizer()
    base = ["data.task=arith", "reward.fn=arith", "data.arith.max_operand=12", "data.arith.modulo=0"]
    base.append("trainer.test_freq=1")
    cfg = load_config(None, [*base, "data.max_prompt_length=5"])  # "1+2=" fits, "10+12=" does not
    train = train_dataset(cfg, tok)
    assert train.records and all(len(r.prompt_ids) <= 5 for r in train.records)
    assert len(train.records) == 10 * 10 + 2 * 10 * 3  # both operands < 10, or one of them (3 + 0..9 long)
    assert all(len(r.prompt_ids) <= 5 for r in val_datasets(cfg, tok)["arith"])
    with pytest.raises(DataFormatError, match=r"dataset arith: problem .* prompt tokens > data.max_prompt_length=5"):
        train_dataset(load_config(None, [*base, "data.max_prompt_length=5", "data.overlong_prompts=error"]), tok)


def test_a_row_names_the_tools_its_prompt_may_call(qwen_tok, tmp_path, data_root):
    """The task definition of tool-integrated rollouts: a row's ``tools`` list (``[]``: none, no instruction;
    absent: every enabled tool), checked against tools.enabled in one line; single-turn runs ignore it."""
    from pacs_megatron.data.records import DataFormatError

    rows = tmp_path / "tools.jsonl"
    rows.write_text(
        '{"id": "a", "problem": "What is 2+2?", "answer": "4", "tools": ["python"]}\n'
        '{"id": "b", "problem": "What is 3+3?", "answer": "6", "tools": []}\n'
        '{"id": "c", "problem": "What is 4+4?", "answer": "8"}\n'
    )
    base = [f"data.data_root={data_root}", f"data.train_files=[{rows}]", f"data.val_files=[{rows}]"]
    cfg = load_config(None, [*base, "rollout.multi_turn.max_turns=3", "trainer.test_freq=1"])
    records = {r.id: r for r in build_prompt_dataset(cfg.data, qwen_tok, "train", prompt_run(cfg)).records}
    assert [records[k].tools for k in "abc"] == [("python",), (), None]
    instruction = cfg.rollout.multi_turn.instruction
    assert [instruction in records[k].prompt_text for k in "abc"] == [True, False, True]
    assert len(prompt_records(cfg, qwen_tok)) == 6  # train + validation: what an engine rank learns tools from
    with pytest.raises(
        DataFormatError, match=r"problem 'a' may call tools \['python'\].*tools.enabled=\['x.y:search'\]"
    ):
        vcfg = load_config(None, [*base, "rollout.multi_turn.max_turns=3", "tools.enabled=[x.y:search]"])
        build_prompt_dataset(vcfg.data, qwen_tok, "val", prompt_run(vcfg))
    single_cfg = load_config(None, [*base, "tools.enabled=[x.y:search]"])
    single = build_prompt_dataset(single_cfg.data, qwen_tok, "train", prompt_run(single_cfg))
    assert (
        all(instruction not in r.prompt_text for r in single.records)
        and prompt_records(load_config(None, base), qwen_tok) == []
    )
    rows.write_text('{"id": "d", "problem": "What is 5+5?", "answer": "10", "tools": "python"}\n')
    with pytest.raises(DataFormatError, match=r"problem 'd' has tools='python': give a list of tool names"):
        build_prompt_dataset(cfg.data, qwen_tok, "train", prompt_run(cfg))
    # a column of that name meaning something else (function-calling sets hold schemas) is no error single-turn
    assert build_prompt_dataset(load_config(None, base).data, qwen_tok, "train").records[0].tools is None


def test_val_sets_keeps_the_named_sets_and_refuses_an_unknown_name(tmp_path):
    split = ["data.arith.test_fraction=0.2", "data.arith.val_fraction=0.2"]
    cfg = load_config(CPU_TINY, [f"model.path={tmp_path}/m", *split])
    write_tiny_model_dir(cfg.model.path, cfg.model.tiny)
    tok = load_tokenizer(cfg.model.path, cfg.data.chat_template)
    assert sorted(build_prompt_dataset(cfg.data, tok, "val", prompt_run(cfg))) == ["arith_heldout", "arith_val"]
    only = load_config(CPU_TINY, [f"model.path={tmp_path}/m", *split, "trainer.val_sets=[arith_heldout]"])
    assert list(build_prompt_dataset(only.data, tok, "val", prompt_run(only))) == ["arith_heldout"]
    bad = load_config(CPU_TINY, [f"model.path={tmp_path}/m", *split, "trainer.val_sets=[heldout]"])
    with pytest.raises(ValueError, match=r"trainer.val_sets names \['heldout'\].*'arith_heldout', 'arith_val'"):
        build_prompt_dataset(bad.data, tok, "val", prompt_run(bad))
