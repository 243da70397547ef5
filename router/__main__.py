from router.cli import entry

entry()
