"""`python -m gateway ...` is `pacer gateway ...`."""
import argparse
import sys

from gateway.cli import register
from shared.errors import PacerError

parser = argparse.ArgumentParser(prog="python -m gateway")
register(parser.add_subparsers(dest="command", required=True))
args = parser.parse_args(["gateway", *sys.argv[1:]])
try:
    sys.exit(args.run(args))
except PacerError as e:
    print(f"pacer: error: {e}", file=sys.stderr)
    sys.exit(1)
except KeyboardInterrupt:
    sys.exit(130)
