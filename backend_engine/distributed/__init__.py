"""Tensor parallelism: one replica across several devices, through torch.distributed (gloo on
CPU, NCCL between GPUs). Every rank holds a Megatron-style shard of the weights and the KV of
its own heads; these are the primitives its model runner uses. The processes that run the ranks
are the executor's (backend_engine/executor/).

    sharding.py  which rows/columns of each weight a rank holds, and the sizes that work
    group.py     the process group: all-reduce, logits gather, the step broadcast
    vocab.py     vocabulary-parallel embedding lookup and logits gather
"""
