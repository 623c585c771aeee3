"""``pacs-megatron compare``: the protocol and its CLI (protocol.py), its runs (runs.py), the committed runs
(results.py), and what it writes (report.py, paired.py). The protocol: docs/compare.md."""
