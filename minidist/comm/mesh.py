"""DeviceMesh: world = dp x tp x pp, and each rank's three groups.

Megatron-LM's layout, tensor parallel fastest-varying so that a tensor-parallel group (the
chattiest: two all-reduces per layer, forward and backward) is made of neighbouring ranks, the
ones most likely to share a node:

    global rank = tp_rank + tp * (dp_rank + dp * pp_rank)

    dp=2, tp=2, pp=1:   rank   0  1  2  3          tp groups: [0,1] [2,3]
                        tp     0  1  0  1          dp groups: [0,2] [1,3]
                        dp     0  0  1  1          pp groups: [0] [1] [2] [3]

`mesh.dp`, `mesh.tp`, `mesh.pp` are this rank's ProcessGroups (a rank's position in each is
its dp_rank, tp_rank, pp_rank); `mesh.world` is the group of all ranks. A world size that is
not dp x tp x pp raises ValueError on every rank, before any communication.

Tests: tests/test_comm.py::test_mesh (a 2x2 mesh: membership and sub-group collectives).
"""
from mpi4py import MPI

from minidist.comm.group import ProcessGroup


def mesh_coords(rank, dp, tp, pp):
    """(dp_rank, tp_rank, pp_rank) of global `rank` in Megatron's order."""
    return (rank // tp) % dp, rank % tp, rank // (tp * dp)


def mesh_rank(dp_rank, tp_rank, pp_rank, dp, tp):
    """The global rank at these coordinates (the inverse of mesh_coords)."""
    return tp_rank + tp * (dp_rank + dp * pp_rank)


class DeviceMesh:
    """This rank's dp, tp and pp groups. `algo`: one algorithm for all, or a dict by axis,
    e.g. {"dp": "ring", "tp": "mpi"}. `world`: a ProcessGroup to carve up (default: all)."""

    def __init__(self, dp=1, tp=1, pp=1, algo="ring", world=None):
        size = world.size if world is not None else MPI.COMM_WORLD.Get_size()
        if dp * tp * pp != size:   # every rank computes this alone: no collective yet
            raise ValueError(f"DeviceMesh: dp x tp x pp = {dp} x {tp} x {pp} = {dp * tp * pp}, "
                             f"but there are {size} ranks; choose sizes whose product is {size}")
        algos = algo if isinstance(algo, dict) else {"dp": algo, "tp": algo, "pp": algo}
        self.world = world or ProcessGroup.world(algos.get("dp", "ring"))
        self.shape = {"dp": dp, "tp": tp, "pp": pp}
        self.dp_rank, self.tp_rank, self.pp_rank = mesh_coords(self.world.rank, dp, tp, pp)
        d, t, p = self.dp_rank, self.tp_rank, self.pp_rank
        # one split per axis: ranks that agree on the other two coordinates share a group
        self.tp = self.world.split(d + dp * p, key=t, algo=algos.get("tp", "ring"), name="tp")
        self.dp = self.world.split(t + tp * p, key=d, algo=algos.get("dp", "ring"), name="dp")
        self.pp = self.world.split(t + tp * d, key=p, algo=algos.get("pp", "ring"), name="pp")

    @property
    def coords(self):
        """(dp_rank, tp_rank, pp_rank) of this rank."""
        return self.dp_rank, self.tp_rank, self.pp_rank

    def rank_of(self, dp_rank, tp_rank, pp_rank):
        """The world rank at these coordinates."""
        return mesh_rank(dp_rank, tp_rank, pp_rank, self.shape["dp"], self.shape["tp"])

    def __repr__(self):
        return (f"DeviceMesh(dp={self.shape['dp']}, tp={self.shape['tp']}, "
                f"pp={self.shape['pp']}, rank={self.world.rank}, coords={self.coords})")
