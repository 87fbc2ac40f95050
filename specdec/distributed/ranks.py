"""Which processes hold a model, and the group its decoder's messages travel on.

:func:`sharding` tells a target transformers spread over processes (tensor parallelism: DTensor
weights; pipeline parallelism: a stage holding only its layers, ``PipelineIdentityLayer`` s
elsewhere) from one held whole. :class:`Ranks` is one decoder's place among the ranks that hold
its target: the gloo group of its messages (:func:`control_group`, bounded by
``DistributedOptions.timeout``), the process group's store (where a failing rank leaves its
error), and which rank decides. Groups a failure aborted, or whose peer was lost, are recorded
(:func:`mark_broken`): later calls raise :func:`check_usable`'s error instead of entering a
collective that would abort the process. :func:`stage_layout` says which layers a pipeline stage holds
(``specdec.growing.new_dynamic_cache`` sizes a stage's masks from one of them). The protocol itself: ``call.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

PLACEMENTS = ("one_rank", "replicated")
#: drafts per row carried by the message sent before each forward; a longer block takes a second one
INLINE_DRAFTS = 16
DECIDER = 0
#: control groups by timeout (one new_group per timeout per process), and under AGREE the group on
#: which the ranks first compare the timeout asked: every rank's table holds the same keys
_GROUPS: dict[float | str, object] = {}
AGREE = "agree"
#: why this process's groups can carry no more collectives, and the default group that broke (empty:
#: they can); a process that starts new groups (``init_process_group`` again) is usable again
_BROKEN: list[tuple[str, object]] = []


class DistributedDecodeError(RuntimeError):
    """A distributed ``generate()`` call cannot go on (every rank raises one)."""


class RankFailedError(DistributedDecodeError):
    """Another rank failed during this call; the message names it and gives its error."""


class RanksDivergedError(DistributedDecodeError):
    """The ranks were given different calls, or hold different committed tokens."""


@dataclass(frozen=True)
class DistributedOptions:
    """How a :class:`~specdec.decoder.SpecDecoder` with a sharded target coordinates its ranks."""

    draft_placement: str = "one_rank"  # or "replicated": see the module docstring
    timeout: float = 300.0  # seconds a rank waits for the others at a message before it gives up

    def __post_init__(self):
        if self.draft_placement not in PLACEMENTS:
            raise ValueError(f"draft_placement must be one of {PLACEMENTS}, got {self.draft_placement!r}")
        if not isinstance(self.timeout, (int, float)) or isinstance(self.timeout, bool) or not self.timeout > 0:
            raise ValueError(f"timeout must be a number of seconds > 0, got {self.timeout!r}")

    @classmethod
    def of(cls, value) -> "DistributedOptions":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls(**value)
        raise TypeError(f"distributed must be a DistributedOptions, a dict or None, got {type(value).__name__}")


# -- what a model is -------------------------------------------------------------------------------
def sharding(model) -> tuple[str, ...]:
    """How ``model`` is spread over processes: ``("tensor",)``, ``("pipeline",)``, both, or ()."""
    kinds = []
    stage = getattr(model, "_pp_stage", None)
    if stage is not None and getattr(stage, "pp_size", 1) > 1:
        kinds.append("pipeline")
    if (getattr(model, "_tp_size", None) or 1) > 1 or _has_dtensors(model):
        kinds.append("tensor")
    return tuple(kinds)


def _has_dtensors(model) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def stage_layout(model) -> tuple[bool, ...] | None:
    """Per decoder layer, whether this pipeline stage holds it; None for a model holding them all."""
    if "pipeline" not in sharding(model):
        return None
    layers = getattr(getattr(model, model.base_model_prefix, None), "layers", None)
    if layers is None:
        return None
    return tuple(type(layer).__name__ != "PipelineIdentityLayer" for layer in layers)


# -- many processes ---------------------------------------------------------------------------------
def control_group(timeout: float):
    """The gloo group the coordinator's messages travel on (one per timeout for the process; made
    by every rank at the same point, as ``new_group`` must be). The ranks first compare the
    timeouts they were given, on the process's first control group: a rank given another one is
    refused on every rank, and no rank makes a group another does not (which would pair one rank's
    next messages with another's group creation)."""
    import torch.distributed as dist

    make = lambda: dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))  # noqa: E731
    first = _GROUPS.get(AGREE) or _GROUPS.setdefault(AGREE, make())
    asked: list = [None] * dist.get_world_size()
    dist.all_gather_object(asked, timeout, group=first)
    if len(set(asked)) > 1:
        raise RanksDivergedError(f"the ranks were given different DistributedOptions.timeout ({asked}, by rank): "
                                 "give every rank the same")
    if timeout not in _GROUPS:
        _GROUPS[timeout] = make()
    return _GROUPS[timeout]


class Ranks:
    """One decoder's place among the ranks holding its sharded target (None where it is not)."""

    def __init__(self, target, options: DistributedOptions, kinds: tuple[str, ...]):
        import torch.distributed as dist

        self.options, self.sharding = options, kinds
        mesh = getattr(target, "_device_mesh", None)
        if mesh is not None and mesh.size() != dist.get_world_size():
            raise ValueError(f"the target is sharded over {mesh.size()} of {dist.get_world_size()} ranks; specdec "
                             "coordinates the whole world (one model: launch as many processes as it is sharded over)")
        self.group = control_group(float(options.timeout))
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.store = dist.distributed_c10d._get_default_store()

    @classmethod
    def of(cls, target, options=None) -> "Ranks | None":
        """The coordination a decoder of ``target`` needs: None for a target held whole by this process."""
        options = DistributedOptions.of(options)
        kinds = sharding(target)
        if not kinds:
            return None
        import torch.distributed as dist

        check_usable()  # aborted groups: say so (the process group then no longer counts as initialized)
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("the target is sharded but torch.distributed is not initialized")
        return cls(target, options, kinds)

    @property
    def decides(self) -> bool:
        return self.rank == DECIDER

    def check_cache(self, cache) -> None:
        """Refuse a cache the sharded target cannot keep (``cache``: the decoder's CacheSettings)."""
        if cache.static and "pipeline" in self.sharding:
            raise ValueError("cache_implementation='static' with a pipeline-parallel target: a stage's static cache "
                             "sizes its masks from a layer the stage does not hold; use the dynamic cache "
                             "(docs/distributed.md)")


def abort_process_groups(reason: str = "aborted") -> None:
    """Abort every process group of this process, so that other ranks waiting in a collective
    with it fail at once instead of waiting for a timeout; ``reason`` says why to later calls."""
    import torch.distributed as dist

    mark_broken(reason)
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        abort() if abort is not None else dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - already broken: nothing more to tell the others
        pass
    _GROUPS.clear()


def mark_broken(reason: str) -> None:
    """Record that this process's groups can carry no more collectives (aborted, or a peer lost):
    a later call raises :func:`check_usable`'s error instead of entering a collective that would
    abort the process or wait for ever."""
    if not _BROKEN:
        _BROKEN.append((reason, _world()))


def _world():
    """This process's default group, or None (held while broken, so a new one is never the same object)."""
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def broken() -> str | None:
    """Why this process's groups are unusable, or None while they are usable (also once the process
    has started new groups since they broke: aborted groups leave none, so any is new)."""
    if _BROKEN:
        reason, world = _BROKEN[0]
        now = _world()
        if now is None or now is world:
            return reason
        _BROKEN.clear()
        _GROUPS.clear()  # the control groups were the old world's
    return None


def check_usable() -> None:
    """Raise a clear error where an earlier call left this process's groups unusable."""
    reason = broken()
    if reason is not None:
        raise DistributedDecodeError(
            f"the process groups of this rank are unusable since an earlier generate() failed ({reason}); "
            "a failure inside the target's forward ends the launch: start the processes again "
            "(docs/distributed.md, Failures)")
