"""Tensor and expert parallelism on torch.distributed (docs/parallel.md).

The process that owns the scheduler is rank 0, the leader; N-1 worker processes each hold one
shard of the model and follow the leader's forwards. `group` is the ranks' collectives and the
size checks, `shard` loads one rank's slice of a checkpoint, `mirror` is the leader's side (a
model and KV cache store that replay every call on the workers), `worker` the workers' loop,
and `launch` starts and supervises them.
"""
