"""`localserve` entry point: one module per subcommand, one-line errors, non-zero exits."""

from __future__ import annotations

import argparse
import errno
import sys

from cli import batch, bench, models, ps, pull, run, serve, usage
from cli import eval as eval_cmd


class _IntermixedParser(argparse.ArgumentParser):
    """A subcommand's parser taking options before, between or after its positionals
    (`run NAME --dtype fp32 PROMPT`): plain argparse gives an optional positional up once an
    option follows the first one."""

    _inside = False

    def parse_known_args(self, args=None, namespace=None):
        nested = any(isinstance(a, argparse._SubParsersAction) for a in self._actions)
        if self._inside or nested:  # the intermixed parse calls back in here; it takes no
            return super().parse_known_args(args, namespace)  # subcommands (`batch status`)
        self._inside = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inside = False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="localserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_IntermixedParser)
    for module in (pull, models, run, serve, ps, batch, usage, bench, eval_cmd):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("localserve: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        if e.errno == errno.ENOSPC:
            print(f"localserve: error: no space left on device ({e.filename or 'disk full'})",
                  file=sys.stderr)
        else:
            print(f"localserve: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - every failure ends as one line, not a traceback
        if _is_user_error(e):
            print(f"localserve: error: {e}", file=sys.stderr)
            return 1
        raise


def _is_user_error(e: Exception) -> bool:
    from cli.http import ServerError
    from server.models.config import UnsupportedModelError
    from storage.gguf import GGUFError
    from storage.models import ModelStoreError
    from storage.sources import SourceError
    from storage.sql import StoreError

    return isinstance(e, SourceError | ModelStoreError | UnsupportedModelError | GGUFError
                      | StoreError | ServerError | ValueError)


if __name__ == "__main__":
    sys.exit(main())
