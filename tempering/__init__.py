"""tempering: post-training for language models on Ray worker groups."""

import os as _os

__version__ = "0.1.0"

# OpenMP (torch's CPU kernels) makes threads that finish their share of a parallel region
# spin for a while before they sleep. When another program holds a core, the thread sharing
# it is descheduled and its siblings spin on theirs, so every region waits a scheduler time
# slice: the main job's step went from 0.22 s to 3.6 s beside one busy-loop process (17x).
# Sleeping at once: 1.24x, for ~5% on an idle machine (bench/bench_busy.py, README
# "Benchmarks"). Read when the OpenMP runtime loads (torch's import), so it is set here, before
# any of tempering imports torch; Ray processes started by this one inherit it, and worker
# groups pass it to workers on other nodes. An OMP_WAIT_POLICY the user set is kept.
OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
for _name, _value in OPENMP_DEFAULTS.items():
    _os.environ.setdefault(_name, _value)
