"""rlmem.comm's fallback where the loaded NCCL cannot suspend: destroy a group's communicators, rebuild them.

torch cannot swap the backend of an existing ``ProcessGroup`` (``_register_backend`` keeps the first backend
of a type), so the rebuilt communicators live in a new ``ProcessGroup`` with the old one's rank, size, name
and store (under a fresh prefix), and rlmem.comm forwards the methods the program calls on the old object to
it.
Backends that are not communicator backends (a Gloo backend of a ``cpu:gloo,cuda:nccl`` group) are shared by
the old and the new object, untouched.
"""

from __future__ import annotations

from typing import Any

import torch


def comm_backends(pg_now: Any, drv: Any, get_backend: Any) -> list[Any]:
    """The distinct communicator backends (per ``drv.is_comm``) of the group object ``pg_now``."""
    seen: dict[int, Any] = {}
    for dev in pg_now._device_types:
        b = get_backend(pg_now, torch.device(dev))
        if drv.is_comm(b):
            seen.setdefault(id(b), b)
    return list(seen.values())


def _backend_type(name: str) -> Any:
    import torch.distributed as dist

    return dist.Backend.backend_type_map.get(name.lower(), dist.ProcessGroup.BackendType.CUSTOM)


def rebuild(pg: Any, pg_now: Any, generation: int, drv: Any, get_backend: Any) -> Any:
    """A new ProcessGroup standing for ``pg``: fresh communicator backends for the ones of ``pg_now`` (which
    were destroyed), the other backends shared. Collective over the ranks of ``pg`` (each builds its part)."""
    import torch.distributed as dist

    store = dist.distributed_c10d._world.pg_map[pg][1]
    # A prefix of its own per rebuild: the new communicators exchange their ids without meeting old keys.
    prefix = dist.PrefixStore(f"rlmem.comm/{pg.group_name}/{generation}/", store)
    rank, size = pg.rank(), pg.size()
    new = dist.ProcessGroup(prefix, rank, size)
    if pg.bound_device_id is not None:
        new.bound_device_id = pg.bound_device_id
    made: dict[int, tuple[Any, Any]] = {}  # id(old backend) -> (old, new); old kept so its id stays its own
    for dev in pg_now._device_types:
        dev = torch.device(dev)
        old = get_backend(pg_now, dev)
        if drv.is_comm(old):
            if id(old) not in made:
                made[id(old)] = (old, drv.new_backend(prefix, rank, size, old))
            new._register_backend(dev, drv.backend_type, made[id(old)][1])
        else:
            new._register_backend(dev, _backend_type(old.name()), old)
    new._set_default_backend(_backend_type(pg._get_backend_name()))
    new._set_group_name(pg.group_name)
    new._set_group_desc(pg.group_desc)
    for _, b in made.values():
        if hasattr(b, "_set_sequence_number_for_group"):
            b._set_sequence_number_for_group()
        drv.connect(b)
    return new
