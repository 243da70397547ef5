"""`python -m router.tools.fake` (`router fake`): bench/ and the tests start the fake replica this way."""

import sys

from router.tools.fake.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m router.tools.fake"))
