"""Load a target sharded across the processes ``torchrun`` started, by the names ``load_model`` takes.

transformers shards a checkpoint as it loads it (``from_pretrained(folder, distributed_config=
DistributedConfig(...))``), so a sharded target is loaded from a folder: a local checkpoint, or a
packaged model's weight cache (``specdec.weight_cache``; filled once, by rank 0, while the other
ranks wait). The process group is started here when it is not yet (the backend transformers
would choose: NCCL on GPUs, gloo on the CPU), so that ranks can agree before the load.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch

from ..models import PACKAGED_MODELS, load_tokenizer, check_model_name, load_model, weight_cache_path
from ..weight_cache import folder_problem

#: how long ranks wait for each other at the process group's collectives: a sharded load skews
#: ranks by minutes (transformers' own choice when it starts the group)
GROUP_TIMEOUT = timedelta(hours=2)


def init_ranks(device_type: str = "cpu") -> tuple[int, int]:
    """Start the default process group if ``torchrun`` started this process and nobody did yet;
    bind a GPU rank to its local device. Returns (rank, world size); (0, 1) outside torchrun."""
    import torch.distributed as dist

    if not dist.is_available() or "RANK" not in os.environ:
        return 0, 1
    if not dist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo", timeout=GROUP_TIMEOUT)
    return dist.get_rank(), dist.get_world_size()


def checkpoint_folder(name: str, dtype: torch.dtype = torch.float32) -> Path:
    """The folder a sharded load of ``name`` reads: ``name`` itself, or a packaged model's weight
    cache (de-quantized by rank 0 if it is not there yet; the other ranks wait for it)."""
    import torch.distributed as dist

    check_model_name(name)
    if os.path.isdir(name):
        return Path(name)
    if name not in PACKAGED_MODELS:
        raise ValueError(f"{name!r}: a sharded target is loaded from a checkpoint folder or a packaged model "
                         "(tiny-random models are built in code)")
    folder = weight_cache_path(name, dtype)
    if folder is None:
        raise ValueError(f"{name!r}: a sharded load reads the weight cache, which SPECDEC_NO_WEIGHT_CACHE turns off")
    if folder_problem(folder) is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        load_model(name, dtype=dtype)  # verifies the cache (a damaged one said and removed), de-quantizes, writes it
    if dist.is_initialized():
        dist.barrier()
    problem = folder_problem(folder)  # every rank reads these files: every rank checks them
    if problem is not None:
        raise ValueError(f"{name!r}: the weight cache {folder} cannot be used on this host: {problem} (each host "
                         "needs its own: load the model once on every host, e.g. with load_model)")
    return folder


def load_sharded(name: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu", tp_size: int = 1,
                 pp_size: int = 1, tp_plan: dict | None = None):
    """``(model, tokenizer)``: ``name`` (as ``load_model`` takes it) loaded with transformers' tensor
    and pipeline parallelism over the processes of this ``torchrun`` launch (``tp_size * pp_size``
    of them). ``tp_plan``: rules over the model's own plan (e.g. attention ``"replicate"`` where
    its heads do not divide by ``tp_size``)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    _, world = init_ranks(torch.device(device).type)
    if tp_size * pp_size != world:
        raise ValueError(f"tp_size * pp_size = {tp_size * pp_size}, but torchrun started {world} process(es): "
                         f"launch with --nproc-per-node (x --nnodes) = {tp_size * pp_size}")
    folder = checkpoint_folder(name, dtype)
    config = DistributedConfig(tp_size=tp_size, pp_size=pp_size, **({"tp_plan": tp_plan} if tp_plan else {}))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, distributed_config=config, local_files_only=True)
    # a packaged model's cache was saved with its tokenizer, which must load; a user's folder may have none
    tokenizer = load_tokenizer(folder, strict=not os.path.isdir(name))
    return model.eval(), tokenizer
