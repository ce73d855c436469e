"""Tensor parallelism over torch.distributed (gloo on CPU): EngineConfig(tensor_parallel_size=N).

    shard.py           how the model is cut (whole GQA groups per rank), the row-parallel and
                       vocabulary-parallel layers, TensorParallelModel (one rank's shard)
    group.py           the gloo process group on 127.0.0.1 (spawned or torchrun), timed collectives
    shm_allreduce.py   the all-reduce of ranks on one host through shared memory (gloo otherwise)
    plan_broadcast.py  the step plan rank 0 sends every rank (int64 tensors), the page-table
                       updates and each rank's host copy of them
    driver.py          rank 0: starts / joins the workers, the step protocol, per-rank events,
                       taps and calls for probes, failure and shutdown
    worker.py          every other rank: its shard, the loop that serves the driver's plans

The engine core stays as it is: Engine builds a Driver when tensor_parallel_size > 1, and the
driver's TensorParallelModel takes the place of the model (its forward runs the protocol).
"""
from .driver import Driver, RankFailed
from .shard import ShardPlan, TensorParallelModel, plan_shards

__all__ = ["Driver", "RankFailed", "ShardPlan", "TensorParallelModel", "plan_shards"]
