"""The ``kvpool`` entry point: the parser of every verb family, and the one place errors become exit codes."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, cast

from backend.cli import diagnose, events, listing, lmcache, maintenance, pinning, quotas, serve
from backend.cli.exits import EXIT_BROKEN_PIPE, EXIT_ERROR, EXIT_USAGE
from backend.cli.output import print_json
from backend.config import ENV_DEBUG, ENV_URL, env_flag
from backend.config.suggest import did_you_mean
from backend.errors import ConfigError, KVPoolError, RedisUnreachableError
from backend.version import __version__

__all__ = ["main", "build_parser"]

SERVER_VERBS = ("up", "node")  # long-running: they log their progress at INFO


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors for an unknown verb, value or flag name the close one."""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # argparse's one check of a choice (a verb, --channel's value); Python 3.14's suggest_on_error does the same.
        choices = action.choices
        if choices is not None and value not in choices:
            hint = did_you_mean(str(value), [str(choice) for choice in choices])
            listed = ", ".join(repr(choice) for choice in choices)
            raise argparse.ArgumentError(
                action, f"invalid choice: {value!r}{'; ' + hint if hint else ''} (choose from {listed})"
            )

    def verbs(self) -> dict[str, Parser]:
        """The parsers of the verbs under this one, by name; empty where none is."""
        families = [action.choices for action in self._actions if isinstance(action.choices, dict)]
        return families[0] if families else {}

    def flag_names(self) -> list[str]:
        """Every flag of this parser and of the verbs under it."""
        return [*self._option_string_actions, *(flag for sub in self.verbs().values() for flag in sub.flag_names())]


def build_parser() -> Parser:
    parser = Parser(prog="kvpool", description="Run and manage a kvpool KV-cache pool.")
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    # Not required here: main() names an unknown flag before it says a verb is missing.
    # Each verb's parser is a Parser too (argparse makes them of the parent's class); the families take any.
    verbs = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]", parser.add_subparsers(dest="verb", metavar="VERB")
    )
    serve.add_verbs(verbs)
    listing.add_verbs(verbs)
    maintenance.add_verbs(verbs)
    pinning.add_verbs(verbs)
    events.add_verbs(verbs)
    quotas.add_verbs(verbs)
    diagnose.add_verbs(verbs)
    lmcache.add_verbs(verbs)
    return parser


def _flag_hint(parser: Parser, verb: str | None, unknown: list[str]) -> str:
    """``"; did you mean --dram?"`` for the first unknown flag, among the flags of ``verb`` (or kvpool's own)."""
    flags = [arg.partition("=")[0] for arg in unknown if arg.startswith("-")]
    if not flags:
        return ""
    verbs = parser.verbs()
    known = verbs[verb].flag_names() if verb in verbs else parser.flag_names()
    hint = did_you_mean(flags[0], known)
    return f"; {hint}" if hint else ""


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    **serve.COMMANDS,
    **listing.COMMANDS,
    **maintenance.COMMANDS,
    **pinning.COMMANDS,
    **events.COMMANDS,
    **quotas.COMMANDS,
    **diagnose.COMMANDS,
    **lmcache.COMMANDS,
}


STALE_URL_HINT = (
    f"; {ENV_URL} came from the environment and may be stale from an earlier `kvpool up` (its Redis port "
    f"changes every run): export the {ENV_URL} the running `kvpool up` printed, or pass --url"
)


def _failed(exc: KVPoolError, *, json_out: bool, url_from_env: bool) -> int:
    """A verb failed with ``exc``: one line on stderr (and with ``--json`` a JSON object on stdout); its exit code."""
    code = EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_ERROR
    message = str(exc)
    if isinstance(exc, RedisUnreachableError) and url_from_env:
        message += STALE_URL_HINT
    if json_out:
        print_json({"error": message, "type": type(exc).__name__, "exit_code": code})
    print(f"kvpool: error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # before the missing verb: `kvpool --bogus` names --bogus
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{_flag_hint(parser, args.verb, unknown)}")
    if args.verb is None:
        parser.error("the following arguments are required: VERB")
    # The one place the CLI reads the environment: the configs take it from here.
    args.environ = dict(os.environ)
    url_from_env = getattr(args, "url", "") is None and bool(args.environ.get(ENV_URL))
    if getattr(args, "url", "") is None:
        args.url = args.environ.get(ENV_URL)
    debug = args.debug or env_flag(args.environ, ENV_DEBUG)
    # The servers (up, node) log what they do at INFO; a one-shot verb prints its answer
    # and keeps stderr for warnings and errors.
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO if args.verb in SERVER_VERBS else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return COMMANDS[args.verb](args)
    except KVPoolError as exc:
        if debug:
            raise
        return _failed(exc, json_out=bool(getattr(args, "json", False)), url_from_env=url_from_env)
    except BrokenPipeError:
        # The reader went away (`kvpool ls | head`): stop quietly. Point stdout at /dev/null
        # so the interpreter's final flush does not report the same broken pipe again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return 130
