"""`python -m gateway ...` is `pacer gateway ...`."""
import sys

from services.cli import main

sys.exit(main(["gateway", *sys.argv[1:]]))
