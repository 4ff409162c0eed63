"""Tensor parallelism across processes: one process per rank, rank 0 drives; the layers
are cut Megatron-style (column- then row-parallel, `gpu_worker.parallel`).

In-process mode (`pacer generate --tp N`, the engine, the tests): rank 0 is the caller's
process and spawns ranks 1..N-1 itself (`spawn.py`).

    executor = launch_tp_executor(model_config, source, runner_config, tp=3)
    result = executor.execute(plan)        # the same plan runs on every rank
    executor.shutdown()

Served mode: every rank is its own `pacer worker --rank R --tp N` process; rank 0 publishes
the rendezvous address in Redis and the others meet it there (`rendezvous.py`, `service.py`).

    group = init_tp_group(rank, size, master_addr, master_port, backend_for(device))
    runner = ModelRunner(cfg, source, rc, tp=group)
    rank 0:   executor = TPExecutor(runner, group)      # then execute(plan) per plan
    rank > 0: run_follower(runner, group)               # returns at rank 0's shutdown()

One job per module:

- `store_keys.py`  the names the ranks share in the rendezvous store (torch's TCPStore)
- `liveness.py`    the watchdog thread: heartbeats through the store, names a dead rank
- `group.py`       joining the group (store, process group, control group, watchdog)
- `broadcast.py`   rank 0 -> followers: plan bytes, the sampling seed, the token check
- `executor.py`    rank 0's TPExecutor: broadcast the plan, run it, check agreement
- `follower.py`    ranks > 0: receive plans and run them until rank 0 shuts the group down
- `spawn.py`       in-process mode: rank 0 spawns and reaps its followers
- `rendezvous.py`  served mode: where rank 0 tells the other ranks to meet it (Redis)
- `service.py`     served mode: rank 0's executor and a follower's life, for the worker service

Forward collectives use the default group (gloo on CPU, NCCL on CUDA): per forward 2
all-reduces per layer (o_proj, down_proj), 1 all-reduce (vocab-parallel embedding) and 1
all-gather (LM head). Plans travel on a separate gloo "control" group.
"""
