"""What the launcher checks before any rank or model starts (docs/launch.md, "Preflight").

- ``preflight``: the file system, the imports, the model directory, the data, the chat template;
- ``device``: what needs the device or an import (the rollout engine's package, quantized rollouts, routing replay);
- ``tools``: tool-integrated rollouts (the sandbox starts, every tool loads, the template renders a tool turn).

Each name has one import path, its module's (nothing is re-exported here).
"""
