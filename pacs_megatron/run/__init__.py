"""The run directory's owner: its layout, its lock, its logs, its checkpoints and the resume rules.

- ``layout.py``: ``RunLayout`` / ``StepLayout``, the one place where the entries' names are spelled;
- ``run_dir.py``: the lock and the rules of a fresh start, a resume and an overwrite;
- ``metrics.py``: the one writer of both per-step JSONL files, TensorBoard and wandb;
- ``run_record.py``: the resolved configs and ``final.json``;
- ``launch_info.py``: ``launch.json``, where every rank ran;
- ``checkpoint.py``, ``checkpoint_check.py``, ``checkpoint_data.py``: save, find, validate and read checkpoints;
- ``resume.py``: what a resume may change and from which checkpoint it starts.

No module here imports megatron or starts a rank: the launcher's preflight uses them before any rank exists.
"""

from pacs_megatron.run.layout import RunLayout, StepLayout

__all__ = ["RunLayout", "StepLayout"]
