"""``pacs-megatron plot`` by default: validation pass@k drawn, curves constant by construction dropped."""

from pacs_megatron.cli import main as cli_main
from pacs_megatron.run.metrics import MetricsWriter
from pacs_megatron.tools.plot import DEFAULT_KEYS, read_metrics, select_keys


def test_default_keys_draw_pass_at_k_and_drop_constant_curves(tmp_path, capsys):
    w = MetricsWriter(tmp_path, enabled=True, tensorboard=False)
    for s in range(1, 7):
        row = {"reward/mean": 0.1 * s, "pacs/loss": 0.6931471805599453, "pacs/psi_abs_mean": 0.0}
        row |= {"pacs/post_loss": 0.69 - 0.01 * s, "pacs/post_classifier_acc": 0.5 + 0.05 * s}
        if s % 2 == 0:
            row |= {"val/arith/pass@1": 0.1 * s, "val/arith/pass@4": 0.15 * s}
        w.log(s, row)
    w.close()
    keys = select_keys({"run": read_metrics(tmp_path)}, list(DEFAULT_KEYS))
    assert keys[:5] == [
        "reward/mean",
        "val/arith/pass@1",
        "val/arith/pass@4",
        "pacs/post_loss",
        "pacs/post_classifier_acc",
    ]
    assert "pacs/loss" not in keys and "pacs/psi_abs_mean" not in keys
    assert "pacs/loss" in select_keys({"run": read_metrics(tmp_path)}, ["pacs/*"], keep_constant=True)

    assert cli_main(["plot", str(tmp_path)]) == 0
    assert "constant in every run: pacs/loss" in capsys.readouterr().err
    assert (tmp_path / "plots" / "curves.png").read_bytes()[:4] == b"\x89PNG"
