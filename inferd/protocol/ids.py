"""Ids for requests, usage records and reservations: 32 hex digits, as uuid4().hex, without a system call each.

64 random bits drawn once per process (again in a forked child), then a 64-bit counter. Two processes share
a prefix with probability 2**-64 a pair; within one the counter never repeats. Not secrets: nothing may
rely on them being hard to guess (keys and tokens use `secrets`)."""
import itertools
import os

_prefix = ""
_counter = itertools.count()


def _reseed() -> None:
    global _prefix, _counter
    _prefix = os.urandom(8).hex()
    _counter = itertools.count()


_reseed()
os.register_at_fork(after_in_child=_reseed)


def new_id() -> str:
    return f"{_prefix}{next(_counter):016x}"
