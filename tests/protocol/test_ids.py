import os
import re

from inferd.protocol.ids import new_id


def test_ids_are_32_hex_digits_and_never_repeat():
    ids = [new_id() for _ in range(10_000)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == len(ids)


def test_a_forked_child_draws_its_own_prefix():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, new_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    os.close(write)
    assert child[:16] != new_id()[:16]
