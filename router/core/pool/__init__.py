"""The pool and scheduling: the replica set, acquire()/release(), picking, queues, holds, ejection, tallies."""
