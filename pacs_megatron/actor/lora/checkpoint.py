"""LoRA checkpoints that hold the adapters, not the frozen base (issue 43; docs/lora.md "Checkpoints").

actor/checkpoint.py writes and reads them; this module decides what goes in and rebuilds the model on load:

* :func:`save_record` (collective): adapters only, or the whole model. Adapters only while the base can be
  rebuilt from ``model.path``: rank 0 could hash the base (run/checkpoint_base.py), every rank still holds the
  adapters each PACS v2 reset merged into the base (``lora.lora_merges``), and those take fewer bytes than the
  base. Otherwise the checkpoint holds the (merged) base, as before this module, and the merges are dropped:
  every later checkpoint of the process holds the base too. The record goes into ``extra_state.json``;
* :func:`model_entries` / :func:`merge_entries`: the model's sharded state cut to the adapters, and every merged
  adapter as a ShardedTensor beside its adapter (``lora_merges.K.<the adapter's key>``, same sharding, so it
  reshards at another layout);
* :func:`check_load` (collective): the checkpoint's LoRA-ness must be the actor's, and an adapter-only one's
  base hash this run's base's (rank 0 hashes; cached per process, so a resume hashes once): one line if not;
  :func:`check_legacy` refuses a TP > 1 LoRA checkpoint from before the fix of ``linear_fc1``'s layout;
* :func:`load_model`: the loaded adapters into the chunks and the merges replayed onto the base they were
  built with, oldest first, in the reset's own arithmetic (``lora.replay_merges``): the base of the saved run,
  bit for bit at the same layout (tests/actor/lora/test_lora_checkpoint.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from pacs_megatron.actor.lora.adapters import lora_modules, replay_merges
from pacs_megatron.actor.weights import unwrap
from pacs_megatron.config import ConfigError, ModelConfig
from pacs_megatron.parallel import ParallelGroups
from pacs_megatron.run.checkpoint_base import BaseModel, base_problem, describe_base
from pacs_megatron.run.checkpoint_data import load_common, read_metadata
from pacs_megatron.run.layout import StepLayout
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

FACTORS = ("lora_a", "lora_b")
"""An adapter's two factors, by their attribute names (actor/lora/adapters.py)."""
MERGES = "lora_merges"
"""The checkpoint's entry (and key prefix) of the merged adapters."""


def adapters_only(record: dict | None) -> bool:
    """Whether a checkpoint with this LoRA record leaves the base out."""
    return bool(record and record.get("adapters_only"))


def this_base(model: ModelConfig, model_dir: str, groups: ParallelGroups) -> BaseModel:
    """The base a model built from ``model`` at ``model_dir`` on these ranks has (hashed; cached per process)."""
    layout = {"tp": groups.tp_size, "pp": groups.pp_size, "vpp": groups.vpp_size, "ep": groups.ep_size}
    return describe_base(model.init, model_dir, model.seed, layout, groups.device.type == "cuda")


def save_record(actor) -> dict | None:
    """Collective: the LoRA record of the next save (run/checkpoint_base.py), None without LoRA (see the
    module docstring for when it leaves the base out)."""
    lora = actor.sections.actor.lora
    if not lora.enabled:
        return None
    modules = [m for c in actor.model for m in lora_modules(unwrap(c)).values()]
    kept = [m.lora_merges for m in modules]
    base = None
    if actor.groups.rank == 0:
        try:
            base = this_base(actor.sections.model, actor.model_dir, actor.groups).as_dict()
        except (OSError, ValueError) as e:  # the base's files went away: the checkpoint keeps it then
            logger.warning("LoRA checkpoint: cannot hash the base (%s); saving it whole", e)
    merged = sum(t.nbytes for merges in kept if merges for a, b, _ in merges for t in (a, b))
    frozen = sum(p.nbytes for c in actor.model for p in c.parameters() if not p.requires_grad)
    lost = any(merges is None for merges in kept) or (actor.groups.rank == 0 and base is None)
    votes = torch.tensor([merged, frozen, float(lost)], dtype=torch.float64, device=actor.groups.device)
    dist.all_reduce(votes)  # one decision on every rank: their sharded states must agree
    only = bool(votes[2] == 0 and votes[0] < votes[1])
    if not only:
        for m in modules:
            m.lora_merges = None
    return {
        "adapters_only": only,
        "rank": lora.rank,
        "alpha": lora.alpha,
        "targets": sorted(lora.targets),
        "merges": [s for _, _, s in kept[0]] if only and kept and kept[0] is not None else None,
        "base": base,
    }


def model_entries(sd: dict) -> dict:
    """A model's sharded state cut to its adapters' entries."""
    return {k: v for k, v in sd.items() if k.endswith(tuple(f".{f}" for f in FACTORS))}


def merge_entries(models: list[nn.Module], keys: list[str], sd: dict, n: int, loading: bool) -> tuple[dict, list]:
    """The ``n`` merged adapters of every adapted linear of ``models`` (the GPTModels, saved under ``keys`` in
    ``sd``) as ShardedTensors made from their adapter's: the host copies of ``lora_merges`` at a save, empty
    tensors to load into. Also (module, factor index, K, entry name) of each, for :func:`load_model`."""
    entries, where = {}, []
    for key, model in zip(keys, models):
        factors = {id(getattr(m, f)): (m, i) for m in lora_modules(model).values() for i, f in enumerate(FACTORS)}
        for local, sh in sd[key].items():
            if id(sh.data) not in factors:
                continue
            m, i = factors[id(sh.data)]
            for k in range(n):
                data = torch.empty_like(sh.data) if loading else m.lora_merges[k][i].to(sh.data.device)
                name = f"{key}.{k}.{local}"
                entries[name] = replace(sh, key=f"{MERGES}.{k}.{sh.key}", data=data)
                where.append((m, i, k, name))
    return entries, where


def check_load(actor, step: StepLayout, record: dict | None) -> None:
    """Collective: refuse in one line a checkpoint whose adapters differ from the actor's (none where it has
    some, or the reverse; another rank or targets), or whose adapters were trained on another base."""
    # a LoRA checkpoint from before the record holds the whole model: its index lists adapters
    listed = read_metadata(step.megatron.path).state_dict_metadata if record is None else {}
    has = record is not None or any(k.endswith(".lora_a") for k in listed)
    want = actor.sections.actor.lora
    was = (int(record.get("rank", 0)), record.get("targets")) if record else None
    if has != want.enabled or (was is not None and was != (want.rank, sorted(want.targets))):
        held = f"actor.lora.rank={was[0]} targets={was[1]}" if was else ("LoRA adapters" if has else "no LoRA")
        raise ConfigError(
            f"cannot load {step.path}: it holds {held} and this run asks for actor.lora.rank={want.rank}"
            f"{f' targets={sorted(want.targets)}' if want.enabled else ''}; resume with the checkpoint's actor.lora "
            "settings, or start a new run (trainer.resume=never, another trainer.output_dir)"
        )
    check_legacy(step, record, has)
    problem = None
    if record is not None and adapters_only(record) and actor.groups.rank == 0:
        try:
            problem = base_problem(record, this_base(actor.sections.model, actor.model_dir, actor.groups), step.path)
        except (OSError, ValueError) as e:  # said on every rank, not only where it happened
            problem = f"cannot load {step.path}: it holds LoRA adapters, not their base, which cannot be read ({e})"
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise ConfigError(box[0])


def check_legacy(step: StepLayout, record: dict | None, has_lora: bool) -> None:
    """Refuse a LoRA checkpoint written at TP > 1 before the record existed (2026-11-28): its ``linear_fc1``
    B was saved as one TP slice, which the SwiGLU layout it is read with now (``lora._sharded_state_dict``)
    would pair with the wrong weight rows."""
    if record is None and has_lora and int(load_common(step.megatron.path).get("layout", {}).get("tp", 1)) > 1:
        raise ConfigError(
            f"cannot load {step.path}: a LoRA checkpoint written at TP > 1 before 2026-11-28 (no lora record in its "
            "extra_state.json) holds linear_fc1's adapters in a layout this version no longer reads; start a new "
            "run (trainer.resume=never, another trainer.output_dir)"
        )


def load_model(
    models: list[nn.Module],
    keys: list[str],
    loaded: dict,
    record: dict | None,
    where: list,
    load_base: Callable[[], None] | None = None,
) -> None:
    """The loaded entries into ``models`` (GPTModels, under ``keys``); a whole-model checkpoint's base is as
    loaded. With an adapter-only checkpoint the merges are replayed onto the base the models hold (module
    docstring): only those it lacks when its own merges are the checkpoint's first ones (a fresh model has
    none), else all of them onto the pristine base ``load_base()`` reads again; no ``load_base`` (a random
    base): ValueError, load into freshly built models then."""
    only = adapters_only(record)
    for key, model in zip(keys, models):
        missing, unexpected = model.load_state_dict(loaded[key], strict=not only)
        lost = [k for k in missing if k.endswith(tuple(f".{f}" for f in FACTORS))]
        if unexpected or lost:
            raise ValueError(f"the checkpoint's model entries do not fit this model: {(unexpected or lost)[:3]}")
    modules = [m for model in models for m in lora_modules(model).values()]
    scalings = (record or {}).get("merges") or []
    if not only:  # merges not on record (none kept, or dropped) cannot be replayed onto a base read again
        for m in modules:
            m.lora_merges = [] if record is not None and record.get("merges") == [] else None
        return
    saved: dict[int, list] = {id(m): [[None, None, s] for s in scalings] for m in modules}
    for m, i, k, name in where:
        saved[id(m)][k][i] = loaded[MERGES][name]
    if not all(_starts(m.lora_merges, saved[id(m)]) for m in modules):
        if load_base is None:
            raise ValueError(
                "this model's base holds merges the checkpoint lacks and cannot be read again: load it "
                "into a freshly built model"
            )
        load_base()
        for m in modules:
            m.lora_merges = []
    for m in modules:
        replay_merges(m, [tuple(x) for x in saved[id(m)][len(m.lora_merges) :]])
    if scalings:
        logger.info("LoRA: the base with the adapters of %d PACS v2 reset(s) merged in", len(scalings))


def _starts(have: list | None, saved: list) -> bool:
    """Whether a module's merges so far are the first of the checkpoint's (the same tensors, in order)."""
    return (
        have is not None
        and len(have) <= len(saved)
        and all(
            s0 == s1 and torch.equal(a0, a1.to(a0.device)) and torch.equal(b0, b1.to(b0.device))
            for (a0, b0, s0), (a1, b1, s1) in zip(have, saved)
        )
    )
