"""tempering: post-training for language models on Ray worker groups."""

import os as _os

__version__ = "0.1.0"

# OpenMP (torch's CPU kernels, GNU libgomp in torch's Linux wheels) makes threads that finish
# their share of a parallel region spin before they sleep (300,000 spins by default). When
# another program holds a core, the thread sharing it is descheduled and its siblings spin on
# theirs, so every region waits a scheduler time slice: the main job's step went from 0.22 s to
# 3.6 s beside one busy-loop process (17x). Sleeping at once (OMP_WAIT_POLICY=PASSIVE) fixed
# that (1.02x) but paid a wake-up per region: tiny SFT 0.15-0.16 s/step against 0.07-0.09. A
# short spin keeps both: GOMP_SPINCOUNT=2000 measured 1.23x busy/idle and tiny SFT at its floor
# (bench/bench_busy.py, bench/bench_floor.py, README "Shared machines"). Read when the OpenMP
# runtime loads (torch's import), so it is set here, before any of tempering imports torch; Ray
# processes started by this one inherit it, and worker groups pass OPENMP_ENV to workers on
# other nodes. A value the user set is kept (an OMP_WAIT_POLICY of theirs overrides the spin).
# CPU policy workers, whose torch threads follow the cores other processes leave free (they
# drop to one thread beside a competitor, within ~0.3 s even inside a call), run libgomp's own
# spin instead: no sibling to wait for when the machine is busy, and no wake-ups when it is
# idle (tempering/utils/threads.py, `governed_openmp_env`).
OPENMP_DEFAULTS = {"GOMP_SPINCOUNT": "2000"}
OPENMP_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # what workers get from the driver
OPENMP_USER_SET = frozenset(k for k in OPENMP_ENV if k in _os.environ)  # kept everywhere
for _name, _value in OPENMP_DEFAULTS.items():
    _os.environ.setdefault(_name, _value)
