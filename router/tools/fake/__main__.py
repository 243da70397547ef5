"""`python -m router.tools.fake`: bench/ and the tests start the fake replica this way."""

from router.tools.fake.cli import main

if __name__ == "__main__":
    main()
