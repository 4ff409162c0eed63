"""The scheduler service: one per model replica (a TP group).

`scheduler_svc.core` is the pure decision logic (requests, KV block accounting, the
iteration-level scheduler); it imports only the stdlib and `shared`, so an in-process engine,
a simulator and the Redis service can all drive the same core. The service around it is a thin
loop that feeds it requests and carries plans and results.
"""
