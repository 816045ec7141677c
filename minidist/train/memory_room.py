"""Where a rank's memory is and how much of it is free: the room memory_check.py sets the
planner's bill beside. On the host, /proc/meminfo's MemAvailable, less where the process's
memory cgroup (v1 or v2, as containers and batch schedulers set them) leaves less; where no
count of free memory can be read (macOS: no /proc), all the host's physical memory, said
so. On a GPU, the device's free memory and what CuPy's pool holds unused. Apart from both:
the address space `ulimit -v` leaves a rank (address_room), which a host's count does not
show.
Tests: tests/test_memory_room.py.
"""
import os
import resource
import socket
import sys

from minidist import backend

UNLIMITED = 2 ** 60               # a cgroup or rlimit at least this big limits nothing


def where_and_room(proc="/proc"):
    """(where this rank's memory is: its host, or its host and GPU; the bytes free there;
    whether that is free memory, or, where no count of it can be read (macOS: no /proc),
    all the host's physical memory, None if not even that)."""
    host = socket.gethostname()
    if backend.device() == "cuda":
        cp = sys.modules["cupy"]
        device = cp.cuda.Device().id
        free, _ = cp.cuda.runtime.memGetInfo()
        pool = cp.get_default_memory_pool()
        return (host, cp.cuda.runtime.deviceGetPCIBusId(device)), \
            int(free) + int(pool.free_bytes()), True
    room = host_room(proc)
    return ((host,), room, True) if room is not None else ((host,), physical_bytes(), False)


def physical_bytes():
    """The host's physical memory (POSIX sysconf), or None."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def host_room(proc="/proc", cgroup_root="/sys/fs/cgroup"):
    """Bytes this process's host can still give it: MemAvailable, or less where its cgroup's
    limit (v2 memory.max, v1 memory.limit_in_bytes; less its usage but the reclaimable
    inactive file cache) leaves less; None where /proc/meminfo cannot be read."""
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        room = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    limited = cgroup_room(proc, cgroup_root)
    return room if limited is None else min(room, limited)


def cgroup_room(proc="/proc", cgroup_root="/sys/fs/cgroup"):
    """Bytes left under this process's memory cgroup limit, or None where it has none."""
    try:
        with open(os.path.join(proc, "self", "cgroup")) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    for _, controllers, path in lines:
        if controllers == "":                                         # cgroup v2
            folder, names = cgroup_root, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):                      # cgroup v1
            folder, names = os.path.join(cgroup_root, "memory"), \
                ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        for base in (folder + path.rstrip("/"), folder):       # (a container sees its own /)
            room = _room_in(base, *names)
            if room is not None:
                return room
    return None


def _room_in(folder, limit_file, usage_file, inactive_key):
    try:
        with open(os.path.join(folder, limit_file)) as f:
            limit = f.read().strip()
        with open(os.path.join(folder, usage_file)) as f:
            usage = int(f.read().strip())
    except (OSError, ValueError):
        return None
    if limit == "max" or not limit.isdigit() or int(limit) >= UNLIMITED:
        return None
    inactive = 0
    try:
        with open(os.path.join(folder, "memory.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                inactive = int(value) if key == inactive_key else inactive
    except (OSError, ValueError):
        pass
    return max(int(limit) - usage + inactive, 0)


def address_room(proc="/proc"):
    """Bytes of address space `ulimit -v` (RLIMIT_AS) leaves this process, or None."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft >= UNLIMITED:
        return None
    try:
        with open(os.path.join(proc, "self", "status")) as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return None
    return max(soft - size, 0)
