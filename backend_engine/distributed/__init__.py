"""Tensor parallelism: one replica across several devices, through torch.distributed (gloo on
CPU, NCCL between GPUs). Rank 0 keeps the scheduler, block pool and server and sends each step's
batch to the other ranks; every rank holds a Megatron-style shard of the weights and the KV of
its own heads.

    sharding.py  which rows/columns of each weight a rank holds, and the sizes that work
    group.py     the process group: all-reduce, logits gather, the step broadcast
    vocab.py     vocabulary-parallel embedding lookup and logits gather
    worker.py    ranks 1..N-1: load the shard, then run every step rank 0 sends
    executor.py  rank 0: start the workers, watch them, send steps, shut them down
"""
