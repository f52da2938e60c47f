"""Rank processes on this machine: the launcher, the rank process, warm starts.

`run_local(fn, np)` and `python -m collectives.launch -n N script.py` start
ranks without Spark; `worker` is the rank process every launcher starts;
`zygote` forks warm ones; `procs` watches a group of them; `RankEnv` is the
environment a launcher gives each rank.
"""
from .launcher import main, run_local, start_ranks
from .procs import RankFailed
from .rankenv import RankEnv, rank_envs

__all__ = ["run_local", "start_ranks", "rank_envs", "RankFailed", "RankEnv", "main"]
