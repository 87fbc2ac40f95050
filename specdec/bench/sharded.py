"""A benchmark config run by every process of a ``torchrun`` launch, its target sharded across them.

Every rank runs the same rows, in the same order, with the same prompts (the sharded target's
forwards are collectives); rank 0 alone touches the output directory: it checks it, reads the rows
already done (a rerun resumes as a single-process run does) and sends them to the others, appends
each row, writes ``run.json`` and the report. Only rank 0 logs and shows progress. A config
without ``distributed`` runs in one process and none of this applies. See docs/distributed.md.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from .config import BenchConfig, ConfigError

T = TypeVar("T")


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def is_rank0() -> bool:
    dist = _dist()
    return dist is None or dist.get_rank() == 0


def begin(config: BenchConfig) -> None:
    """For a distributed config: start the process group (a ``torchrun`` launch of the right size)."""
    if config.distributed is None:
        return
    from ..distributed.load import init_ranks
    from ..models import resolve_device

    try:
        device = resolve_device(config.device)
    except ValueError as exc:
        raise ConfigError(f"device: {exc}") from None
    _, world = init_ranks(device.type)
    if world != config.distributed.world_size:
        raise ConfigError(f"distributed: tp_size * pp_size = {config.distributed.world_size} processes, but this run "
                          f"has {world}: launch it with torchrun --nproc-per-node {config.distributed.world_size} "
                          "-m specdec bench CONFIG (docs/distributed.md)")


def on_rank0(work: Callable[[], T]) -> T:
    """``work()`` on rank 0 only (it touches files); its result, or the error it raised, on every rank."""
    dist = _dist()
    if dist is None:
        return work()
    value, error = None, None
    if dist.get_rank() == 0:
        try:
            value = work()
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
    box = [(value, error)]
    dist.broadcast_object_list(box, src=0)
    value, error = box[0]
    if error is not None:
        raise error
    return value


def rank0_log(log: Callable[[str], None]) -> Callable[[str], None]:
    """``log`` on rank 0; nothing elsewhere (every rank says the same)."""
    return log if is_rank0() else (lambda message: None)


def load_target(config: BenchConfig, device: torch.device):
    """``(target, tokenizer)``, sharded as ``config.distributed`` says."""
    from ..distributed.load import load_sharded

    shards = config.distributed
    return load_sharded(config.target, dtype=config.torch_dtype, device=str(device), tp_size=shards.tp_size,
                        pp_size=shards.pp_size, tp_plan=shards.tp_plan)


def environment() -> dict:
    """What ``run.json`` records of the launch: world size and backend (empty for one process)."""
    dist = _dist()
    if dist is None:
        return {}
    return {"world_size": dist.get_world_size(), "backend": str(dist.get_backend())}
