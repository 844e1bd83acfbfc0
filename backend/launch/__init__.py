"""kvpool's processes as children: nodes, redis-servers, and what both need (ready lines, logs, stops).

The one launcher the tests and the benchmarks share, so tests need not import ``bench``.
"""
