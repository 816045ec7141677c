"""DeviceMesh: world = dp x cp x tp x pp, and each rank's groups.

Megatron-LM's layout, tensor parallel fastest-varying so that a tensor-parallel group (the
chattiest: two all-reduces per layer, forward and backward) is made of neighbouring ranks, the
ones most likely to share a node; context parallel next (a ring of key/value blocks per
layer), then data parallel, then pipeline stages:

    global rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

    dp=2, tp=2, pp=1:   rank   0  1  2  3          tp groups: [0,1] [2,3]
                        tp     0  1  0  1          dp groups: [0,2] [1,3]
                        dp     0  0  1  1          pp groups: [0] [1] [2] [3]

    dp=2, cp=2:         rank   0  1  2  3          cp groups: [0,1] [2,3]
                        cp     0  1  0  1          dp groups: [0,2] [1,3]
                        dp     0  0  1  1          dpcp group: [0,1,2,3]

With cp = 1 the order is the one above (cp_rank is always 0). `mesh.dp`, `mesh.cp`,
`mesh.tp`, `mesh.pp` are this rank's ProcessGroups; `mesh.dpcp` holds the ranks that differ
only in dp and cp (the same model part: context parallelism averages gradients over it);
`mesh.world` is the group of all ranks. A world size that is not dp x cp x tp x pp raises
ValueError on every rank, before any communication.

Tests: tests/test_comm.py::test_collectives (a 2x2 mesh: membership and sub-group collectives;
a dp 2 x cp 2 mesh: each group's rank order),
tests/test_context_parallel.py (the cp axis: coordinates and membership).
"""
from mpi4py import MPI

from minidist.comm.group import ProcessGroup


def mesh_coords(rank, dp, tp, pp, cp=1):
    """(dp_rank, tp_rank, pp_rank) of global `rank` in Megatron's order (cp_rank: cp_coord)."""
    return (rank // (tp * cp)) % dp, rank % tp, rank // (tp * cp * dp)


def cp_coord(rank, tp, cp):
    """The context-parallel rank of global `rank`."""
    return (rank // tp) % cp


def mesh_rank(dp_rank, tp_rank, pp_rank, dp, tp, cp_rank=0, cp=1):
    """The global rank at these coordinates (the inverse of mesh_coords and cp_coord)."""
    return tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))


class DeviceMesh:
    """This rank's dp, cp, tp and pp groups. `algo`: one algorithm for all, or a dict by axis,
    e.g. {"dp": "ring", "tp": "mpi"}. `world`: a ProcessGroup to carve up (default: all)."""

    def __init__(self, dp=1, tp=1, pp=1, algo="ring", world=None, cp=1):
        size = world.size if world is not None else MPI.COMM_WORLD.Get_size()
        if dp * cp * tp * pp != size:   # every rank computes this alone: no collective yet
            raise ValueError(f"DeviceMesh: dp x cp x tp x pp = {dp} x {cp} x {tp} x {pp} = "
                             f"{dp * cp * tp * pp}, but there are {size} ranks; choose sizes "
                             f"whose product is {size}")
        algos = algo if isinstance(algo, dict) else {a: algo for a in ("dp", "cp", "tp", "pp")}
        self.world = world or ProcessGroup.world(algos.get("dp", "ring"))
        self.shape = {"dp": dp, "cp": cp, "tp": tp, "pp": pp}
        r = self.world.rank
        self.dp_rank, self.tp_rank, self.pp_rank = mesh_coords(r, dp, tp, pp, cp)
        self.cp_rank = cp_coord(r, tp, cp)
        d, c, t, p = self.dp_rank, self.cp_rank, self.tp_rank, self.pp_rank
        # one split per axis: ranks that agree on the other coordinates share a group
        split = self.world.split
        self.tp = split(c + cp * (d + dp * p), key=t, algo=algos.get("tp", "ring"), name="tp")
        self.dp = split(t + tp * (c + cp * p), key=d, algo=algos.get("dp", "ring"), name="dp")
        self.pp = split(t + tp * (c + cp * d), key=p, algo=algos.get("pp", "ring"), name="pp")
        if cp > 1:      # only then: with cp = 1 the groups (and their names) are as before
            self.cp = split(t + tp * (d + dp * p), key=c, algo=algos.get("cp", "ring"),
                            name="cp")
            self.dpcp = split(t + tp * p, key=c + cp * d, algo=algos.get("dp", "ring"),
                              name="dpcp")
        else:
            self.cp, self.dpcp = None, self.dp

    @property
    def coords(self):
        """(dp_rank, tp_rank, pp_rank) of this rank (its cp_rank: mesh.cp_rank)."""
        return self.dp_rank, self.tp_rank, self.pp_rank

    def rank_of(self, dp_rank, tp_rank, pp_rank, cp_rank=0):
        """The world rank at these coordinates."""
        return mesh_rank(dp_rank, tp_rank, pp_rank, self.shape["dp"], self.shape["tp"],
                         cp_rank, self.shape["cp"])

    def __repr__(self):
        s = self.shape
        return (f"DeviceMesh(dp={s['dp']}, cp={s['cp']}, tp={s['tp']}, pp={s['pp']}, "
                f"rank={self.world.rank}, coords={self.coords}, cp_rank={self.cp_rank})")
