"""Imported last by the fork server of the tests' own ranks (tests/spawned_ranks.py): what it preloaded is moved out
of the garbage collector's reach, so a rank's full collections walk only the objects the rank made, not the ~500k
the libraries hold (0.2-0.3 s each), and do not write to (and so copy) the pages the ranks share with the server.
tests/forked_ray_workers.py does the same for Ray's workers."""

import atexit
import gc

gc.collect()
gc.freeze()
# the server's own exit collects them again (else triton's bindings report its objects as leaked); its ranks end with
# os._exit, which runs no atexit callback
atexit.register(gc.unfreeze)
