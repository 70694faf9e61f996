"""The cluster simulator lives in ``services/sim/`` (``pdserve advise`` ships it); these
modules keep the benchmarks' and tests' ``bench.sim.*`` imports working."""
