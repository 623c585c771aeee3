"""Tools a policy calls in tool-integrated rollouts, the sandbox their untrusted code runs in, and the pool that
runs many calls at once (docs/tools.md). ``pacs_megatron/tools/`` is something else: the CLI's commands.

- :mod:`.sandbox`: :class:`~.sandbox.Sandbox` runs one snippet in a fresh, limited process (bubblewrap, or
  by name and as root only ``rlimits-trusted``: :mod:`.levels`); :func:`~.sandbox.check_sandbox` refuses, in
  one line, a level the machine cannot give (preflight calls it). :mod:`.cgroup` caps a call's memory and
  processes as one; :mod:`.enter` is the call's first process (cgroup, namespaces, private uid).
- :mod:`.python_tool`: the built-in ``python`` tool (code in, the text the model sees out).
- :mod:`.registry`: tools by name; :class:`~.registry.Toolbox` calls one by name and never raises.
- :mod:`.pool`: :func:`~.pool.make_pool` runs a batch of calls on threads or Ray tasks, in input order.

To add a tool, write a function ``fn(arguments: dict, sandbox: Sandbox) -> str | ToolResult`` in any
importable module, run whatever is untrusted through ``sandbox.run(...)``, and list it in the config::

    tools:
      enabled: [python, my_pkg.my_tools:search]   # the model calls it as "search"
"""
