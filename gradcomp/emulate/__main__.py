"""``python -m gradcomp.emulate --target module:function ...``: one rank of launch_ranks."""
from .launch import _rank_main

if __name__ == "__main__":
    _rank_main()
