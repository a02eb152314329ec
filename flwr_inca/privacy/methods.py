"""The certification methods (``solver``) and the rule by which ``auto`` chooses among them: the names and
the measured limits, kept apart from the solvers so that what only names them (the command line's help)
imports no solver. :func:`flwr_inca.privacy.certificate.auto_solver` applies the rule."""

from __future__ import annotations

SOLVERS = ("auto", "exact", "bound", "cascade")
# The automatic choice (auto_solver), measured side by side: benchmarks/RESULTS.md, "Which method auto takes".
# Exact up to this many observed honest messages: up to 8000 it was the faster method in every setting
# (1.6-3.3x at 7000-7350: n = 1000 with T = 80 or k = 2, T = 40; n = 3000, T = 20) and 0.1-6% tighter.
EXACT_MAX_ROWS = 8000
# ... and, with one neighbour and at least this many iterations, up to EXACT_LONG_MAX_ROWS: the bound's search
# is slow there and the cascade's local tier slower (T = 60, n = 2000, 11,454 messages: exact 47 s, bound and
# cascade 71 s; T = 80, up to 14,768 messages: 1.8x to 2.5x faster than the bound, 1.8x to 3.7x than the
# cascade, 4-8% tighter). The memory limit still applies (6.9 GB at 14,768 messages).
EXACT_LONG_MIN_ITERATIONS = 60
EXACT_LONG_MAX_ROWS = 15000
# beyond this many observed honest messages auto uses the charge-aware cascade instead of the global
# bound (both sound, their maxima within about 1-4% of each other): bound 66 s / cascade 46 s at 9,732
# messages (n = 4000, T = 20), 167 s / 71 s at 14,652 (n = 6000), on a busy machine; 32 s / 26 s at n = 2500,
# T = 40 ...
CASCADE_MIN_ROWS = 9500
# ... as long as T * k is at most CASCADE_MAX_STEPS: the cascade's local tier covers the neighbourhood a party's
# messages reach, which grows with T and k. Beyond, up to EXACT_MAX_PARTIES parties (the range measured), the
# global bound is faster: k = 2, T = 40 (n = 1500): 12 s against 55 s; k = 2, T = 80 (n = 1000): 42 s against
# 358 s.
CASCADE_MAX_STEPS = 40
# the exact method also keeps dense (n, n) and (n, n_H) matrices (the structured builder's state covariance,
# B_V's recursion), whatever the number of observed messages: beyond this many parties auto uses the bound
# (a trace of 30,000 parties and no message asked the exact method for 6 GiB, 10^7 parties for 655 TiB)
EXACT_MAX_PARTIES = 5000
