import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from torch.multiprocessing import ProcessRaisedException


def _sum_rank(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _rank_one_fails(rank, world_size):
    if rank == 1:
        raise ValueError("rank one says no")
    return rank


def _rank_one_hangs(rank, world_size):
    if rank == 1:
        time.sleep(600)
    return rank


def test_run_ranks_all_reduce():
    assert run_ranks(_sum_rank, 2) == [1.0, 1.0]


def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(ProcessRaisedException, match=r"(?s)Process 1 .*_rank_one_fails.*rank one says no"):
        run_ranks(_rank_one_fails, 2)


def test_a_hanging_rank_is_killed_after_the_wall_limit():
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="_rank_one_hangs on 2 ranks did not finish in 20 s"):
        run_ranks(_rank_one_hangs, 2, wall_s=20)
    assert time.monotonic() - started < 60


LIBRARIES_THEN_IMPORT_ENVIRONMENT = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import dist_utils
before = dist_utils._read_at_import()
import accelerate, pytorch_lightning, torch
torch.compile(lambda x: x * 2 + 1)(torch.ones(4))
after = dist_utils._read_at_import()
os.environ["TRITON_INTERPRET"] = "1"  # the control: a caller's own choice is seen
print(json.dumps([after == before, dist_utils._read_at_import() == before]))
"""


def test_what_libraries_set_on_themselves_keeps_ranks_on_the_forkserver():
    """Lightning, Accelerate and torch.compile set variables torch reads at import in their own
    process; start_method() must not read them as the caller's change (a test worker that used
    them would spawn every later rank: 10-50 s a launch instead of 0.5 s)."""
    done = subprocess.run([sys.executable, "-c", LIBRARIES_THEN_IMPORT_ENVIRONMENT,
                           str(Path(__file__).parent)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == [True, False], done.stdout
