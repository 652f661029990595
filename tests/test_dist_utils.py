import torch
import torch.distributed as dist

from dist_utils import run_ranks


def _sum_rank(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def test_run_ranks_all_reduce():
    assert run_ranks(_sum_rank, 2) == [1.0, 1.0]
