"""The exit codes of ``kvpool`` (docs/cli.md), so a script can tell a usage error from a failure.

A ConfigError is a usage error: the flags, URL, config file or environment ask for something
invalid, and it is raised before anything is changed.
"""

EXIT_OK = 0
EXIT_ERROR = 1  # a kvpool error: Redis or a node unreachable, a failed operation
EXIT_USAGE = 2
EXIT_PROBLEMS = 3  # `kvpool check` found problems (fixed or not): a cron job can alert on it
EXIT_BROKEN_PIPE = 141  # stdout closed early (`kvpool ls | head`): 128 + SIGPIPE, as cat or grep exit
EXIT_TERMINATED = 143  # SIGTERM while a node started (128 + SIGTERM): it gave back what it had taken
