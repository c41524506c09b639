"""The processes of a tensor-parallel replica (the primitives are in backend_engine/distributed/).
Rank 0 keeps the scheduler, block pool and server and sends each step's batch to the other
ranks; each rank runs a model runner on its shard.

    tensor_parallel.py  rank 0: start the workers, watch them, send steps, shut them down
    worker.py           ranks 1..N-1: load the shard, then run every step rank 0 sends
"""
