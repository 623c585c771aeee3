"""Dataset files: the shared sets (row counts from the data README), malformed rows, parquet formats."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pacs_megatron.data import DATASETS, DataFormatError, load_problems, resolve_dataset

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

README_ROWS = {
    "math500": 500,
    "aime2024": 30,
    "aime2025": 30,
    "amc23": 40,
    "gsm8k_test": 1319,
    "math_train": 7470,
    "aime_1983_2023": 975,
    "deepscaler_subset803": 803,
    "gsm8k_train": 7473,
}


def test_every_shared_set_loads_with_readme_row_counts(data_root):
    assert set(DATASETS) == set(README_ROWS)
    for name, rows in README_ROWS.items():
        got_name, path = resolve_dataset(name, data_root)
        problems = load_problems(path, source=got_name)
        assert (got_name, len(problems)) == (name, rows)
        assert len({p.id for p in problems}) == rows, f"{name}: ids not unique"
        assert all(p.problem.strip() and p.answer.strip() for p in problems)
    gsm = load_problems(resolve_dataset("gsm8k_test", data_root)[1])
    assert "1,600" in {p.answer for p in gsm}  # thousands separators kept, as PACS does
    m500 = load_problems(resolve_dataset("math500", data_root)[1])
    assert m500[17].id == "math500-017" and m500[17].source == "math500" and "solution" in m500[17].extra


def test_unknown_name_and_missing_file_are_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a known name"):
        resolve_dataset("math5000", tmp_path)
    with pytest.raises(FileNotFoundError, match="PACS_DATA_ROOT"):
        resolve_dataset("math500", tmp_path)
    bad = tmp_path / "x.csv"
    bad.write_text("a,b\n")
    with pytest.raises(DataFormatError, match="unsupported suffix"):
        resolve_dataset(str(bad), tmp_path)


@pytest.mark.parametrize(
    ("line", "needles"),
    [
        (2, ["line 2", "missing field 'answer'"]),
        (3, ["line 2", "field 'answer' is empty"]),
        (4, ["malformed_4.jsonl:2", "not valid JSON"]),
        (5, ["line 2", "field 'answer' must be a string, got int"]),
        (6, ["line 2", "expected a JSON object, got list"]),
    ],
)
def test_each_malformed_row_is_named(tmp_path, line, needles):
    lines = (FIXTURES / "malformed.jsonl").read_text().splitlines()
    f = tmp_path / f"malformed_{line}.jsonl"
    f.write_text(lines[0] + "\n" + lines[line - 1] + "\n")
    with pytest.raises(DataFormatError) as e:
        load_problems(f)
    msg = str(e.value)
    assert str(f) in msg
    for needle in needles:
        assert needle in msg


def test_error_mode_stops_at_first_bad_line_and_skip_mode_counts(caplog):
    path = FIXTURES / "malformed.jsonl"
    with pytest.raises(DataFormatError, match="line 2: missing field 'answer'"):
        load_problems(path, bad_records="error")
    with caplog.at_level("WARNING", logger="pacs_megatron"):
        problems = load_problems(path, bad_records="skip")
    assert [p.id for p in problems] == ["ok-1", "ok-2"]
    assert problems[1].source == "malformed" and problems[1].extra == {"level": 1}
    assert "skipped 5 malformed rows" in caplog.text


def test_parquet_plain_format(tmp_path):
    f = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"problem": ["1+1?", "2+2?"], "answer": ["2", "4"], "level": [1, 2]}), f)
    problems = load_problems(f)
    assert [(p.id, p.problem, p.answer, p.source, p.messages) for p in problems] == [
        ("plain-1", "1+1?", "2", "plain", None),
        ("plain-2", "2+2?", "4", "plain", None),
    ]
    assert problems[1].extra == {"level": 2}


def test_parquet_pacs_format(tmp_path):
    """The layout ritzz-ai/PACS writes: chat messages, reward_model.ground_truth, data_source, extra_info."""
    f = tmp_path / "pacs.parquet"
    rows = [
        {
            "data_source": "math_500",
            "prompt": [{"role": "user", "content": "What is 1+1? Please reason step by step."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "2"},
            "extra_info": {"split": "test", "index": 7, "answer": "2"},
        }
    ]
    pq.write_table(pa.Table.from_pylist(rows), f)
    (p,) = load_problems(f)
    assert p.answer == "2" and p.source == "math_500" and p.id == "pacs-7"
    assert p.messages == (("user", "What is 1+1? Please reason step by step."),)
    assert p.problem == "What is 1+1? Please reason step by step."

    bad = tmp_path / "pacs_bad.parquet"
    rows[0]["reward_model"] = {"style": "rule", "ground_truth": ""}
    pq.write_table(pa.Table.from_pylist(rows), bad)
    with pytest.raises(DataFormatError, match="row 1: field 'ground_truth' is empty"):
        load_problems(bad)


def test_json_list_format(tmp_path):
    f = tmp_path / "list.json"
    f.write_text('[{"problem": "p", "answer": "1"}, {"problem": "q"}]')
    with pytest.raises(DataFormatError, match="item 2: missing field 'answer'"):
        load_problems(f)
    assert len(load_problems(f, bad_records="skip")) == 1
